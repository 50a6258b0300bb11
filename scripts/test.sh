#!/usr/bin/env bash
# Quick start, command 2: set everything up, then the tests.
#   bash scripts/test.sh          the fast tier: every test not marked e2e or slow
#   bash scripts/test.sh --all    every test (what CI runs): real federations, flwr run
#                                 simulations, compose validation, warm-executor children
# Other arguments go to pytest (e.g. -k fedre, -x).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

if [ "${1:-}" = "--all" ]; then
  shift
  # docker-compose 1.29.2 in its own virtualenv, to validate docker-compose.yml offline
  # (the pins: scripts/compose-venv.sh).
  PYTHON="$PY" bash scripts/compose-venv.sh
  exec python -m pytest -q --durations=15 "$@"
fi
exec python -m pytest -q --durations=15 -m "not e2e and not slow" "$@"
