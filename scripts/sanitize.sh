#!/usr/bin/env bash
# The C and C++ parts under AddressSanitizer (leaks included) and UndefinedBehaviorSanitizer:
# runs pytest on the sanitizer build in .venv-asan (./quickstart.sh sanitize builds it and
# calls this; docs/sanitizers.md says what runs and why) and fails on any report.
#
#   scripts/sanitize.sh [pytest args]   default: the representative subset below
#   scripts/sanitize.sh --c-parts [pytest args]   CI's run: the C parts alone (below)
#
# CPython and torch are not built with ASan, so its runtime comes first through LD_PRELOAD.
# Reports go to files (log_path), one per process, because a server subprocess's report
# would otherwise be lost in its log: any report of any process fails the run, and each
# one is printed. Leaks of third-party code are suppressed by scripts/lsan.supp, which
# says why for each; nothing of ours is.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${REMOTE_ACCEL_ASAN_VENV:-.venv-asan}
py=$venv/bin/python

# server, wire, dpdk and end-to-end suites: what parses a peer's bytes (the C++ receive
# loop, the C codec, the prologue, frames, the channel) and what runs ops in C++
default_tests=(
  tests/unit/test_codec.py tests/unit/test_wire.py tests/wire
  tests/dpdk/test_wire_fastpath.py tests/dpdk/test_frame_crc.py tests/dpdk/test_shim.py
  tests/server/test_fast_loop.py tests/server/test_native_executor.py tests/server/test_fuzz.py
  tests/server/test_host_blocks.py tests/server/test_host_block_charges.py tests/server/test_auth.py
  tests/server/test_read_fast_path.py tests/server/test_read_fast_path_dpdk.py tests/server/test_swap.py
  tests/server/test_sessions.py tests/server/test_peer_copies.py tests/dpdk/test_doorbell.py
  tests/e2e/test_training.py tests/e2e/test_direct_copy.py tests/e2e/test_sync_points.py
)
skip=(
  # it crashes a process on purpose, and ASan's SEGV handler reports that crash as one
  --deselect "tests/dpdk/test_shim.py::test_memif_guard_does_not_hide_other_crashes"
  # it counts page faults, which ASan's shadow memory and its quarantine of freed memory add
  --deselect "tests/server/test_fast_loop.py::test_a_new_memif_connection_takes_no_page_fault_per_round_trip"
  # a client that gives up after 1.5 s without a heartbeat: under ASan on a loaded 2-core
  # machine one came late in one run of three (the other loop tests run the same code)
  --deselect "tests/server/test_fast_loop.py::test_a_long_batch_in_the_loop_keeps_sending_heartbeats"
)

asan_lib=$(gcc -print-file-name=libasan.so)
ubsan_lib=$(gcc -print-file-name=libubsan.so)

# --c-parts: what CI runs (its time does not allow the full build's ~15 minutes). Only
# the C that parses a peer's bytes is built with the sanitizers: the DPDK shim (frames,
# the channel, ra_wire's prologue and CRC) and the C codec, which take ~15 s to build
# (meson's -Dtorch_extensions=false). They are laid over a copy of the installed package
# (its Python and its torch C++ modules, as built), found first through PYTHONPATH, and
# these suites drive them: every client and server process of the run loads them. The
# C++ receive loop's parsing is fuzzed under the same sanitizers (fuzz/run.sh).
c_parts_tests=(
  tests/unit/test_codec.py tests/unit/test_wire.py tests/wire
  tests/dpdk/test_wire_fastpath.py tests/dpdk/test_frame_crc.py tests/dpdk/test_shim.py
  tests/dpdk/test_doorbell.py tests/dpdk/test_acceptance.py tests/server/test_fast_loop.py
  tests/server/test_fuzz.py tests/server/test_read_fast_path_dpdk.py
)
# Over TCP and TLS the loop's only sanitized part is the codec, which the DPDK runs of the
# same tests drive as well (with the shim): CI's time goes to those.
c_parts_skip=()
for t in test_the_loop_serves_batches_reads_and_syncs_with_the_results_python_gives \
         test_batches_with_uploads_run_in_the_loop_in_order_with_python_s_results \
         test_an_op_that_fails_in_the_loop_is_reported_at_the_next_sync_point; do
  c_parts_skip+=(--deselect "tests/server/test_fast_loop.py::$t[tcp]" --deselect "tests/server/test_fast_loop.py::$t[tls]")
