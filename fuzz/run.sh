#!/usr/bin/env bash
# Builds the fuzz targets (clang's libFuzzer, with ASan and UBSan) and runs each on its
# seed corpus. fuzz/README.md says what each target reaches.
#
#   fuzz/run.sh                  each target for 1,000,000 executions
#   fuzz/run.sh -max_total_time=10   or with any libFuzzer options (CI: a few seconds each)
#   FUZZ_TARGETS="codec frame" fuzz/run.sh ...   only those targets
#
# New inputs the fuzzer finds go to a scratch folder, not into fuzz/corpus/. A crash, leak,
# timeout or sanitizer report stops the run with libFuzzer's report and the input that
# caused it (crash-*, leak-*, timeout-* in build/fuzz/); make it a regression test in the
# normal suite, then fix it.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=$root/build/fuzz
mkdir -p "$out"
venv=${REMOTE_ACCEL_VENV:-.venv}
py=$PWD/$venv/bin/python
(($#)) || set -- -runs=1000000
targets=(${FUZZ_TARGETS:-prologue codec batch_scan frame handshake})

flags=(-g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined)
build() {  # build NAME COMPILER ARGS...: only when a source is newer than the target
  local name=$1 cc=$2
  shift 2
  local bin=$out/${name}_fuzz src
  for src in fuzz/"${name}"_fuzz.c* src/dpdk_shim/wire/*.c src/dpdk_shim/wire/*.h src/remote_accel/server/csrc/batch_scan.h \
             src/remote_accel/dataplane/codec.h src/remote_accel/dataplane/_codec.c; do
    [[ $bin -nt $src ]] || { echo "[fuzz] building $name" >&2; "$cc" "${flags[@]}" "$@" -o "$bin"; return; }
  done
}
for t in "${targets[@]}"; do
  case $t in
    prologue) build prologue clang -Isrc/dpdk_shim fuzz/prologue_fuzz.c src/dpdk_shim/wire/prologue.c src/dpdk_shim/wire/crc.c ;;
    frame) build frame clang -Isrc/dpdk_shim $(pkg-config --cflags libdpdk) fuzz/frame_fuzz.c src/dpdk_shim/wire/frame.c \
             src/dpdk_shim/wire/crc.c $(pkg-config --libs libdpdk) ;;
    batch_scan) build batch_scan clang++ -std=c++20 -Isrc/remote_accel/server/csrc -Isrc/remote_accel/dataplane fuzz/batch_scan_fuzz.cpp ;;
    # the venv's own Python, embedded (the decoder builds its objects)
    codec) build codec clang -fno-strict-aliasing $("$py" -c 'import sysconfig; print("-I" + sysconfig.get_paths()["include"])') \
             fuzz/codec_fuzz.c -L"$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')" \
             -Wl,-rpath,"$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')" \
             -lpython"$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" ;;
    # atheris comes with the venv (quickstart.sh's prepare_venv): the run installs nothing
    handshake) "$py" -c 'import atheris' 2>/dev/null || { echo "[fuzz] atheris is not installed in $venv:" \
                 "./quickstart.sh setup installs it" >&2; exit 2; } ;;
    *) echo "unknown target $t" >&2; exit 2 ;;
  esac
done

scratch=$(mktemp -d /tmp/ra-fuzz.XXXXXX)
trap 'rm -rf "$scratch"' EXIT
for t in "${targets[@]}"; do
  mkdir -p "$scratch/$t"
  if [[ $t == handshake ]]; then
    cmd=("$py" "$root/fuzz/handshake_fuzz.py")
  else
    cmd=("$out/${t}_fuzz")
  fi
  # PYTHONMALLOC=malloc: Python's objects come from malloc, where ASan and LSan see them
  # (codec: a reference _codec.c loses is a leak, one it drops twice a use after free)
  log=$scratch/$t.log
  # from $out: libFuzzer writes a failing input to the folder it runs in
  if ! (cd "$out" && PYTHONMALLOC=malloc "${cmd[@]}" -print_final_stats=1 "$scratch/$t" "$root/fuzz/corpus/$t" "$@") \
        >"$log" 2>&1; then
    tail -60 "$log" >&2
    echo "[fuzz] $t FAILED (the input is in $out)" >&2
    exit 1
  fi
  echo "[fuzz] $t: $(grep -o 'number_of_executed_units: [0-9]*' "$log" | grep -o '[0-9]*') executions," \
       "$(grep -o 'Done [0-9]* runs in [0-9]* second' "$log" | grep -o 'in [0-9]* second')s, no report" >&2
done
