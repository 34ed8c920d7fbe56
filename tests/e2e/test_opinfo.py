"""PyTorch's OpInfo database on remote_accel against CPU, at float32: outputs, and outputs
with input gradients. Only the entries that need sparse layouts on the device (which it
does not have, see OPINFO.md) may fail: 99.5% of outputs and 99.4% with gradients match.

Runs benchmarks/opinfo_report.py (a CPU server in another process, the device in the
report's process) and checks its JSON: the pass rates, and that every failure, skip and
entry without a CPU reference is listed by name with its cause. Each forward sample runs
twice, so the C++ fallback's plans (the path every repeated op takes) meet the whole
op_db. The other dtypes are measured by the report's --dtypes (OPINFO.md), not here: they
would multiply the run time.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

REPORT = pathlib.Path(__file__).parents[2] / "benchmarks" / "opinfo_report.py"


#: entries whose inputs or outputs are sparse tensors on the device: remote_accel tensors are
#: strided only (no SparsePrivateUse1 kernels, no sparse tensors on the wire)
SPARSE_LAYOUTS = {"to_sparse", "sparse.sampled_addmm", "sparse.mm.reduce"}


def _check_section(section: dict, at_least: int, rate: float) -> None:
    assert section["entries"] > at_least  # the whole op_db, not a slice of it
    # what is left out is left out for a stated reason, and only a few
    assert len(section["skipped"]) + len(section["no_cpu_reference"]) < 0.1 * section["entries"]
    for name, cause in {**section["failures"], **section["skipped"], **section["no_cpu_reference"]}.items():
        assert name and cause, (name, cause)
    assert section["passed"] == section["compared"] - len(section["failures"])
    assert set(section["failures"]) <= SPARSE_LAYOUTS, json.dumps(section["failures"], indent=1)
    assert section["pass_rate"] >= rate


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_opinfo_fp32_outputs_and_gradients_match_cpu():
    proc = subprocess.run([sys.executable, str(REPORT), "--json", "--samples", "2", "--grad", "--grad-samples", "3"],
                          capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stderr[-5000:]
    report = json.loads(proc.stdout)
    _check_section(report, 600, 0.995)  # 631/634
    _check_section(report["gradients"], 500, 0.994)  # 521/524
    # every forward sample ran twice, the second time served from the first call's plans in C++
    assert report["calls_served_from_plans"] > report["compared"]
