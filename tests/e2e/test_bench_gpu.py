"""benchmarks/bench_gpu.py on a CPU server (its smoke mode): every code path a GPU run
takes (the local run in a process of its own, a remote run per transport, the compiled
model on both sides) runs here and gives the local losses, so that a short GPU lease is
not spent finding a broken benchmark."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

BENCH = pathlib.Path(__file__).parents[2] / "benchmarks" / "bench_gpu.py"


def run_bench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=timeout)


def test_smoke_run_eager_and_compiled_gives_the_local_losses():
    proc = run_bench("--device", "cpu", "--transport", "tcp", "--models", "mlp", "--steps", "1", "--compile",
                     "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["transport"] == "tcp" and row["model"] == "mlp"
    for key in ("local_ms", "remote_ms", "local_compiled_ms", "remote_compiled_ms"):
        assert row[key] > 0, row
    # the same seed makes the same model and batch: the first step's loss is the local one
    assert row["remote_loss"] == pytest.approx(row["local_loss"], rel=1e-5)
    assert row["remote_compiled_loss"] == pytest.approx(row["local_loss"], rel=1e-5)
    # the model really ran compiled on the server, not replayed node by node
    assert row["graphs"]["graph_compiles"] >= 1 and row["graphs"]["graph_compile_failures"] == 0, row


def test_table_has_a_row_per_transport_and_model():
    proc = run_bench("--device", "cpu", "--transport", "tcp", "--models", "mlp,gpt-bf16", "--steps", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("tcp ")]
    assert [r[1] for r in rows] == ["mlp", "gpt-bf16"], proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_without_cuda_the_gpu_default_says_so():
    proc = run_bench("--models", "mlp", timeout=120)
    assert proc.returncode == 2
    assert "no CUDA here" in proc.stderr and "--device cpu" in proc.stderr


def test_unknown_model_is_refused():
    proc = run_bench("--device", "cpu", "--models", "mlp,vgg", timeout=120)
    assert proc.returncode == 2 and "unknown model(s) vgg" in proc.stderr
