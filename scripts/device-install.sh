#!/usr/bin/env bash
# One command per device (Raspberry Pi 4/5, Jetson, any 64-bit Linux with systemd): a
# virtualenv at /opt/fedhet with the pinned runtime (CPU torch from PyTorch's CPU index,
# or everything from a wheelhouse copied onto the device), fedhet's wheel, the node's
# settings in /etc/fedhet and the systemd pair of deploy/systemd, enabled and started.
# See docs/deployment.md "Running a client on a Raspberry Pi / Jetson" and docs/devices.md.
#
#   tar xzf node-0-bundle.tar.gz      # `fedhet keys deploy/keys --bundle 0 --ca ...`
#   sudo bash scripts/device-install.sh --superlink superlink.example.org:9092 \
#       --node-config 'partition-id=0 num-partitions=20 profile="auto" state-dir="/var/lib/fedhet"' \
#       --ca node-0/ca.crt --key node-0/node.key --superexec-secret node-0/superexec.secret
#
# Run it again to upgrade: the venv is reused and, without --superlink / --node-config /
# --ca / --key / --superexec-secret, /etc/fedhet keeps what it has. Exit status: 0 done,
# 2 refused (nothing changed), 1 a step failed. --dry-run changes nothing outside a
# prefix of its own (a new temporary folder unless --prefix names one).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQUIREMENTS="$ROOT/deploy/device-requirements.txt"
UNIT_SRC="$ROOT/deploy/systemd"
UNITS=(fedhet-supernode.service fedhet-superexec.service)
DEFAULT_TORCH_INDEX="https://download.pytorch.org/whl/cpu"
DEFAULT_STATE_DIR="/var/lib/fedhet"

say() { printf '[device-install] %s\n' "$*"; }
warn() { printf '[device-install] warning: %s\n' "$*" >&2; }
refuse() { printf 'device-install: %s\n' "$*" >&2; exit 2; }
fail() { printf 'device-install: %s\n' "$*" >&2; exit 1; }

usage() {
  cat <<EOF
usage: sudo bash scripts/device-install.sh [options]

Installs fedhet on this device: /opt/fedhet (virtualenv), /etc/fedhet (node.env,
ca.crt, node.key, superexec.secret), the node's state folder (default /var/lib/fedhet),
/etc/systemd/system/fedhet-{supernode,superexec}.service. Example, with the files of
this node's bundle (fedhet keys deploy/keys --bundle 0 --ca deploy/certs/ca.crt, made
where the keys are; copy only it to the device, then tar xzf node-0-bundle.tar.gz):

  sudo bash scripts/device-install.sh --superlink superlink.example.org:9092 \\
      --node-config 'partition-id=0 num-partitions=20 profile="auto" state-dir="/var/lib/fedhet"' \\
      --ca node-0/ca.crt --key node-0/node.key --superexec-secret node-0/superexec.secret

  --superlink HOST:PORT  the SuperLink's Fleet API (written to node.env as SUPERLINK)
  --node-config STR      this node's config, e.g. 'partition-id=0 num-partitions=20
                         profile="auto" state-dir="/var/lib/fedhet"' (written to
                         node.env as NODE_CONFIG); without state-dir= the install adds
                         state-dir="$DEFAULT_STATE_DIR" (the personal model survives a
                         restart), without onnx-export= it adds onnx-export=true (the
                         node keeps its current model as ONNX in its state folder)
  --ca FILE              the SuperLink's CA certificate (copied to /etc/fedhet/ca.crt)
  --key FILE             this node's private key, registered on the SuperLink with
                         'flwr supernode register' (copied to /etc/fedhet/node.key, 0400)
  --superexec-secret FILE  this node's executor secret (node-<i>.superexec-secret of
                         'fedhet keys'; copied to /etc/fedhet/superexec.secret, 0400):
                         the SuperNode hands tasks only to an executor that has it
  --wheelhouse DIR       install offline: every package from DIR
                         (pip --no-index --find-links DIR); see docs/devices.md for building one
  --torch-index URL      where torch/torchvision come from when there is no wheelhouse
                         (default $DEFAULT_TORCH_INDEX, CPU builds); the rest comes
                         from pip's index (PyPI)
  --torch-wheels DIR     install torch and torchvision from the wheels in DIR, whatever
                         their version (NVIDIA's wheels for a Jetson's JetPack); the
                         project itself pins and tests torch 2.14.1 / torchvision 0.29.1
  --wheel PATH           fedhet's wheel (pip wheel --no-deps -w dist .); default: build it
                         from this checkout
  --python PY            the interpreter for the virtualenv (default python3; 3.10-3.12)
  --user NAME            the service user (default fedhet; an existing user is used as
                         it is, and gets the state folder)
  --prefix DIR           root of every path above (default /); any other root is for
                         tests and needs --dry-run (a virtualenv cannot be moved)
  --dry-run              build the virtualenv and write the files under a prefix (--prefix,
                         or a new temporary folder), but run no useradd, chown or
                         systemctl: print them instead (downloads torch: GBs)
  --plan                 check everything and print what the install would do, then stop:
                         downloads, builds, writes and changes nothing (no root needed)
  -h, --help             this text
