#!/usr/bin/env bash
# Sourced by run.sh and test.sh: virtualenv, pinned packages, Flower environment,
# Fashion-MNIST. Idempotent: a second call only checks. Sourced, it leaves the
# caller's shell options as they were and reports a failure with `return`, never
# `exit` (a user's terminal stays open).
FEDHET_SETUP_SOURCE="${BASH_SOURCE[0]}"
_fedhet_setup() {
  FEDHET_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  cd "$FEDHET_ROOT" || return 1

  say() { printf '[setup] %s\n' "$*" >&2; }

  # 1. Python 3.10-3.12 and a local virtualenv with the pinned packages.
  PY="${PYTHON:-}"
  if [ -z "$PY" ]; then
    for cand in python3.11 python3.12 python3.10 python3; do
      if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(not (3,10) <= sys.version_info[:2] <= (3,12))'; then
        PY="$cand"; break
      fi
    done
  fi
  [ -n "$PY" ] || { say "need Python 3.10-3.12 (3.11 recommended); set PYTHON=/path/to/python"; return 1; }
  if [ ! -x .venv/bin/python ]; then
    say "creating .venv with $($PY --version)"
    "$PY" -m venv .venv || return 1
  fi
  stamp=".venv/.fedhet-installed"
  want="$(sha256sum pyproject.toml | cut -c1-16)"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    say "installing pinned packages into .venv (torch 2.14.1, torchvision 0.29.1, flwr 1.42.0, ...)"
    .venv/bin/python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
    .venv/bin/python -m pip install --quiet -e ".[dev]" || return 1
    echo "$want" > "$stamp"
  fi
  # shellcheck disable=SC1091
  source .venv/bin/activate || return 1

  # 2. Flower environment (see README "Environment").
  export FLWR_HOME="${FLWR_HOME:-$FEDHET_ROOT/.flwr}"
  export FLWR_TELEMETRY_ENABLED=0
  export FLWR_DISABLE_UPDATE_CHECK=1
  export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
  mkdir -p "$FLWR_HOME"

  # 3. Fashion-MNIST: Debian package, else a torchvision download, else say what to do.
  FMNIST_SYS=/usr/share/datasets/fashion-mnist
  FMNIST_ROOT="$HOME/.cache/fedhet/datasets"
  have_fmnist() {
    [ -f "$FMNIST_SYS/train-images-idx3-ubyte.gz" ] ||
      [ -f "$FMNIST_ROOT/FashionMNIST/raw/train-images-idx3-ubyte.gz" ] ||
      [ -f "$FMNIST_ROOT/FashionMNIST/raw/train-images-idx3-ubyte" ]
  }
  if ! have_fmnist; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo -n"
    if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" -eq 0 ] || [ -n "$SUDO" ]; }; then
      say "installing Fashion-MNIST (apt-get install dataset-fashion-mnist)"
      $SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 ||
        { $SUDO apt-get update -qq >/dev/null 2>&1 && $SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1; } || true
    fi
  fi
  if ! have_fmnist; then
    say "downloading Fashion-MNIST with torchvision into $FMNIST_ROOT"
    python -c "import torchvision,sys; torchvision.datasets.FashionMNIST(sys.argv[1], download=True)" "$FMNIST_ROOT" >/dev/null 2>&1 || true
  fi
  if ! have_fmnist; then
    say "Fashion-MNIST not found and could not be installed or downloaded."
    say "Do one of: 'sudo apt-get install dataset-fashion-mnist'; or put the four"
    say "*-ubyte.gz files in $FMNIST_ROOT/FashionMNIST/raw/; or run with"
    say "data.root=<folder with the files>."
    return 1
  fi
}

if [ "$FEDHET_SETUP_SOURCE" = "$0" ]; then
  set -euo pipefail  # run as a script
  _fedhet_setup
else
  _fedhet_setup
  _fedhet_status=$?
  unset -f _fedhet_setup say have_fmnist
  return "$_fedhet_status"
fi
