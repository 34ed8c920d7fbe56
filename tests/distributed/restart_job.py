"""Run by torchrun --max-restarts 1 in tests/distributed/test_failures.py: DDP training
that keeps its own checkpoint (argv[1], a folder) after every step. In the first
attempt the last rank dies at step DIE_AT; torchrun restarts every rank, which go on
from the checkpoint. Rank 0 prints "STEP N ATTEMPT A" per step, then "FINAL MAXDIFF":
how far the parameters end from one process trained on the whole batch for every step."""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS, DIE_AT, BATCH = 6, 3, 8
folder = sys.argv[1]
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]))
dist.init_process_group()
dev = torch.device("remote_accel", torch.accelerator.current_device_index())


def make() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def batches():
    data = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        yield torch.randn(BATCH * world, 16, generator=data), torch.randn(BATCH * world, 4, generator=data)


model = DDP(make().to(dev))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
path = os.path.join(folder, "checkpoint.pt")
first = 0
if os.path.exists(path):  # the script's own checkpoint, as torchrun's docs ask of a script
    saved = torch.load(path, map_location=dev)
    model.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    first = saved["step"] + 1
for step, (x, y) in enumerate(batches()):
    if step < first:
        continue
    if attempt == 0 and step == DIE_AT and rank == world - 1:
        os._exit(1)  # a rank dies in the middle of training
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    loss = torch.nn.functional.mse_loss(model(x[mine].to(dev)), y[mine].to(dev))
    opt.zero_grad()
    loss.backward()
    opt.step()
    loss.item()  # the step is done on every rank's server
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}, path + ".new")
        os.replace(path + ".new", path)
        print(f"STEP {step} ATTEMPT {attempt}", flush=True)
    dist.barrier()  # nobody goes on before the checkpoint of this step is written
if rank == 0:
    alone = make()
    opt_alone = torch.optim.SGD(alone.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches():
        opt_alone.zero_grad()
        torch.nn.functional.mse_loss(alone(x), y).backward()
        opt_alone.step()
    diff = max((p.detach().cpu() - q.detach()).abs().max().item() for p, q in zip(model.module.parameters(),
                                                                                 alone.parameters()))
    print(f"FINAL {diff:.3g}", flush=True)
dist.destroy_process_group()
