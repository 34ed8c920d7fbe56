"""Run by torchrun in tests/distributed/test_failures.py: collectives the ranks get wrong,
each on a group of its own (a failure breaks that group only), then the default group
still works. Prints "CASE raised TYPE: MESSAGE" or "CASE no error" per case, "done"."""

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]))
dist.init_process_group()
dev = torch.device("remote_accel", torch.accelerator.current_device_index())
ABSENT_TIMEOUT_S = 5.0


def case(name: str, run, group) -> None:
    started = time.monotonic()
    try:
        tensor = run(group)
        tensor.sum().item()  # the sync point where a collective's failure is raised
        print(f"{name} no error", flush=True)
    except Exception as exc:  # noqa: BLE001 (the test reads what was raised)
        text = f"{type(exc).__name__}: {exc}".replace("\n", " | ")
        print(f"{name} raised after {time.monotonic() - started:.1f} s {text}", flush=True)


def shapes(group):  # every rank a different size
    t = torch.ones(10 + rank, device=dev)
    dist.all_reduce(t, group=group)
    return t


def avg_of_integers(group):  # a reduction the dtype refuses
    t = torch.ones(10, dtype=torch.int64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group)
    return t


def absent(group):  # the last rank never calls it
    t = torch.ones(10, device=dev)
    if rank != world - 1:
        dist.all_reduce(t, group=group)
    return t


def absent_later(group):  # the group's first collective runs on every rank, its second on all but the last
    t = torch.ones(10, device=dev)
    dist.all_reduce(t, group=group)
    return absent(group)


case("shapes", shapes, dist.new_group())
case("dtype", avg_of_integers, dist.new_group())
# a rank that never joins: at the group's first collective (its ranks meet in torch's store)
# and at a later one (the servers wait for the rank's data)
case("absent", absent, dist.new_group(timeout=timedelta(seconds=ABSENT_TIMEOUT_S)))
case("absent_later", absent_later, dist.new_group(timeout=timedelta(seconds=ABSENT_TIMEOUT_S)))
t = torch.full((4,), float(rank + 1), device=dev)
dist.all_reduce(t)  # the default group is untouched by the others' failures
print(f"default group works: {t.tolist()}", flush=True)
print("done", flush=True)
dist.destroy_process_group()