EOF
}

PREFIX=""
PY="python3"
WHEEL=""
WHEELHOUSE=""
TORCH_INDEX="$DEFAULT_TORCH_INDEX"
TORCH_WHEELS=""
SUPERLINK=""
NODE_CONFIG=""
NODE_CONFIG_SET=0
CA=""
KEY=""
SECRET=""
SVC_USER="fedhet"
DRY_RUN=0
PLAN=0

while [ $# -gt 0 ]; do
  opt="$1"
  case "$opt" in
    -h | --help) usage; exit 0 ;;
    --dry-run) DRY_RUN=1; shift; continue ;;
    --plan) PLAN=1; shift; continue ;;
    --prefix | --python | --wheel | --wheelhouse | --torch-index | --torch-wheels | \
      --superlink | --node-config | --ca | --key | --superexec-secret | --user) ;;
    *) refuse "unknown option $opt (see --help)" ;;
  esac
  [ $# -ge 2 ] || refuse "$opt needs a value (see --help)"
  case "$opt" in
    --prefix) PREFIX="$2" ;;
    --python) PY="$2" ;;
    --wheel) WHEEL="$2" ;;
    --wheelhouse) WHEELHOUSE="$2" ;;
    --torch-index) TORCH_INDEX="$2" ;;
    --torch-wheels) TORCH_WHEELS="$2" ;;
    --superlink) SUPERLINK="$2" ;;
    --node-config) NODE_CONFIG="$2"; NODE_CONFIG_SET=1 ;;
    --ca) CA="$2" ;;
    --key) KEY="$2" ;;
    --superexec-secret) SECRET="$2" ;;
    --user) SVC_USER="$2" ;;
  esac
  shift 2
done

# ---------------------------------------------------------------- 1. refusals first
# Everything below is checked before anything is written (a dry run without --prefix
# makes its temporary prefix first, and removes it again when it refuses).
DRY_PREFIX=""
if [ -z "$PREFIX" ]; then
  if [ "$PLAN" = 1 ]; then
    PREFIX="/"  # a plan writes nothing: the real paths, only read
  elif [ "$DRY_RUN" = 1 ]; then
    PREFIX="$(mktemp -d "${TMPDIR:-/tmp}/fedhet-dry-run.XXXXXX")" ||
      fail "could not make a temporary folder for the dry run (TMPDIR=${TMPDIR:-/tmp})"
    DRY_PREFIX="$PREFIX"
    say "dry run without --prefix: everything goes under the new temporary folder $PREFIX"
  else
    PREFIX="/"
  fi
