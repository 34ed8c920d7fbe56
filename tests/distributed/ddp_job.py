"""Run by torchrun in tests/distributed/test_training.py: DistributedDataParallel on
remote_accel, unchanged, against one process trained on the whole batch on CPU, in each
of DDP's modes. Prints "RESULT MODE MAXDIFF" per mode, then "done"."""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
# each rank takes its own device; where ranks outnumber the servers, they share them
torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]) % torch.accelerator.device_count())
dist.init_process_group()
# no backend named: torch maps the device to raccl (get_backend() says "undefined" here, as
# for every device after a no-argument init_process_group)
assert "remote_accel:raccl" in dist.get_backend_config(), dist.get_backend_config()
dev = torch.device("remote_accel", torch.accelerator.current_device_index())
BATCH = 8  # per rank


class Net(torch.nn.Module):
    def __init__(self, unused: bool = False):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)
        if unused:  # a layer no step uses: find_unused_parameters must cope
            self.unused = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def train(mode: str, ddp_args=None, hook=None, micro_batches: int = 1, compiled: bool = False,
          unused: bool = False, steps: int = 3) -> None:
    torch.manual_seed(0)
    model, alone = Net(unused), Net(unused)
    alone.load_state_dict(model.state_dict())
    ddp = DDP(model.to(dev), **(ddp_args or {}))
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    forward = torch.compile(ddp) if compiled else ddp
    opt, opt_alone = torch.optim.SGD(ddp.parameters(), lr=0.1), torch.optim.SGD(alone.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        opt_alone.zero_grad()
        for micro in range(micro_batches):
            x, y = torch.randn(BATCH * world, 16, generator=data), torch.randn(BATCH * world, 4, generator=data)
            mine = slice(rank * BATCH, (rank + 1) * BATCH)
            loss = torch.nn.functional.mse_loss(forward(x[mine].to(dev)), y[mine].to(dev)) / micro_batches
            if micro < micro_batches - 1:
                with ddp.no_sync():  # gradients accumulate locally, reduced with the last micro-batch's
                    loss.backward()
            else:
                loss.backward()
            (torch.nn.functional.mse_loss(alone(x), y) / micro_batches).backward()
        opt.step()
        opt_alone.step()
    diff = max((p.detach().cpu() - q.detach()).abs().max().item() for p, q in zip(ddp.module.parameters(),
                                                                                 alone.parameters()))
    print(f"RESULT {mode} {diff:.3g}", flush=True)


modes = sys.argv[1].split(",")
if "plain" in modes:
    train("plain")
if "no_sync" in modes:
    train("no_sync", micro_batches=2)
if "find_unused" in modes:
    train("find_unused", dict(find_unused_parameters=True), unused=True)
if "static_graph" in modes:
    train("static_graph", dict(static_graph=True))
if "fp16_hook" in modes:
    train("fp16_hook", hook=default_hooks.fp16_compress_hook)
if "bf16_hook" in modes:
    train("bf16_hook", hook=default_hooks.bf16_compress_hook)
if "compiled" in modes:
    train("compiled", compiled=True)
stats = torch.remote_accel.stats()
print(f"collectives {stats.get('collectives', -1)}", flush=True)
print("done", flush=True)
dist.destroy_process_group()
