"""Run by torchrun in tests/distributed/test_training.py: FSDP2 (fully_shard on each
layer and the root) on remote_accel, unchanged, against one process on CPU; then
torch.distributed.checkpoint. argv: "train DIR" trains STEPS steps, saving the sharded
state after SAVE_AT of them in DIR; "resume DIR" loads it and trains the rest. Prints
"LOSS STEP VALUE ALONE" per step (ALONE: one process's loss on the whole batch)."""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

STEPS, SAVE_AT, BATCH = 6, 3, 8
what, folder = sys.argv[1], sys.argv[2]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
local = int(os.environ["LOCAL_RANK"])
torch.accelerator.set_device_index(local)
dist.init_process_group(device_id=torch.device("remote_accel", local))
# the backend torch picked from the device, by name (issue 52's three ways to ask)
assert dist.get_backend() == "raccl", dist.get_backend()
assert dist.get_default_backend_for_device("remote_accel") == "raccl"
assert "remote_accel:raccl" in dist.get_backend_config(), dist.get_backend_config()
dev = torch.device("remote_accel", local)


def make() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4))


model, alone = make().to(dev), make()
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer)
fully_shard(model)
opt, opt_alone = torch.optim.Adam(model.parameters(), lr=0.01), torch.optim.Adam(alone.parameters(), lr=0.01)
data = torch.Generator().manual_seed(1)
first = 0
if what == "resume":
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    first = SAVE_AT
for step in range(STEPS):
    x, y = torch.randn(BATCH * world, 16, generator=data), torch.randn(BATCH * world, 4, generator=data)
    loss_alone = torch.nn.functional.mse_loss(alone(x), y)
    opt_alone.zero_grad()
    loss_alone.backward()
    opt_alone.step()
    if step < first:
        continue  # steps the checkpoint holds (the data stream and the one process run through them)
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    loss = torch.nn.functional.mse_loss(model(x[mine].to(dev)), y[mine].to(dev))
    opt.zero_grad()
    loss.backward()
    opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean, op=dist.ReduceOp.AVG)
    print(f"LOSS {step} {mean.item():.7f} {loss_alone.item():.7f}", flush=True)
    if what == "train" and step + 1 == SAVE_AT:
        model_state, optim_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
        print("saved", flush=True)
print("done", flush=True)
dist.destroy_process_group()
