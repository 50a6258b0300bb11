#!/usr/bin/env bash
# Build the image, start docker-compose.yml (TLS, node auth, warm executors), run 2
# rounds of fedre from the host through it, show the run's status and the results on
# the host, tear everything down. Needs a Docker engine and network access for the
# build (torch comes from the package registry); not part of the test suite.
#
#   bash scripts/compose-check.sh
#   FEDHET_BASE=<bookworm image with python3-venv> FEDHET_TORCH_INDEX=https://pypi.org/simple \
#   FEDHET_BUILD_CA=/etc/ssl/certs/ca-certificates.crt FEDHET_BUILD_NETWORK=host \
#       bash scripts/compose-check.sh
#
# FEDHET_BASE: base image (default python:3.11-slim-bookworm); FEDHET_TORCH_INDEX: where
# pip finds torch (default the CPU wheels of download.pytorch.org); FEDHET_BUILD_CA: a CA
# bundle pip needs during the build (a TLS-intercepting proxy; used by the build stage
# only, never part of the image); FEDHET_BUILD_NETWORK: docker build --network.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

say() { printf '[compose-check] %s\n' "$*"; }
if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose); else COMPOSE=(docker-compose); fi
export FEDHET_BASE="${FEDHET_BASE:-python:3.11-slim-bookworm}"
export FEDHET_TORCH_INDEX="${FEDHET_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
HOME_DIR="$(mktemp -d)"
CA_COPY=deploy/build-ca/ca.crt

cleanup() {
  say "tearing down"
  "${COMPOSE[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
  rm -rf "$HOME_DIR"
  [ -n "${FEDHET_BUILD_CA:-}" ] && rm -f "$CA_COPY"
}
trap cleanup EXIT

[ -f deploy/certs/ca.crt ] || fedhet certs deploy/certs --host superlink --host localhost --host 127.0.0.1
[ -f deploy/keys/node-2 ] || fedhet keys deploy/keys --nodes 3
mkdir -p deploy/results
[ -n "${FEDHET_BUILD_CA:-}" ] && cp "$FEDHET_BUILD_CA" "$CA_COPY"

say "building fedhet:0.1.0 (base $FEDHET_BASE, torch from $FEDHET_TORCH_INDEX)"
start=$(date +%s)
docker build --network "${FEDHET_BUILD_NETWORK:-default}" --build-arg "BASE=$FEDHET_BASE" \
  --build-arg "TORCH_INDEX=$FEDHET_TORCH_INDEX" -t fedhet:0.1.0 . >/tmp/fedhet-build.log 2>&1 ||
  { tail -30 /tmp/fedhet-build.log; exit 1; }
size=$(docker image inspect fedhet:0.1.0 --format '{{.Size}}')
say "built in $(( $(date +%s) - start )) s; image size $(( size / 1000000 )) MB"

say "starting the stack"
"${COMPOSE[@]}" up -d
for i in $(seq 1 120); do
  healthy=$(docker ps --filter health=healthy --format '{{.Names}}' | grep -c -E 'superlink|supernode' || true)
  [ "$healthy" -ge 4 ] && break
  sleep 2
done
"${COMPOSE[@]}" ps
[ "$healthy" -ge 4 ] || { say "the stack did not become healthy"; "${COMPOSE[@]}" logs --tail 30; exit 1; }

export FLWR_HOME="$HOME_DIR"
cat > "$FLWR_HOME/config.toml" <<EOF
[superlink]
default = "compose"

[superlink.compose]
address = "127.0.0.1:9092"
root-certificates = "$PWD/deploy/certs/ca.crt"
EOF
say "running 2 rounds of fedre from the host"
flwr run . compose --stream --run-config "algorithm='fedre' num-server-rounds=2 data.fraction=0.05" |
  grep --line-buffered -E '\[fedhet\]|ERROR' || true
status=$(flwr list compose --format json | python -c 'import json,sys; print(json.load(sys.stdin)["runs"][0]["status"])')
say "run status: $status"
results=$(ls -t deploy/results/*/results.json | head -1)
say "results on the host: $results"
python - "$results" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
for r in doc["rounds"]:
    print(f"  round {r['round']}: accuracy {r['accuracy']:.4f}, {r['round-time-s']:.1f} s")
EOF
[ "$status" = "finished:completed" ]
