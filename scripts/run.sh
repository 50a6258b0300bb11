#!/usr/bin/env bash
# Quick start, command 1: set everything up, then run the main job
# (`flwr run .`: 20 simulated clients, Fashion-MNIST, Dirichlet 0.1, cnn family).
# Extra arguments are passed to `fedhet simulate` (e.g. -c "num-server-rounds=2").
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
exec fedhet simulate --num-supernodes 20 "$@"