fi
drop_dry_prefix() { # a dry run's own temporary prefix goes again, and says so
  if [ -n "$DRY_PREFIX" ] && [ -d "$DRY_PREFIX" ]; then
    rm -rf "$DRY_PREFIX"
    printf 'device-install: removed the dry run\x27s folder %s\n' "$DRY_PREFIX" >&2
  fi
}
refuse() { printf 'device-install: %s\n' "$*" >&2; drop_dry_prefix; exit 2; }
fail() { printf 'device-install: %s\n' "$*" >&2; drop_dry_prefix; exit 1; }
case "$PREFIX" in
  /*) ;;
  *) refuse "--prefix must be an absolute path, got '$PREFIX'" ;;
esac
ROOTFS="${PREFIX%/}"
if [ "$DRY_RUN" = 1 ] && [ -z "$ROOTFS" ]; then
  refuse "--dry-run --prefix /: a dry run never writes outside a prefix of its own; leave --prefix out (a temporary folder) or name an empty folder"
fi
VENV="$ROOTFS/opt/fedhet"
ETC="$ROOTFS/etc/fedhet"
UNIT_DIR="$ROOTFS/etc/systemd/system"

if [ "$DRY_RUN" = 0 ] && [ "$PLAN" = 0 ]; then
  [ -z "$ROOTFS" ] ||
    refuse "--prefix $PREFIX: the virtualenv must be built where it will run (/opt/fedhet); use another prefix only with --dry-run"
  [ "$(id -u)" = 0 ] ||
    refuse "this writes /opt/fedhet, /etc/fedhet and systemd units: run it with sudo (or try --dry-run --prefix /tmp/fedhet-root first)"
fi

[ -f "$REQUIREMENTS" ] || fail "$REQUIREMENTS is missing: run this script from a fedhet checkout"
for unit in "${UNITS[@]}"; do
  [ -f "$UNIT_SRC/$unit" ] || fail "$UNIT_SRC/$unit is missing: run this script from a fedhet checkout"
done
pin() { sed -n "s/^$1==\([^ ;#]*\).*/\1/p" "$REQUIREMENTS" | head -n 1; }
TORCH_VERSION="$(pin torch)"
TORCHVISION_VERSION="$(pin torchvision)"
[[ -n "$TORCH_VERSION" && -n "$TORCHVISION_VERSION" ]] ||
  fail "$REQUIREMENTS pins no torch==... / torchvision==..."

[[ "$SVC_USER" =~ ^[a-z_][a-z0-9_-]*$ ]] || refuse "--user '$SVC_USER' is not a valid user name"

# The settings: given now, or kept from an earlier install.
if [ -n "$SUPERLINK" ] || [ "$NODE_CONFIG_SET" = 1 ]; then
  [ -n "$SUPERLINK" ] || refuse "--node-config without --superlink: node.env needs both"
  [ "$NODE_CONFIG_SET" = 1 ] || refuse "--superlink without --node-config: node.env needs both"
  [[ "$SUPERLINK" =~ ^([A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}$ ]] ||
    refuse "--superlink '$SUPERLINK' is not HOST:PORT (e.g. superlink.example.org:9092)"
  case "$NODE_CONFIG" in
    *$'\n'* | *$'\r'*) refuse "--node-config must be one line" ;;
  esac
elif [ ! -f "$ETC/node.env" ]; then
  refuse "no $ETC/node.env yet: pass --superlink HOST:PORT and --node-config '...' (see deploy/systemd/node.env.example)"
fi
if [ -n "$CA" ]; then
  [[ -f "$CA" && -r "$CA" ]] || refuse "--ca $CA: no such readable file"
elif [ ! -f "$ETC/ca.crt" ]; then
  refuse "no $ETC/ca.crt yet: pass --ca FILE, the CA certificate of the SuperLink's TLS certificate (the SuperNode unit uses --root-certificates $ETC/ca.crt)"
fi
if [ -n "$KEY" ]; then
  [[ -f "$KEY" && -r "$KEY" ]] || refuse "--key $KEY: no such readable file"
elif [ ! -f "$ETC/node.key" ]; then
  refuse "no $ETC/node.key yet: pass --key FILE, this node's private key (make one with 'fedhet keys', register its .pub with 'flwr supernode register')"
fi
if [ -n "$SECRET" ]; then
  [[ -f "$SECRET" && -r "$SECRET" && -s "$SECRET" ]] || refuse "--superexec-secret $SECRET: no such readable, non-empty file"
elif [ ! -f "$ETC/superexec.secret" ]; then
  refuse "no $ETC/superexec.secret yet: pass --superexec-secret FILE, this node's executor secret (node-<i>.superexec-secret from 'fedhet keys'; 'fedhet keys DIR --secrets-only' adds them to keys made earlier; the node's bundle has it as superexec.secret)"
fi

# The node config the install writes: the one given, with a state folder and the ONNX
# export unless it names them; or the one node.env has (kept as it is).
if [ "$NODE_CONFIG_SET" = 1 ]; then
  ADDED=""
  if ! [[ "$NODE_CONFIG" =~ (^|[[:space:]])state-dir= ]]; then
    NODE_CONFIG="${NODE_CONFIG:+$NODE_CONFIG }state-dir=\"$DEFAULT_STATE_DIR\""
    ADDED="state-dir=\"$DEFAULT_STATE_DIR\""
  fi
  if ! [[ "$NODE_CONFIG" =~ (^|[[:space:]])onnx-export= ]]; then
    NODE_CONFIG="$NODE_CONFIG onnx-export=true"
    ADDED="${ADDED:+$ADDED }onnx-export=true"
  fi
  [ -z "$ADDED" ] || say "node config: added $ADDED (give the key in --node-config to change it)"
  CONFIG_NOW="$NODE_CONFIG"
