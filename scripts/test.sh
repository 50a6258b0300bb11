#!/usr/bin/env bash
# Quick start, command 2: set everything up, then run the whole test suite.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

# docker-compose 1.29.2 in its own virtualenv, to validate docker-compose.yml offline
# (the pins: scripts/compose-venv.sh).
PYTHON="$PY" bash scripts/compose-venv.sh

exec python -m pytest -q --durations=15 "$@"
