#!/usr/bin/env bash
# Quick start, command 2: set everything up, then run the whole test suite.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

# docker-compose 1.29.2 in its own virtualenv, to validate docker-compose.yml offline
# (PyYAML 5.4.1, which it pins, only builds with Cython < 3).
if [ ! -x .venv-compose/bin/docker-compose ]; then
  say "creating .venv-compose (docker-compose 1.29.2, for validating docker-compose.yml)"
  "$PY" -m venv .venv-compose
  .venv-compose/bin/pip install --quiet "cython<3" wheel "setuptools<70"
  .venv-compose/bin/pip install --quiet --no-build-isolation "pyyaml==5.4.1"
  .venv-compose/bin/pip install --quiet docker-compose==1.29.2
fi

exec python -m pytest -q --durations=15 "$@"
