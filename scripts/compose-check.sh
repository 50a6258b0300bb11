#!/usr/bin/env bash
# Build the image, start docker-compose.yml (TLS, node auth, warm executors with their
# node's secret), check the uid of every process in every container (only init is root,
# the SuperLink is FEDHET_UID, all else 49999), that each container holds only its own
# secrets and that an executor without its node's secret gets no task, run 2 rounds of
# fedre from the host twice with `fedhet run` (the second run must repeat the first's
# metrics), check that each node's executor alone holds that node's client files (and
# sees no file another executor wrote), check the results on the host are FEDHET_UID's,
# stop a long run while every node trains (its tasks must end within 10 s; the uids are
# checked again with the task processes running) and run once more, tear everything
# down. Needs a Docker engine and network access for the build (torch comes from a
# package index); not part of the test suite. deploy/results is left for the stack to
# make, as in a fresh clone.
#
#   bash scripts/compose-check.sh
#   FEDHET_BASE=<bookworm image with python3-venv> FEDHET_TORCH_INDEX=https://pypi.org/simple \
#   FEDHET_BUILD_CA=/etc/ssl/certs/ca-certificates.crt FEDHET_BUILD_NETWORK=host \
#       bash scripts/compose-check.sh
#
# FEDHET_BASE: base image (default python:3.11-slim-bookworm); FEDHET_TORCH_INDEX: where
# pip finds torch (default the CPU wheels of download.pytorch.org); FEDHET_BUILD_CA: a CA
# bundle pip needs during the build (a TLS-intercepting proxy; used by the build stage
# only, never part of the image); FEDHET_BUILD_NETWORK: docker build --network;
# FEDHET_UID: the host user the SuperLink runs as (default yours, id -u; as root, e.g.
# FEDHET_UID=1000 tries what a non-root user of a fresh clone gets).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

tell() { printf '[compose-check] %s\n' "$*"; }
die() { printf '[compose-check] %s\n' "$*" >&2; exit 1; }

# 1. Every tool, before anything is built.
command -v docker >/dev/null 2>&1 ||
  die "no 'docker' command: install a Docker engine (Debian/Ubuntu: sudo apt-get install docker.io)"
docker info >/dev/null 2>&1 ||
  die "the Docker engine does not answer ('docker info' failed): start it (sudo systemctl start docker, or dockerd &) and check you may use it (the docker group, or root)"
if docker compose version >/dev/null 2>&1; then
  COMPOSE=(docker compose)
elif command -v docker-compose >/dev/null 2>&1 && docker-compose version >/dev/null 2>&1; then
  COMPOSE=(docker-compose)
else
  tell "no working 'docker compose' or 'docker-compose': making .venv-compose (scripts/compose-venv.sh)"
  command -v python3 >/dev/null 2>&1 || die "python3 is needed to create .venv-compose"
  bash scripts/compose-venv.sh || die "could not create .venv-compose; install Docker's compose plugin or Debian's docker-compose instead"
  COMPOSE=("$PWD/.venv-compose/bin/docker-compose")
fi
tell "compose: ${COMPOSE[*]} ($("${COMPOSE[@]}" version --short 2>/dev/null || echo '?'))"
if (exec 3<>/dev/tcp/127.0.0.1/9092) 2>/dev/null; then
  die "port 9092 on 127.0.0.1 is in use: the SuperLink publishes it (stop what holds it)"
fi
# the project's virtualenv: `fedhet certs/keys` and the `flwr` CLI that starts the run
source scripts/setup.sh

export FEDHET_BASE="${FEDHET_BASE:-python:3.11-slim-bookworm}"
export FEDHET_TORCH_INDEX="${FEDHET_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
export FEDHET_UID="${FEDHET_UID:-$(id -u)}"
HOME_DIR="$(mktemp -d)"
CA_COPY=deploy/build-ca/ca.crt

cleanup() {
  tell "tearing down"
  "${COMPOSE[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
  rm -rf "$HOME_DIR"
  if [ -n "${FEDHET_BUILD_CA:-}" ]; then rm -f "$CA_COPY"; fi
}
trap cleanup EXIT

