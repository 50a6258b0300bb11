#!/usr/bin/env bash
# docker-compose 1.29.2 in its own virtualenv, .venv-compose: validates docker-compose.yml
# offline (tests/test_compose.py) and drives a Docker engine where neither `docker compose`
# (v2) nor a working `docker-compose` is installed (scripts/compose-check.sh).
#
# The pins live here and nowhere else (docs/deployment.md, "Docker", names them):
#   docker-compose==1.29.2   the last Python release of Compose
#   docker<7                 docker 7 dropped kwargs_from_env(ssl_version=...), which 1.29.2 passes
#   requests<2.32            requests 2.32 rejects docker-py 6's "http+docker" URL scheme
#   pyyaml==5.4.1            what 1.29.2 accepts (<6); its sdist builds only with Cython < 3
# Idempotent: a second call only checks. PYTHON selects the interpreter (default python3).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=.venv-compose
PINS=("docker-compose==1.29.2" "docker<7" "requests<2.32")
STAMP="$VENV/.fedhet-pins"
WANT="pyyaml==5.4.1 ${PINS[*]}"
if [ -x "$VENV/bin/docker-compose" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ]; then
  exit 0
fi
printf '[compose-venv] creating %s (%s)\n' "$VENV" "$WANT" >&2
"${PYTHON:-python3}" -m venv "$VENV"
"$VENV/bin/pip" install --quiet "cython<3" wheel "setuptools<70"
"$VENV/bin/pip" install --quiet --no-build-isolation "pyyaml==5.4.1"
"$VENV/bin/pip" install --quiet "${PINS[@]}"
"$VENV/bin/docker-compose" version >/dev/null
echo "$WANT" > "$STAMP"
