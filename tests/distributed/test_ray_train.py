"""Ray Train on remote_accel: `ray.train.torch.TorchTrainer` trains a DDP model with its two
workers as the ranks of a raccl group, each on a server of a `remote_accel.ray.ServerPool`
(one server per worker), on a local Ray cluster; against one process trained on the whole
batch on cpu. The usage docs/ray.md shows: `TorchConfig(backend="raccl")`, the pool's
setup hook in the workers' runtime environment, `remote_accel.init(servers=pool)` and
`prepare_model(model, move_to_device=remote_accel:<world rank>)` in the train loop."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

pytestmark = pytest.mark.any_torch  # the main venv's suite has Ray; the models venv's has none

try:
    import ray
    import ray.train.torch
except ImportError:  # Ray, or its train extra (pandas, pyarrow, fsspec), is missing
    ray = None
#: a skip reason CI turns into a failure (tests/conftest.py): its main venv has Ray Train
NO_RAY = "remote_accel.ray needs Ray, and Ray Train its train extra: pip install 'ray[train]'"

MIB = 1 << 20
STEPS = 4
PER_WORKER = 4


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _data(world: int):
    g = torch.Generator().manual_seed(1)
    rows = STEPS * PER_WORKER * world
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 1, generator=g)


def train_loop(config):
    """What a user writes: the pool's servers, the worker's own one, Ray's DDP."""
    import ray.train
    import ray.train.torch

    import remote_accel

    remote_accel.init(servers=config["pool"])
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    device = torch.device("remote_accel", rank)  # one server of the pool per worker
    torch.accelerator.set_device_index(rank)  # as a CUDA worker sets its GPU
    model = ray.train.torch.prepare_model(_net(), move_to_device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data(world)
    losses = []
    for step in range(STEPS):
        first = (step * world + rank) * PER_WORKER  # this worker's rows of the step's batch
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[first:first + PER_WORKER].to(device)),
                                            y[first:first + PER_WORKER].to(device))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    module = model.module if hasattr(model, "module") else model
    seen = {"rank": rank, "device": str(next(module.parameters()).device), "ddp": type(model).__name__,
            "backend": torch.distributed.get_backend_config(), "losses": losses,
            "collectives": torch.remote_accel.stats().get("collectives", 0),
            "parameters": [p.detach().cpu().flatten().tolist() for p in module.parameters()]}
    with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as f:  # every rank's, where the test reads it
        json.dump(seen, f)
    ray.train.report({"loss": losses[-1]})
    remote_accel.shutdown()


def _alone(world: int):
    """One process, cpu, each step's whole batch (every worker's rows)."""
    model, (x, y) = _net(), _data(world)
    optimizer, losses = torch.optim.SGD(model.parameters(), lr=0.1), []
    for step in range(STEPS):
        rows = slice(step * world * PER_WORKER, (step + 1) * world * PER_WORKER)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [p.detach().flatten() for p in model.parameters()]


def test_torch_trainer_trains_ddp_with_a_server_per_worker(tmp_path):
    if ray is None:
        pytest.skip(NO_RAY)
    import remote_accel.ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    # two servers and two workers, a CPU each (Ray's accounting: this host has 2 cores)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, object_store_memory=100 * MIB,
             configure_logging=False)
    try:
        with remote_accel.ray.ServerPool(num_servers=2, resources_per_server={"num_cpus": 1}) as pool:
            before = [s["group_bytes_sent"] for s in pool.stats()]
            started = time.monotonic()
            trainer = TorchTrainer(
                train_loop, train_loop_config={"pool": pool, "out": str(tmp_path)},
                scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                torch_config=TorchConfig(backend="raccl"),
                run_config=RunConfig(storage_path=str(tmp_path), name="raccl",
                                     worker_runtime_env={"worker_process_setup_hook":
                                                         remote_accel.ray.WORKER_SETUP_HOOK}))
            result = trainer.fit()
            print(f"TorchTrainer.fit: {time.monotonic() - started:.1f} s")
            sent = [s["group_bytes_sent"] - b for s, b in zip(pool.stats(), before)]
    finally:
        ray.shutdown()
    assert result.error is None, result.error
    runs = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    # the scenario: two workers, each on its server of the pool, Ray's DDP over raccl, the
    # gradients reduced between the two servers
    for rank, run in enumerate(runs):
        assert run["rank"] == rank and run["device"] == f"remote_accel:{rank}", run
        assert run["ddp"] == "DistributedDataParallel" and "remote_accel:raccl" in run["backend"], run
        assert run["collectives"] >= STEPS, run
    assert all(s > 0 for s in sent), sent
    losses, parameters = _alone(2)
    # each worker's loss is its half of the batch's: their mean is the whole batch's
    torch.testing.assert_close([(a + b) / 2 for a, b in zip(runs[0]["losses"], runs[1]["losses"])], losses,
                               rtol=1e-5, atol=1e-6)
    for run in runs:  # and both end with one process's parameters
        for mine, alone in zip(run["parameters"], parameters):
            torch.testing.assert_close(torch.tensor(mine), alone, rtol=1e-5, atol=1e-6)
