"""A Lightning script as users write it for several devices, which never imports
remote_accel: REMOTE_ACCEL_SERVER names two servers (autoload), and Lightning starts the
second process itself (its subprocess launcher runs this script again with LOCAL_RANK=1),
or torchrun starts both. Run by test_frameworks_multi.py as

    python lightning_multi.py trainer,fabric          (Lightning's own launcher)
    torchrun --nproc_per_node 2 lightning_multi.py trainer

- "trainer": `Trainer(accelerator=..., devices=...)` (argv[2], argv[3]: "remote_accel" and
  2, or "auto" and "auto") fits an MLP with DDP, 4 rows a rank a step (Lightning's
  DistributedSampler, shuffled);
- "fabric": `Fabric(accelerator="remote_accel", devices=2)`, `fabric.launch()`, the same
  model and data by hand.
Each rank checks against the same steps in plain torch on cpu over the whole batch (8 rows,
one process) and writes its JSON result to rank<r>.json in $MULTI_RESULTS (the ranks'
lines on one stdout can run into each other).
"""

import json
import os
import sys

import lightning as L
import torch

STEPS = 4
WORLD = 2
PER_RANK = 4


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS * PER_RANK * WORLD, 16, generator=g), torch.randn(STEPS * PER_RANK * WORLD, 1, generator=g)


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def in_order() -> list:
    """The rows of each step's whole batch where the loader is not shuffled (Fabric's
    DistributedSampler: rank r takes rows r, r + 2, ...): 0-7, 8-15, ..."""
    return [list(range(step * PER_RANK * WORLD, (step + 1) * PER_RANK * WORLD)) for step in range(STEPS)]


def shuffled() -> list:
    """The rows of each step's whole batch in a Trainer's fit: Lightning always shuffles
    the training data of a distributed run (DistributedSampler(shuffle=True, seed=0),
    epoch 0: one permutation, rank r takes its entries r, r + 2, ...)."""
    order = torch.randperm(STEPS * PER_RANK * WORLD, generator=torch.Generator().manual_seed(0)).tolist()
    mine = [order[r::WORLD] for r in range(WORLD)]
    return [[i for r in range(WORLD) for i in mine[r][step * PER_RANK:(step + 1) * PER_RANK]] for step in range(STEPS)]


def alone(order: list) -> tuple:
    """One process, cpu, 8 rows a step: each step's loss and the parameters at the end."""
    model, (x, y) = mlp(), data()
    optimizer, losses = torch.optim.SGD(model.parameters(), lr=0.1), []
    for rows in order:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, list(model.parameters())


def collectives() -> int:
    device = getattr(torch, "remote_accel", None)  # none on a machine that names no server
    return device.stats().get("collectives", 0) if device is not None and device.is_initialized() else 0


def compare(losses, parameters, order: list) -> dict:
    expected, expected_parameters = alone(order)
    return {"losses": losses, "losses_alone": expected,
            "parameter_difference": max((p.detach().cpu() - q.detach()).abs().max().item()
                                        for p, q in zip(parameters, expected_parameters))}


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net, self.losses, self.devices = mlp(), [], set()

    def training_step(self, batch, index):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        # the mean of the ranks' losses: the whole batch's (every rank has 4 rows)
        self.losses.append(self.all_gather(loss.detach()).mean().item())
        self.devices.add(str(self.net[0].weight.device))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer(accelerator: str, devices) -> dict:
    model = Regression()
    fit = L.Trainer(accelerator=accelerator, devices=devices, max_epochs=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data()), batch_size=PER_RANK)
    before = collectives()
    fit.fit(model, loader)
    strategy = fit.strategy
    return {"rank": fit.global_rank, "world": fit.world_size, "strategy": type(strategy).__name__,
            "launcher": type(strategy.launcher).__name__ if strategy.launcher else None,
            "accelerator": type(fit.accelerator).__name__, "root_device": str(strategy.root_device),
            "backend": strategy._process_group_backend, "trained_on": sorted(model.devices),
            "collectives": collectives() - before, **compare(model.losses, model.net.parameters(), shuffled())}


def fabric() -> dict:
    run = L.Fabric(accelerator="remote_accel", devices=WORLD)
    run.launch()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = run.setup(model, optimizer)
    loader = run.setup_dataloaders(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data()),
                                                               batch_size=PER_RANK))
    before, losses = collectives(), []
    for x, y in loader:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        run.backward(loss)
        optimizer.step()
        losses.append(run.all_gather(loss.detach()).mean().item())
    return {"rank": run.global_rank, "world": run.world_size, "strategy": type(run.strategy).__name__,
            "root_device": str(run.device), "backend": run.strategy._process_group_backend,
            "collectives": collectives() - before, **compare(losses, model.parameters(), in_order())}


def main() -> int:
    what = sys.argv[1].split(",")
    accelerator = sys.argv[2] if len(sys.argv) > 2 else "remote_accel"
    devices = sys.argv[3] if len(sys.argv) > 3 else WORLD
    devices = int(devices) if str(devices).isdigit() else devices
    results = {}
    if "trainer" in what:
        results["trainer"] = trainer(accelerator, devices)
    if "fabric" in what:
        results["fabric"] = fabric()
    rank = torch.distributed.get_rank()
    with open(os.path.join(os.environ["MULTI_RESULTS"], f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
