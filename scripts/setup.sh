#!/usr/bin/env bash
# One-shot, idempotent set-up of everything dosa needs on a Debian 12 machine.
# Safe to re-run: each step checks whether it is already done.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${DOSA_VENV:-$ROOT/.venv}
PY=${DOSA_PYTHON:-python3.11}
STAMP=$VENV/.dosa-setup-stamp

die() { echo "setup: $*" >&2; exit 1; }
log() { echo "setup: $*"; }

[ "$(id -u)" = 0 ] || die "must run as root (it installs Debian packages and needs BPF privileges)"

# 1. Debian packages --------------------------------------------------------
PKGS="python3-venv clang llvm python3-bpfcc libbpfcc bpfcc-tools linux-headers-amd64 iproute2 ethtool tcpdump bpftool iputils-ping openssh-server rsync tshark curl openssl"
missing=""
for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
    log "installing Debian packages:$missing"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq $missing >/dev/null
fi

# 2. Kernel headers for BCC (only when the running kernel has none) --------
KDIR=/lib/modules/$(uname -r)
if [ ! -e "$KDIR/build" ]; then
    HDR=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -1)
    COMMON=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -1)
    [ -n "$HDR" ] && [ -n "$COMMON" ] || die "no Debian kernel headers under /usr/src"
    log "linking $KDIR/build -> $HDR (the running kernel ships no headers)"
    mkdir -p "$KDIR"
    ln -sfn "$HDR" "$KDIR/build"
    ln -sfn "$COMMON" "$KDIR/source"
fi

# 2b. What a fresh machine lacks: bpffs, kernel features, /run/netns ----------
# A new machine of this kind does not mount the BPF filesystem; the dataplane pins its program and
# maps there.
bash scripts/mount_bpffs.sh
mkdir -p /run/netns
# Kernel features the dataplane and testbed use. Built in on this kernel; where a feature is a module,
# load it; where it can be neither, say which one is missing in one sentence.
bash scripts/kernel_features.sh || die "the kernel lacks features dosa needs (listed above)"

# 3. Virtual environment that can import bcc -------------------------------
if [ ! -x "$VENV/bin/python" ]; then
    log "creating virtual environment $VENV"
    "$PY" -m venv "$VENV"
fi
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
[ -e "$SITE/bcc" ] || ln -sfn /usr/lib/python3/dist-packages/bcc "$SITE/bcc"

# 4. The project, editable, with extras; Cython extensions built ------------
# torch is pinned by scripts/constraints.txt (the local CPU build 2.13.0), not by pyproject: a
# training host that installs dosa keeps its own torch.
HASH=$(cat pyproject.toml setup.py scripts/constraints.txt $(git ls-files '*.pyx' '*.pxd' 2>/dev/null || true) 2>/dev/null | sha256sum | cut -c1-16)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$HASH" ]; then
    log "installing python packages (torch pinned to the local CPU build 2.13.0)"
    "$VENV/bin/pip" install -q --upgrade pip setuptools wheel
    "$VENV/bin/pip" install -q -c scripts/constraints.txt torch
    "$VENV/bin/pip" install -q "cython>=3.0" "numpy>=1.26"
    "$VENV/bin/pip" install -q -c scripts/constraints.txt --no-build-isolation -e ".[all]"
    echo "$HASH" > "$STAMP"
fi
log "building Cython extensions in place"
"$VENV/bin/python" setup.py -q build_ext --inplace >/dev/null
"$VENV/bin/python" -c 'import bcc, numpy, scapy, torch' || die "import check failed"
log "ready ($VENV)"