done
if [[ ${1:-} == --c-parts ]]; then
  shift
  venv=${REMOTE_ACCEL_VENV:-.venv}
  py=$venv/bin/python
  build=build/asan-c
  [[ -f $build/build.ninja ]] || "$venv/bin/meson" setup "$build" -Dtorch_extensions=false \
    -Db_sanitize=address,undefined >/dev/null
  "$venv/bin/ninja" -C "$build" >/dev/null
  overlay=$(mktemp -d /tmp/ra-sanitize-c.XXXXXX)
  trap 'rm -rf "$overlay"' EXIT
  "$py" scripts/overlay_package.py "$overlay" \
    "$build"/src/dpdk_shim/_dpdk.cpython-*.so "$build"/src/remote_accel/dataplane/_codec.cpython-*.so
  export PYTHONPATH=$overlay${PYTHONPATH:+:$PYTHONPATH}
  where=$(LD_PRELOAD="$asan_lib $ubsan_lib" ASAN_OPTIONS=detect_leaks=0 \
    "$py" -c 'import remote_accel.dataplane._dpdk as m; print(m.__file__)')
  if [[ $where != "$overlay"/* ]]; then
    echo "[sanitize] $venv's remote_accel is found before PYTHONPATH (an editable install?):" \
      "--c-parts needs a venv built with pip install ." >&2
    exit 2
  fi
  (($#)) || set -- "${c_parts_tests[@]}" "${skip[@]}" "${c_parts_skip[@]}"
fi
(($#)) || set -- "${default_tests[@]}" "${skip[@]}"

logs=$(mktemp -d /tmp/ra-sanitize.XXXXXX)
# detect_leaks: at each process's exit. malloc_context_size=2: an allocation's stack is the
# allocator and its caller (scripts/lsan.supp says why); rerun a leak with a larger value
# for its whole stack. print_suppressions=0: a clean run writes nothing.
# halt_on_error (UBSan): a report ends the process, so the test that caused it fails too.
# allocator_may_return_null: an allocation too large to make fails as malloc's does (torch
# then raises out of memory, which the server reports: tests/server/test_fuzz.py asks for
# 2^50 bytes) instead of ASan ending the process.
export ASAN_OPTIONS="detect_leaks=1:malloc_context_size=2:allocator_may_return_null=1:log_path=$logs/asan:print_suppressions=0:${ASAN_OPTIONS:-}"
export LSAN_OPTIONS="suppressions=$PWD/scripts/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$logs/ubsan"
# Python's objects from malloc, where LSan scans them: memory of ours that a live Python
# object holds (a pybind11 function's record, an Executor behind its Python object) is
# then reachable, not leaked, as it is; in obmalloc's arenas LSan would not look for it
export PYTHONMALLOC=malloc
# LeakSanitizer itself sometimes fails at a process's exit: its stop-the-world tracer
# crashes ("Tracer caught signal 11 ... LeakSanitizer has encountered a fatal error",
# google/sanitizers#1353) before it has looked for leaks, and the process exits 1 with
# nothing on stderr, so the test that started it fails with no reason given. It is not
# a finding about our code, and it is not a leak check either: the tests that failed in
# a run with such a crash and no report run again (up to three times, below), and must
# then pass with no report.
# Anything else any process wrote to its log is printed, so a failure always says why.
run_pytest() {  # pytest args; its output is also kept in $out (pipefail: pytest's status)
  LD_PRELOAD="$asan_lib $ubsan_lib" "$py" -m pytest -p no:cacheprovider -q --durations=10 "$@" 2>&1 | tee "$out"
}
sanitizer_logs() { find "$logs" -maxdepth 1 -type f \( -name 'asan*' -o -name 'ubsan*' \) | sort; }
tracer_crashes() {  # the logs with LSan's own fatal error and no report of ours
  local f
  for f in $(sanitizer_logs); do
    grep -q 'LeakSanitizer has encountered a fatal error' "$f" && ! grep -qE 'ERROR: |runtime error:' "$f" && echo "$f"
  done
  return 0
}
out=$(mktemp /tmp/ra-sanitize-pytest.XXXXXX)
status=0
run_pytest "$@" || status=$?
# Up to three more runs of what failed, while each failure came with tracer crashes and no
# report: on a loaded 2-core VM (2026-11-29) the tracer crashed in six processes of one run
# and again in the rerun of the one test that failed; three runs of it alone were clean.
for rerun in 1 2 3; do
  crashed=$(tracer_crashes)
  ((status != 0)) && [[ -n $crashed ]] && ! grep -lqE 'ERROR: |runtime error:' $(sanitizer_logs) /dev/null || break
  for f in $crashed; do echo "=== $f (LeakSanitizer's own failure, not a report)"; cat "$f"; done >&2
  mapfile -t failed < <(sed -nE 's/^(FAILED|ERROR) ([^ ]+)( - .*)?$/\2/p' "$out" | sort -u)
  ((${#failed[@]})) || break
  # the last rerun without LeakSanitizer: ASan and UBSan still check every access, and a
  # process whose tracer crashes gets no leak check either way (in one run of CI's whole
  # command on this VM the same memif client crashed it in all four runs, and in none of
  # five runs of the same suite alone)
  leaks=1
  ((rerun < 3)) || leaks=0
  echo "[sanitize] LeakSanitizer's tracer crashed at a process's exit; running the" \
    "${#failed[@]} failed test(s) again (rerun $rerun of 3$( ((leaks)) || echo ", without leak checks")):" \
    "${failed[*]}" >&2
  mkdir -p "$logs/run-$rerun" && mv $crashed "$logs/run-$rerun/"
  status=0
  ASAN_OPTIONS="$ASAN_OPTIONS:detect_leaks=$leaks" run_pytest "${failed[@]}" || status=$?
done
rm -f "$out"

# errors fail the run; a warning alone (a too-large allocation refused, as above) does not
reports=$(grep -lE 'ERROR: |runtime error:' $(sanitizer_logs) /dev/null 2>/dev/null || true)
if [[ -n $reports ]]; then
  for f in $reports; do echo "=== $f"; cat "$f"; done >&2
  echo "[sanitize] $(wc -w <<<"$reports") sanitizer report(s), above (kept in $logs)" >&2
  exit 1
fi
if ((status != 0)); then
  for f in $(sanitizer_logs); do echo "=== $f"; cat "$f"; done >&2
  echo "[sanitize] the tests failed (logs kept in $logs)" >&2
  exit $status
fi
rm -rf "$logs"
echo "[sanitize] no sanitizer report" >&2
