"""PyTorch's OpInfo database (fp32) on remote_accel against CPU: at least 98% must match.

Runs benchmarks/opinfo_report.py (a CPU server in another process, the device in the
report's process) and checks its JSON: the pass rate, and that every failure, skip and
entry without a CPU reference is listed by name with its cause. Each sample runs twice,
so the C++ fallback's plans (the path every repeated op takes) meet the whole op_db.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

REPORT = pathlib.Path(__file__).parents[2] / "benchmarks" / "opinfo_report.py"


@pytest.mark.slow
def test_opinfo_fp32_matches_cpu():
    proc = subprocess.run([sys.executable, str(REPORT), "--json", "--samples", "2"], capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-5000:]
    report = json.loads(proc.stdout)
    assert report["entries"] > 600  # the whole fp32 op_db, not a slice of it
    # what is left out is left out for a stated reason, and only a few
    assert len(report["skipped"]) + len(report["no_cpu_reference"]) < 0.1 * report["entries"]
    for name, cause in {**report["failures"], **report["skipped"], **report["no_cpu_reference"]}.items():
        assert name and cause, (name, cause)
    assert report["passed"] == report["compared"] - len(report["failures"])
    assert report["pass_rate"] >= 0.98, json.dumps(report["failures"], indent=1)
    # every sample ran twice, the second time served from the first call's plans in C++
    assert report["calls_served_from_plans"] > report["compared"]
