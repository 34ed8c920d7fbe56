"""The training frameworks over several processes, unchanged, each rank on a server of its
own through raccl: `accelerate launch --num_processes 2` and torchrun with transformers'
`Trainer`; Lightning's `Trainer(devices=2)` (its own launcher, accelerator named and
"auto") and `Fabric(devices=2)`. The scripts (hf_multi.py, lightning_multi.py) never import
remote_accel: the ranks see the two servers that REMOTE_ACCEL_SERVER names (autoload).

Each test first shows that the run was the one meant (two ranks on remote_accel:0 and :1,
the framework's DDP, gradients reduced by raccl: the ranks' collectives and the servers'
group bytes), then compares with one process trained on the whole batch on cpu."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

import unchanged
from remote_accel.server.testing import Client, ServerProcess

pytest.importorskip("accelerate")
pytest.importorskip("lightning")

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 300
#: the same sums, in another order (two ranks' halves, then their mean)
FP32 = unchanged.FP32


@pytest.fixture(scope="module")
def servers():
    with ServerProcess() as a, ServerProcess() as b:
        yield [a, b]


def _environment(servers, folder: str) -> dict:
    return dict(unchanged.clean_environment(), REMOTE_ACCEL_SERVER=",".join("%s:%d" % s.tcp for s in servers),
                REMOTE_ACCEL_TOKEN=",".join(s.token for s in servers), REMOTE_ACCEL_TRANSPORT="tcp",
                HF_HOME=os.path.join(folder, "hf"))  # no accelerate config file of the machine's


def _group_bytes(servers) -> list:
    out = []
    for server in servers:
        host, port = server.tcp
        with Client.tcp(host, port, token=server.token) as client:
            out.append(client.stats()["group_bytes_sent"])
    return out


def _run(command: list, servers, ranks: int = 2) -> list:
    """Each rank's JSON result (rank<r>.json in the run's folder), rank 0 first, after
    checking that the servers sent each other group data during the run."""
    before = _group_bytes(servers)
    with tempfile.TemporaryDirectory(prefix="multi-") as folder:
        out = subprocess.run(command, env=dict(_environment(servers, folder), MULTI_RESULTS=folder), cwd=folder,
                             capture_output=True, text=True, timeout=TIMEOUT_S)
        text = out.stdout + out.stderr
        assert out.returncode == 0, text[-6000:]
        results = {}
        for rank in range(ranks):
            path = os.path.join(folder, f"rank{rank}.json")
            assert os.path.exists(path), f"rank {rank} wrote no result:\n{text[-6000:]}"
            with open(path) as f:
                results[rank] = json.load(f)
    sent = [after - b for after, b in zip(_group_bytes(servers), before)]
    assert all(s > 0 for s in sent), ("the servers exchanged no group data", sent)  # server to server
    return [results[r] for r in range(ranks)]


def _torchrun(script: str, *args: str) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            os.path.join(HERE, script), *args]


def _alone_trainer(servers) -> dict:
    """transformers' Trainer in one process on cpu, the whole batch (4 sequences a step)."""
    out = subprocess.run([sys.executable, os.path.join(HERE, "hf_multi.py"), "alone"],
                         env=unchanged.clean_environment(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("ALONE "))[6:])


@pytest.fixture(scope="module")
def alone(servers):
    return _alone_trainer(servers)


def _check_trainer(ranks: list, alone: dict) -> None:
    for rank, result in enumerate(ranks):
        run = result["trainer"]
        assert run["device"] == f"remote_accel:{rank}" and run["trained_on"] == [f"remote_accel:{rank}"]
        assert run["parallel_mode"] == "ParallelMode.DISTRIBUTED" and run["world"] == 2
        assert run["ddp"] == "DistributedDataParallel" and run["collectives"] >= 4, run  # a reduction a step at least
    assert alone["device"] == "cpu" and alone["world"] == 1
    # the ranks' mean loss, step by step, and the parameters at the end: one process's
    torch.testing.assert_close(ranks[0]["trainer"]["losses"], alone["losses"], **FP32)
    torch.testing.assert_close(ranks[1]["trainer"]["losses"], alone["losses"], **FP32)
    for result in ranks:
        torch.testing.assert_close(torch.tensor(result["trainer"]["weights"]), torch.tensor(alone["weights"]),
                                   rtol=1e-4, atol=1e-5)


def test_accelerate_launch_runs_a_rank_per_server(servers, alone):
    accelerate = shutil.which("accelerate", path=os.path.dirname(sys.executable))
    assert accelerate, "accelerate's launcher is installed with accelerate"
    ranks = _run([accelerate, "launch", "--num_processes", "2", os.path.join(HERE, "hf_multi.py"),
                  "accelerate,trainer"], servers)
    for rank, result in enumerate(ranks):
        run = result["accelerate"]
        assert run["device"] == run["trained_on"] == f"remote_accel:{rank}", run
        assert run["backend"] == "raccl" and run["world"] == 2 and run["ddp"] == "DistributedDataParallel"
        assert run["distributed_type"] == "DistributedType.MULTI_GPU"
        assert run["collectives"] >= 4, run
        torch.testing.assert_close(run["losses"], run["losses_alone"], **FP32)
        assert run["parameter_difference"] <= 1e-5, run
    _check_trainer(ranks, alone)


def test_torchrun_with_transformers_trainer(servers, alone):
    _check_trainer(_run(_torchrun("hf_multi.py", "trainer"), servers), alone)


def _check_lightning(ranks: list, part: str, strategy: str = "DDPStrategy") -> None:
    for rank, result in enumerate(ranks):
        run = result[part]
        assert run["rank"] == rank and run["world"] == 2 and run["strategy"] == strategy, run
        assert run["root_device"] == f"remote_accel:{rank}" and run["backend"] == "raccl", run
        assert run["collectives"] >= 4, run
        assert len(run["losses"]) == 4
        torch.testing.assert_close(run["losses"], run["losses_alone"], **FP32)
        assert run["parameter_difference"] <= 1e-5, run


def test_lightning_trainer_and_fabric_with_devices_2_start_their_own_processes(servers):
    ranks = _run([sys.executable, os.path.join(HERE, "lightning_multi.py"), "trainer,fabric", "remote_accel", "2"],
                 servers)
    _check_lightning(ranks, "trainer")
    assert ranks[0]["trainer"]["launcher"] == "_SubprocessScriptLauncher"
    assert ranks[0]["trainer"]["accelerator"] == "RemoteAccelAccelerator"
    _check_lightning(ranks, "fabric")


def test_lightning_auto_under_torchrun(servers):
    ranks = _run(_torchrun("lightning_multi.py", "trainer", "auto", "auto"), servers)
    _check_lightning(ranks, "trainer")
    assert ranks[0]["trainer"]["accelerator"] == "RemoteAccelAccelerator"
