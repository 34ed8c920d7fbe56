#!/usr/bin/env bash
# Run the server, e2e and OpInfo suites with every test server on a GPU
# (REMOTE_ACCEL_TEST_DEVICE=cuda). Meant for a machine with CUDA, PyTorch, meson and
# ninja but no package index: the other Python dependencies come as wheels in ./.whl
# (the README's Development section lists them). DPDK is not needed: clients use TCP.
# Usage: scripts/gpu-check.sh [OUTDIR [TEST...]]   (logs and the OpInfo JSON land in OUTDIR;
# naming tests runs only those, without the OpInfo sweep and the benchmark)
#        scripts/gpu-check.sh --quick [OUTDIR]    (about 9 minutes, for a short GPU lease: the
# benchmark first, eager and compiled, then a slice of the e2e suite and the server suite,
# each part under its own time limit; no OpInfo sweep)
# At the end, benchmarks/bench_gpu.py compares local CUDA with a CUDA server (TCP only: no DPDK here).
set -uo pipefail
cd "$(dirname "$0")/.."
quick=0
if [[ ${1:-} == --quick ]]; then quick=1; shift; fi
out=${1:-/tmp/ra-gpu-check}
shift || true
tests=("$@")
mkdir -p "$out"
site=/tmp/ra-site
export PATH=$site/bin:$PATH PYTHONPATH=$site REMOTE_ACCEL_TEST_DEVICE=cuda PYTHONUNBUFFERED=1
if [[ -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl/*.whl || exit
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$site" . \
  >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import torch, remote_accel; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
if [[ $quick == 1 ]]; then
  # The figures first: a lease can end before the suites do. Each part has its own limit;
  # the suites take what is left of QUICK_SECONDS (counted from the start, build included).
  timeout 150 python3 benchmarks/bench_gpu.py --transport tcp --steps 5 2>&1 | tee "$out/bench_gpu.log"
  timeout 240 python3 benchmarks/bench_gpu.py --transport tcp --steps 5 --models gpt-bf16,mlp --compile \
    --server-log "$out/server_compile.log" 2>&1 | tee "$out/bench_gpu_compile.log"
  # A file at a time, each under its own limit: a hang costs that file, and each file's
  # failures are printed (one line each) as soon as it ends, not after the whole run.
  for file in tests/e2e/test_training.py tests/e2e/test_compiled_graphs.py tests/e2e/test_gradients_match_cpu.py \
              tests/server/test_*.py; do
    left=$(( ${QUICK_SECONDS:-540} - SECONDS ))
    if (( left < 20 )); then echo "gpu-check: out of time before $file"; break; fi
    timeout $(( left < 120 ? left : 120 )) python3 -m pytest -q -p no:cacheprovider \
      -m "not dpdk and not netns and not slow" --timeout 40 --tb=line -rfE "$file" 2>&1 \
      | tee -a "$out/pytest.log" | tail -8
  done
  exit
fi
if [[ ${#tests[@]} -gt 0 ]]; then
  timeout 500 python3 -m pytest -q -p no:cacheprovider -m 'not dpdk and not netns' "${tests[@]}" 2>&1 \
    | tee "$out/pytest.log" | tail -60
  exit
fi
# OpInfo in the background: it is the longest part and needs one core.
timeout 540 python3 benchmarks/opinfo_report.py --json >"$out/opinfo.json" 2>"$out/opinfo.log" &
opinfo=$!
timeout 500 python3 -m pytest -q -p no:cacheprovider -m 'not dpdk and not netns' \
  tests/server tests/e2e --deselect tests/e2e/test_opinfo.py 2>&1 | tee "$out/pytest.log" | tail -60
wait $opinfo
python3 - "$out/opinfo.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("OpInfo on cuda: %d/%d compared entries match CPU (%.1f%%)" % (r["passed"], r["compared"], 100 * r["pass_rate"]))
for name, why in r["failures"].items():
    print("  FAIL", name, "-", why[:200])
PY
timeout 900 python3 benchmarks/bench_gpu.py --transport tcp 2>&1 | tee "$out/bench_gpu.log" | tail -20
