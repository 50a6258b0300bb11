#!/usr/bin/env bash
# Quick start, command 2: set everything up, then run the whole test suite.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
exec python -m pytest -q "$@"