else
  CONFIG_NOW="$(set +u; set -a; . "$ETC/node.env" >/dev/null 2>&1; printf '%s' "${NODE_CONFIG:-}")"
fi
STATE_DIR=""
if [[ "$CONFIG_NOW" =~ (^|[[:space:]])state-dir=\"([^\"]*)\" ]]; then
  STATE_DIR="${BASH_REMATCH[2]}"
  case "$STATE_DIR" in
    /*) ;;
    *) refuse "state-dir=\"$STATE_DIR\" in the node config is not an absolute path" ;;
  esac
elif [[ "$CONFIG_NOW" =~ (^|[[:space:]])state-dir= ]]; then
  refuse "state-dir in the node config must be a double-quoted absolute path, e.g. state-dir=\"$DEFAULT_STATE_DIR\""
fi
# An existing state folder must already be the service user's: the install makes a new
# one for it, and changes the owner of no folder that is there.
if [ "$DRY_RUN" = 0 ] && [ -n "$STATE_DIR" ] && [ -e "$STATE_DIR" ]; then
  [ -d "$STATE_DIR" ] || refuse "state-dir \"$STATE_DIR\" exists and is not a folder"
  owner="$(stat -c %U "$STATE_DIR")"; owner_id="$(stat -c %u "$STATE_DIR")"
  [ "$owner" = "$SVC_USER" ] ||
    refuse "state-dir \"$STATE_DIR\" exists and belongs to $owner (uid $owner_id), not to the service user $SVC_USER: the install changes the owner of no existing folder; name a new folder in state-dir (it is made for $SVC_USER), or give this one to $SVC_USER yourself"
fi
if [ -n "$WHEEL" ]; then
  [ -f "$WHEEL" ] || refuse "--wheel $WHEEL: no such file"
  case "$(basename "$WHEEL")" in
    fedhet-*.whl) ;;
    *) refuse "--wheel $WHEEL is not a fedhet wheel (fedhet-<version>-py3-none-any.whl)" ;;
  esac
fi
[ -z "$WHEELHOUSE" ] || [ -d "$WHEELHOUSE" ] || refuse "--wheelhouse $WHEELHOUSE: no such directory"
[ -z "$TORCH_WHEELS" ] || [ -d "$TORCH_WHEELS" ] || refuse "--torch-wheels $TORCH_WHEELS: no such directory"

# The interpreter: 64-bit, x86_64 or aarch64, Python 3.10-3.12.
command -v "$PY" >/dev/null 2>&1 ||
  refuse "no Python '$PY' here: install Python 3.10-3.12 (Raspberry Pi OS 12 / Debian 12: python3 is 3.11) or pass --python /path/to/python3.11"
PROBE='import platform, struct, sys; print("%d.%d %s %d" % (sys.version_info[0], sys.version_info[1], platform.machine(), 8 * struct.calcsize("P")))'
probe="$("$PY" -c "$PROBE" 2>/dev/null)" || refuse "'$PY' does not run as a Python interpreter"
[[ "$probe" =~ ^[0-9]+\.[0-9]+\ [^\ ]+\ (32|64)$ ]] || refuse "'$PY' does not run as a Python interpreter (it answered '$probe')"
read -r PY_VERSION MACHINE PY_BITS <<<"$probe"
case "$MACHINE" in
  aarch64 | arm64) ARCH=aarch64 ;;
  x86_64 | amd64 | AMD64) ARCH=x86_64 ;;
  *) ARCH="$MACHINE" ;;
esac
if [ "$PY_BITS" != 64 ]; then
  refuse "$PY is a ${PY_BITS}-bit Python on $MACHINE (a 32-bit OS or userland, e.g. 32-bit Raspberry Pi OS): PyTorch publishes no 32-bit wheels. Install a 64-bit OS (Raspberry Pi OS 64-bit or Ubuntu Server arm64 run on a Pi 3, 4 or 5) and run this again"
fi
case "$ARCH" in
  aarch64 | x86_64) ;;
  armv6l | armv7l | armv8l | i386 | i686)
    refuse "$MACHINE is a 32-bit architecture: PyTorch publishes no wheels for it. Install a 64-bit OS (Raspberry Pi OS 64-bit or Ubuntu Server arm64 on a Pi 3, 4 or 5) and run this again" ;;
  *)
    refuse "$MACHINE: torch $TORCH_VERSION has Linux wheels for aarch64 and x86_64 only; this script supports those two" ;;
esac
case "$PY_VERSION" in
  3.10 | 3.11 | 3.12) ;;
  *)
    refuse "$PY is Python $PY_VERSION; fedhet supports 3.10-3.12 (requires-python in pyproject.toml; torch $TORCH_VERSION and flwr are pinned and tested for those). Install one (Raspberry Pi OS 12 and Debian 12 ship 3.11; elsewhere e.g. 'uv python install 3.11') and pass --python /path/to/python3.11" ;;
esac
CP="cp${PY_VERSION/./}"

# Offline sources must hold wheels for this interpreter and architecture.
wheel_files() { # DIR NAME [VERSION]: "py-tag platform-tag file" of each matching wheel
  local dir=$1 name=$2 version=${3:-} file base parts n
  for file in "$dir/$name"-*.whl; do
    [ -e "$file" ] || continue
    base="$(basename "$file" .whl)"
    IFS=- read -r -a parts <<<"$base"
    n=${#parts[@]}
    [[ "$n" -ge 5 && "${parts[0]}" = "$name" ]] || continue
    if [ -n "$version" ] && [ "${parts[1]}" != "$version" ] && [[ "${parts[1]}" != "$version"+* ]]; then
      continue
    fi
    printf '%s %s %s\n' "${parts[n - 3]}" "${parts[n - 1]}" "$file"
  done
}
FIT=""
check_wheels() { # DIR NAME VERSION(empty: any) WHAT; sets FIT to a wheel that fits
  local dir=$1 name=$2 version=$3 what=$4 found py plat file label
  label="$name${version:+ $version}"
  found="$(wheel_files "$dir" "$name" "$version")"
  [ -n "$found" ] ||
    refuse "$what $dir has no $label wheel: build it as docs/devices.md shows (pip download --only-binary=:all: --platform manylinux_2_28_$ARCH --python-version $PY_VERSION ...)"
  FIT=""
  while read -r py plat file; do
    if [[ ".$py." == *".$CP."* ]] && [[ ".$plat." == *"_$ARCH."* ]]; then
      FIT="$file"
      return 0
    fi
  done <<<"$found"
  refuse "$what $dir has $label wheels for $(awk '{printf "%s/%s ", $1, $2}' <<<"$found")but this device needs $CP on $ARCH ($PY is Python $PY_VERSION): build the wheelhouse with pip download --only-binary=:all: --platform manylinux_2_28_$ARCH --python-version $PY_VERSION (docs/devices.md), or pass the --python it was built for"
}
TORCH_FILES=()
if [ -n "$TORCH_WHEELS" ]; then
  check_wheels "$TORCH_WHEELS" torch "" --torch-wheels
  TORCH_FILES+=("$FIT")
  check_wheels "$TORCH_WHEELS" torchvision "" --torch-wheels
  TORCH_FILES+=("$FIT")
elif [ -n "$WHEELHOUSE" ]; then
  check_wheels "$WHEELHOUSE" torch "$TORCH_VERSION" --wheelhouse
  check_wheels "$WHEELHOUSE" torchvision "$TORCHVISION_VERSION" --wheelhouse
fi
if [ -d "$VENV" ] && [ -x "$VENV/bin/python" ]; then
  have="$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo broken)"
  [ "$have" = "$PY_VERSION" ] ||
    refuse "$VENV is a Python $have virtualenv, $PY is $PY_VERSION: remove it (sudo rm -r $VENV) or pass --python for Python $have"
fi

if [ "$PLAN" = 1 ]; then
  if [ -n "$TORCH_WHEELS" ]; then torch_from="the wheels in $TORCH_WHEELS (${TORCH_FILES[*]})"
  elif [ -n "$WHEELHOUSE" ]; then torch_from="the wheelhouse $WHEELHOUSE (offline)"
  else torch_from="$TORCH_INDEX"; fi
  others_from="the package index (PyPI)"
  [ -z "$WHEELHOUSE" ] || others_from="$WHEELHOUSE"
  say "plan (nothing was downloaded, built, written or changed):"
  printf '  - %s\n' \
    "Python $PY_VERSION on $ARCH ($PY): a virtualenv at $VENV" \
    "torch $TORCH_VERSION and torchvision $TORCHVISION_VERSION from $torch_from" \
    "the other pins of $REQUIREMENTS from $others_from" \
    "fedhet's wheel: ${WHEEL:-built from this checkout}" \
    "the service user $SVC_USER ($(id -u "$SVC_USER" >/dev/null 2>&1 && echo exists || echo 'made with useradd --system'))" \
    "$ETC: node.env (SUPERLINK=${SUPERLINK:-kept}, NODE_CONFIG=${NODE_CONFIG:-kept}), ca.crt, node.key and superexec.secret (0400, $SVC_USER's)" \
    "state folder ${STATE_DIR:-none (the personal model stays in memory)} (0750, $SVC_USER's)" \
    "systemd units ${UNITS[*]} in $UNIT_DIR, enabled and started"
  say "run it with sudo and without --plan to install (a --dry-run builds it under a temporary folder first)"
  exit 0
fi

# ------------------------------------------------------------------------ 2. actions
WORK="$(mktemp -d "${TMPDIR:-/tmp}/fedhet-device-install.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
DONE=()
did() { DONE+=("$*"); say "$*"; }
run() { # a command that changes the system outside the prefix: printed in a dry run
  local cmd
  cmd="$(printf '%q ' "$@")"
  cmd="${cmd% }"
  if [ "$DRY_RUN" = 1 ]; then
    say "dry run, not running: $cmd"
    DONE+=("dry run, not run: $cmd")
  else
    DONE+=("ran: $cmd")
    say "running: $cmd"
    "$@"
  fi
}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
pip_() { "$VENV/bin/python" -m pip "$@"; }
env_quote() { # a double-quoted value for a systemd EnvironmentFile (and for sh)
  local v=$1
  v=${v//\\/\\\\}
  v=${v//\"/\\\"}
  v=${v//\$/\\\$}
  v=${v//\`/\\\`}
  printf '"%s"' "$v"
}
if [ -n "$WHEELHOUSE" ]; then
  FROM=(--no-index --find-links "$WHEELHOUSE")
  SOURCE="wheelhouse $WHEELHOUSE"
else
  FROM=()
  SOURCE="pip's index (PyPI unless pip is configured otherwise)"
fi

DRY_NOTE=""
[ "$DRY_RUN" = 0 ] || DRY_NOTE=", dry run"
say "Python $PY_VERSION on $ARCH ($PY); prefix $PREFIX$DRY_NOTE"

# 2a. The virtualenv.
if [ -x "$VENV/bin/python" ]; then
  did "reusing the virtualenv $VENV"
else
  mkdir -p "$(dirname "$VENV")"
  if ! "$PY" -m venv "$VENV" || [ ! -x "$VENV/bin/python" ]; then
    fail "could not create a virtualenv with $PY (Debian / Raspberry Pi OS: sudo apt install python3-venv), then remove $VENV and run this again"
  fi
  did "created the virtualenv $VENV ($PY, Python $PY_VERSION)"
fi
pip_ --version >/dev/null 2>&1 ||
  fail "$VENV has no pip (Debian / Raspberry Pi OS: sudo apt install python3-venv), remove $VENV and run this again"

# 2b. The pinned runtime.
RUNTIME_REQS="$WORK/runtime-requirements.txt"
if [ -n "$TORCH_WHEELS" ]; then
  pip_ install "${FROM[@]}" "${TORCH_FILES[@]}" ||
    fail "installing ${TORCH_FILES[*]} (their dependencies from $SOURCE) failed"
  did "installed $(for f in "${TORCH_FILES[@]}"; do printf '%s ' "$(basename "$f")"; done)(the project pins and tests torch $TORCH_VERSION / torchvision $TORCHVISION_VERSION only)"
  grep -vE '^(torch|torchvision)([=<>!~ ;[]|$)' "$REQUIREMENTS" >"$RUNTIME_REQS"
else
  cp "$REQUIREMENTS" "$RUNTIME_REQS"
  if [ -z "$WHEELHOUSE" ]; then
    pip_ install --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" ||
      fail "installing torch==$TORCH_VERSION torchvision==$TORCHVISION_VERSION from $TORCH_INDEX failed; without a route to it, build a wheelhouse on another machine (docs/devices.md) and pass --wheelhouse DIR"
    did "installed torch==$TORCH_VERSION torchvision==$TORCHVISION_VERSION from $TORCH_INDEX"
  fi
fi
pip_ install "${FROM[@]}" -r "$RUNTIME_REQS" ||
  fail "installing the runtime ($REQUIREMENTS) from $SOURCE failed"
did "installed the runtime pins of deploy/device-requirements.txt from $SOURCE"

# 2c. fedhet's wheel (its own dependencies are the runtime above: --no-deps; its
# metadata also names flwr[simulation] and matplotlib, which a device does not need).
if [ -z "$WHEEL" ]; then
  if ! "$VENV/bin/python" -c 'import setuptools' 2>/dev/null; then
    pip_ install "${FROM[@]}" "setuptools>=77" || fail "installing setuptools (to build fedhet's wheel) failed"
  fi
  mkdir -p "$WORK/src" "$WORK/dist"
  packages="$("$VENV/bin/python" - "$ROOT/pyproject.toml" <<'EOF'
import sys
try:
    import tomllib
except ImportError:  # Python 3.10: tomli comes with flwr
    import tomli as tomllib
with open(sys.argv[1], "rb") as fh:
    print(" ".join(tomllib.load(fh)["tool"]["setuptools"]["packages"]))
EOF
)"
  cp "$ROOT/pyproject.toml" "$ROOT/README.md" "$WORK/src/"
  for package in $packages; do
    cp -R "$ROOT/$package" "$WORK/src/$package"
  done
  find "$WORK/src" -name __pycache__ -prune -exec rm -rf {} +
  pip_ wheel --quiet --no-deps --no-build-isolation --no-index -w "$WORK/dist" "$WORK/src" ||
    fail "building fedhet's wheel from $ROOT failed; build it elsewhere (pip wheel --no-deps -w dist .) and pass --wheel"
  WHEEL="$(ls "$WORK"/dist/fedhet-*.whl)"
  did "built $(basename "$WHEEL") from $ROOT"
fi
pip_ install --no-deps --no-index --force-reinstall "$WHEEL" || fail "installing $WHEEL failed"
did "installed $(basename "$WHEEL") (--no-deps)"

# 2d. Does it import? The ClientApp, the warm executor, the CLI, and this node's config
# through Flower's own parser.
report="$("$VENV/bin/python" - "$NODE_CONFIG" <<'EOF'
import sys

import flwr
import numpy
import torch
import torchvision
from flwr.common.config import parse_config_args

import cli.main  # the `fedhet` command
import cli.supernode  # `fedhet supernode`
import cli.warm  # `fedhet superexec`
import client_app.app  # the ClientApp

if sys.argv[1]:
    try:
        parse_config_args([sys.argv[1]])
    except Exception as exc:  # Flower raises ValueError and TOML errors
        sys.exit(f"--node-config {sys.argv[1]!r} is not valid for Flower: {exc}")
build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
print(
    f"torch {torch.__version__} ({build}), torchvision {torchvision.__version__}, "
    f"flwr {flwr.__version__}, numpy {numpy.__version__}"
)
EOF
)" || fail "the new environment $VENV does not import fedhet's node (see the error above)"
"$VENV/bin/fedhet" --help >/dev/null || fail "$VENV/bin/fedhet --help failed"
venv_mb="$(du -sm "$VENV" | cut -f1)"
did "checked: $VENV imports fedhet's ClientApp and warm executor; $report; $venv_mb MiB on disk"
case "$report" in
  *CUDA*)
    if [ -z "$TORCH_WHEELS" ] && [ -z "$WHEELHOUSE" ] && [ "$TORCH_INDEX" = "$DEFAULT_TORCH_INDEX" ]; then
      fail "torch in $VENV is a CUDA build although it was asked of $TORCH_INDEX: pip's configuration adds another index (extra-index-url in /etc/pip.conf or ~/.config/pip/pip.conf, or PIP_EXTRA_INDEX_URL). Remove it, remove $VENV and run this again, or use --wheelhouse"
    fi
    [ -n "$TORCH_WHEELS" ] ||
      warn "torch is a CUDA build: a device without an NVIDIA GPU needs the CPU build (PyTorch's CPU index or a wheelhouse built from it; PyPI's Linux wheels are CUDA builds)" ;;
esac

# 2e. The service user, /etc/fedhet.
if id -u "$SVC_USER" >/dev/null 2>&1; then
  did "service user $SVC_USER exists"
else
  run useradd --system --home-dir /var/lib/fedhet --create-home --shell /usr/sbin/nologin "$SVC_USER"
fi
mkdir -p "$ETC"
chmod 0755 "$ETC"
if [ -n "$SUPERLINK" ]; then
  {
    echo "# /etc/fedhet/node.env: written by scripts/device-install.sh ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
    echo "SUPERLINK=$(env_quote "$SUPERLINK")"
    echo "NODE_CONFIG=$(env_quote "$NODE_CONFIG")"
  } >"$ETC/node.env.new"
  chmod 0644 "$ETC/node.env.new"
  mv "$ETC/node.env.new" "$ETC/node.env"
  did "wrote $ETC/node.env (SUPERLINK=$SUPERLINK, NODE_CONFIG=$NODE_CONFIG)"
else
  did "kept $ETC/node.env"
fi
if [ -n "$CA" ]; then
  install -m 0644 "$CA" "$ETC/ca.crt"
  did "copied $CA to $ETC/ca.crt (0644)"
else
  did "kept $ETC/ca.crt"
fi
if [ -n "$KEY" ]; then
  install -m 0400 "$KEY" "$ETC/node.key"
  did "copied $KEY to $ETC/node.key (0400)"
else
  did "kept $ETC/node.key"
fi
if [ -n "$SECRET" ]; then
  install -m 0400 "$SECRET" "$ETC/superexec.secret"
  did "copied $SECRET to $ETC/superexec.secret (0400)"
else
  did "kept $ETC/superexec.secret"
fi
run chown "$SVC_USER:" "$ETC/node.key" "$ETC/superexec.secret"
if [ -n "$STATE_DIR" ] && [ "$DRY_RUN" = 1 ]; then
  mkdir -p "$ROOTFS$STATE_DIR"
  chmod 0750 "$ROOTFS$STATE_DIR"
  run chown "$SVC_USER:" "$ROOTFS$STATE_DIR"
  did "state folder $ROOTFS$STATE_DIR (0750; $(id -un)'s: a dry run runs no chown, an install gives it to $SVC_USER)"
elif [ -n "$STATE_DIR" ] && [ -d "$STATE_DIR" ]; then
  # e.g. made by useradd --create-home just now, with useradd's mode: 0750 either way
  run chmod 0750 "$STATE_DIR"
  did "state folder $STATE_DIR exists, owned by $SVC_USER (0750)"
elif [ -n "$STATE_DIR" ]; then
  run install -d -m 0750 -o "$SVC_USER" -g "$(id -gn "$SVC_USER")" "$STATE_DIR"
  did "state folder $STATE_DIR (0750, owned by $SVC_USER)"
else
  warn "the node config has no state-dir: the node keeps its personal model in memory and loses it when it restarts"
fi

# 2f. The systemd pair (their User= is fedhet; another --user gets a drop-in).
mkdir -p "$UNIT_DIR"
for unit in "${UNITS[@]}"; do
  install -m 0644 "$UNIT_SRC/$unit" "$UNIT_DIR/$unit"
  if [ "$SVC_USER" != fedhet ]; then
    mkdir -p "$UNIT_DIR/$unit.d"
    printf '[Service]\nUser=%s\n' "$SVC_USER" >"$UNIT_DIR/$unit.d/user.conf"
  else
    rm -f "$UNIT_DIR/$unit.d/user.conf"
  fi
done
if [ "$SVC_USER" = fedhet ]; then
  did "installed ${UNITS[*]} in $UNIT_DIR"
else
  did "installed ${UNITS[*]} in $UNIT_DIR with User=$SVC_USER drop-ins"
fi
if [ "$DRY_RUN" = 1 ] || command -v systemctl >/dev/null 2>&1; then
  run systemctl daemon-reload
  run systemctl enable "${UNITS[@]}"
  run systemctl restart "${UNITS[@]}"
else
  warn "no systemctl here: start the node yourself ($VENV/bin/fedhet supernode ... and fedhet superexec ..., the units' ExecStart lines)"
fi

echo
if [ "$DRY_RUN" = 1 ]; then
  say "done (dry run: no useradd, chown or systemctl; nothing outside $PREFIX changed; remove it with rm -r $PREFIX):"
else
  say "done:"
fi
for line in "${DONE[@]}"; do
  printf '  - %s\n' "$line"
done
if [ "$DRY_RUN" = 0 ]; then
  say "follow the node: journalctl -u fedhet-supernode -u fedhet-superexec -f"
fi
