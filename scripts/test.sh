#!/usr/bin/env bash
# Quick start, command 2: set everything up, then the tests.
#   bash scripts/test.sh          the fast tier: every test not marked e2e or slow (two
#                                 pytest-xdist workers; FEDHET_TEST_WORKERS=0: one process)
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
  # Two passes: everything but the `serial` tests on two workers (most of the full tier
  # waits on processes it started), then the tests with timings, alone.
  # (pytest's 5, "no test selected", is not a failure when `-k` picks from one pass only)
  status=0 empty=0
  for pass in parallel serial; do
    if [ "$pass" = parallel ]; then
      args=(--durations=15 -n "${FEDHET_TEST_WORKERS:-2}" --dist loadgroup -m "not serial")
    else
      args=(--durations=10 -m serial)
    fi
    rc=0
    python -m pytest -q "${args[@]}" "$@" || rc=$?
    if [ "$rc" -eq 5 ]; then empty=$((empty + 1)); elif [ "$rc" -ne 0 ]; then status=$rc; fi
  done
  [ "$empty" -lt 2 ] || status=5
  exit "$status"
fi
# the fast tier: no `serial` test in it (those are all e2e or slow), two workers as well
exec python -m pytest -q --durations=15 -n "${FEDHET_TEST_WORKERS:-2}" --dist loadgroup \
  -m "not e2e and not slow" "$@"