# 2. Secrets: made here when missing, never the ones earlier versions committed.
LEAKED="af79cfd40605d49bdc432e8dd097a3eb659523fc1cbce1b9c2b4a16fcb0f6158
670fa75569e8eed1c22a1634f68ecc218155bfe6a1dbcd9c5876d0e71e54a766
fa85395549f16dcbc044af1f87718927feed13b763e6288837ee3b02732ead11
2c41bf6b94a829806ce7c3b7db34b1e564154f4a239b7df8f27307cdba4261c0
7be24cf1ff6a9bef8da51865418689617123f36e5e7d5aab5b27f13f5a4477ac"
for f in deploy/certs/ca.key deploy/certs/server.key deploy/keys/node-0 deploy/keys/node-1 deploy/keys/node-2; do
  if [ -f "$f" ] && grep -qx "$(sha256sum "$f" | cut -c1-64)" <<<"$LEAKED"; then
    die "$f is a key that an earlier version of fedhet published in git: rm deploy/certs/ca.* deploy/certs/server.* deploy/keys/node-* and run this again"
  fi
done
[ -f deploy/certs/server.key ] || fedhet certs deploy/certs --host superlink --host localhost --host 127.0.0.1
[ -f deploy/keys/node-2 ] || fedhet keys deploy/keys --nodes 3
[ -f deploy/keys/node-2.superexec-secret ] || fedhet keys deploy/keys --nodes 3 --secrets-only
if [ -d deploy/results ]; then
  tell "deploy/results exists (owner uid $(stat -c %u deploy/results)); the SuperLink writes it as FEDHET_UID=$FEDHET_UID"
else
  tell "no deploy/results: the engine makes it at start, init gives it to FEDHET_UID=$FEDHET_UID"
fi
if [ -n "${FEDHET_BUILD_CA:-}" ]; then cp "$FEDHET_BUILD_CA" "$CA_COPY"; fi

# 3. Build.
tell "building fedhet:0.1.0 (base $FEDHET_BASE, torch from $FEDHET_TORCH_INDEX)"
start=$(date +%s)
docker build --network "${FEDHET_BUILD_NETWORK:-default}" --build-arg "BASE=$FEDHET_BASE" \
  --build-arg "TORCH_INDEX=$FEDHET_TORCH_INDEX" -t fedhet:0.1.0 . >/tmp/fedhet-build.log 2>&1 ||
  { tail -30 /tmp/fedhet-build.log; die "docker build failed (log: /tmp/fedhet-build.log)"; }
size=$(docker image inspect fedhet:0.1.0 --format '{{.Size}}')
tell "built in $(( $(date +%s) - start )) s; image size $(( size / 1000000 )) MB"

# 4. Start.
tell "starting the stack"
"${COMPOSE[@]}" up -d
healthy=0
for _ in $(seq 1 120); do
  healthy=$(docker ps --filter health=healthy --format '{{.Names}}' | grep -c -E 'superlink|supernode' || true)
  [ "$healthy" -ge 4 ] && break
  sleep 2
done
"${COMPOSE[@]}" ps
[ "$healthy" -ge 4 ] || { "${COMPOSE[@]}" logs --tail 30; die "the stack did not become healthy"; }
"${COMPOSE[@]}" logs init | grep -E 'deploy/results' || true

# 5a. The uid of every running process, per service (docker top: the processes as the
# kernel runs them, whatever the files say).
"${COMPOSE[@]}" config >"$HOME_DIR/compose-config.yml"
process_uids() {  # $1: when
  local service cid rows=""
  for service in $("${COMPOSE[@]}" ps --services --filter status=running 2>/dev/null ||
    "${COMPOSE[@]}" ps --services); do
    cid=$("${COMPOSE[@]}" ps -q "$service")
    [ -n "$cid" ] || continue
    [ "$(docker inspect -f '{{.State.Running}}' "$cid")" = true ] || continue
    rows+=$(docker top "$cid" -eo uid,pid,args | tail -n +2 | sed "s/^/$service /")$'\n'
  done
  tell "process uids ($1):"
  python scripts/process_uids.py --config "$HOME_DIR/compose-config.yml" --dockerfile Dockerfile <<<"$rows" ||
    die "a process runs as another uid than its service's ($1)"
}
process_uids "stack up, idle"

