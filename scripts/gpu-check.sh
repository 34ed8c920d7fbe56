#!/usr/bin/env bash
# Run the server, e2e and OpInfo suites with every test server on a GPU
# (REMOTE_ACCEL_TEST_DEVICE=cuda). Meant for a machine with CUDA, PyTorch, meson and
# ninja but no package index: the other Python dependencies come as wheels in ./.whl
# (see the README's "GPU check" note). DPDK is not needed: clients use TCP.
# Usage: scripts/gpu-check.sh [OUTDIR [TEST...]]   (logs and the OpInfo JSON land in OUTDIR;
# naming tests runs only those, without the OpInfo sweep and the benchmark)
# At the end, benchmarks/bench_gpu.py compares local CUDA with a CUDA server (TCP only: no DPDK here).
set -uo pipefail
cd "$(dirname "$0")/.."
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