# 5. Each container holds only its own secrets.
private_keys() {  # the private-key files a service's container can read
  "${COMPOSE[@]}" exec -T "$1" sh -c \
    'grep -rlE -- "-----BEGIN ([A-Z]+ )*PRIVATE KEY-----" /certs /keys /state /flwr-home /home/fedhet /tmp 2>/dev/null | sort' || true
}
for i in 0 1 2; do
  got=$(private_keys "supernode-$i" | tr '\n' ' ')
  [ "$got" = "/keys/node-$i " ] || die "supernode-$i can read private keys [$got], want only /keys/node-$i"
  mode=$("${COMPOSE[@]}" exec -T "supernode-$i" stat -c '%a %u' "/keys/node-$i" | tr -d '\r')
  [ "$mode" = "400 49999" ] || die "supernode-$i: /keys/node-$i is '$mode', want '400 49999'"
  got=$(private_keys "superexec-$i" | tr '\n' ' ')
  [ -z "$got" ] || die "superexec-$i can read private keys [$got], want none"
done
got=$(private_keys superlink | tr '\n' ' ')
[ "$got" = "/certs/server.key " ] || die "the SuperLink can read private keys [$got], want only /certs/server.key"
tell "secrets: each SuperNode reads only its own key (0400, uid 49999), the SuperLink only server.key"

# 5b. Each node's SuperNode and executor hold that node's secret (0400, 49999); an
# executor without it, or with another node's, is refused and gets no task.
for i in 0 1 2; do
  want=$(sha256sum "deploy/keys/node-$i.superexec-secret" | cut -c1-64)
  for service in "supernode-$i" "superexec-$i"; do
    got=$("${COMPOSE[@]}" exec -T "$service" sh -c 'stat -c "%a %u" /secrets/superexec.secret; sha256sum /secrets/superexec.secret' | tr -d '\r')
    [ "$got" = "400 49999"$'\n'"$want  /secrets/superexec.secret" ] ||
      die "$service: /secrets/superexec.secret is not node $i's secret, 0400, uid 49999 ($got)"
  done
done
intruder() {  # $1: the service whose volumes it has; the rest: extra flags
  local service=$1 status=0 out
  shift
  out=$("${COMPOSE[@]}" run --rm --no-deps -T "$service" fedhet superexec --insecure \
    --runtime-api-address supernode-0:9094 "$@" 2>&1) || status=$?
  [ "$status" = 3 ] || die "an executor for supernode-0 via $service $* was not refused (status $status): $(tail -3 <<<"$out")"
  grep -o 'refused this executor.*' <<<"$out" | head -1 | cut -c1-150
}
tell "an executor for supernode-0 without a secret: $(intruder superexec-0)"
tell "an executor for supernode-0 with node 1's secret: $(intruder superexec-1 --superexec-auth-secret-file /secrets/superexec.secret)"

# 6. Two runs from the host: the second repeats the first.
export FLWR_HOME="$HOME_DIR"
cat > "$FLWR_HOME/config.toml" <<EOF
[superlink]
default = "compose"

[superlink.compose]
address = "127.0.0.1:9092"
root-certificates = "$PWD/deploy/certs/ca.crt"
EOF
RUN_CONFIG="algorithm='fedre' num-server-rounds=2 data.fraction=0.05"
run_once() {  # fedhet run: flwr run --stream, then the run's status; exit 1 unless completed
  tell "run $1: 2 rounds of fedre from the host (fedhet run compose)"
  local status=0
  fedhet run compose -c "$RUN_CONFIG" || status=$?
  tell "run $1: fedhet run exited $status"
  [ "$status" = 0 ] || die "run $1 did not complete"
}
run_once 1
first=$(ls -t deploy/results/*/results.json | head -1)
run_once 2
second=$(ls -t deploy/results/*/results.json | head -1)
[ "$first" != "$second" ] || die "the second run wrote no results"
tell "results on the host: $first, $second (owner uid $(stat -c %u "$second"), FEDHET_UID=$FEDHET_UID)"
[ "$(stat -c %u "$second")" = "$FEDHET_UID" ] && [ "$(stat -c %u "$(dirname "$second")")" = "$FEDHET_UID" ] ||
  die "the results are not owned by FEDHET_UID=$FEDHET_UID"
python - "$first" "$second" <<'EOF'
import json, sys
runs = [json.load(open(path))["rounds"] for path in sys.argv[1:]]
for r in runs[1]:
    print(f"  round {r['round']}: accuracy {r['accuracy']:.4f}, {r['round-time-s']:.1f} s")
same = [(a["accuracy"], a["loss"]) == (b["accuracy"], b["loss"]) for a, b in zip(*runs)]
print(f"  second run repeats the first: {same}")
sys.exit(0 if all(same) else 1)
EOF

# 6b. Each node's partition lives only with its own executor: the client files every
# container holds (node-config data-cache="own"; its cache-<i> volume), and a file one
# executor writes to its cache is seen by no other.
partition_files() {  # train/<i>.npz and test/<i>.npz anywhere in a service's container
  "${COMPOSE[@]}" exec -T "$1" sh -c 'find / \( -path /proc -o -path /sys -o -path /dev \) -prune -o -type f \( -path "*/train/*.npz" -o -path "*/test/*.npz" \) -print 2>/dev/null' |
    tr -d '\r' | sed -E 's#.*/(train|test)/#\1/#' | sort | tr '\n' ' ' || true
}
for i in 0 1 2; do
  got=$(partition_files "superexec-$i")
  [ "$got" = "test/$i.npz train/$i.npz " ] || die "superexec-$i holds client files [$got], want only node $i's"
  "${COMPOSE[@]}" exec -T "superexec-$i" sh -c "echo node-$i > /home/fedhet/.cache/fedhet/written-by-node-$i"
done
for service in superlink supernode-0 supernode-1 supernode-2; do
  got=$(partition_files "$service")
  [ -z "$got" ] || die "$service holds client files [$got], want none"
done
for i in 0 1 2; do
  got=$("${COMPOSE[@]}" exec -T "superexec-$i" sh -c 'ls /home/fedhet/.cache/fedhet | grep written-by' | tr -d '\r' | tr '\n' ' ')
  [ "$got" = "written-by-node-$i " ] || die "superexec-$i sees [$got] in its cache, want only what it wrote"
done
tell "data: each executor holds its own node's train/test files only, no other container any; a file one executor wrote to its cache is seen by no other"

# 7. flwr stop ends a stopped run's tasks on every node, and the next run is not held up.
busy() {  # task children of a node's warm executor: fork server processes but the server
  # (the pattern's brackets keep the sh and grep running it from matching it)
  "${COMPOSE[@]}" exec -T "superexec-$1" sh -c \
    'n=$(grep -l "multiprocessing.forkserve[r]" /proc/[0-9]*/cmdline 2>/dev/null | wc -l); echo $((n > 0 ? n - 1 : 0))' |
    tr -d '\r'
}
tell "run 3: all the data, 50 local epochs a round; stopped once every node trains"
out=$(flwr run . compose --run-config \
  "algorithm='local' num-server-rounds=2 data.fraction=1.0 train.local-epochs=50" 2>&1)
run_id=$(grep -oE 'started run [0-9]+' <<<"$out" | grep -oE '[0-9]+$' || true)
[ -n "$run_id" ] || die "could not start run 3: $out"
for _ in $(seq 1 240); do
  training=0
  for i in 0 1 2; do [ "$(busy "$i")" -gt 0 ] && training=$((training + 1)); done
  [ "$training" -eq 3 ] && break
  sleep 0.5
done
[ "$training" -eq 3 ] || die "run 3: the nodes never all trained"
process_uids "run 3 training: the task processes too"
flwr stop "$run_id" compose >/dev/null
stopped=$(date +%s.%N)
while :; do
  left=0
  for i in 0 1 2; do left=$((left + $(busy "$i"))); done
  gone=$(python -c "import sys; print(f'{float(sys.argv[1]) - float(sys.argv[2]):.1f}')" "$(date +%s.%N)" "$stopped")
  [ "$left" -eq 0 ] && break
  python -c "import sys; sys.exit(float(sys.argv[1]) < 60)" "$gone" && die "run 3: $left task children still alive 60 s after flwr stop"
  sleep 0.2
done
tell "run 3 stopped: every node's task children gone ${gone} s after flwr stop returned"
start=$(date +%s)
run_once 4
tell "run 4 took $(( $(date +%s) - start )) s in all"
python -c "import sys; sys.exit(float(sys.argv[1]) >= 10)" "$gone" || die "run 3's tasks outlived flwr stop by more than 10 s"
tell "ok"
