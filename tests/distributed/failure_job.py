"""Run by torchrun in tests/distributed/test_failures.py: one way for a process group to
go wrong (argv[1]), then what every rank sees. Each rank prints "raised SECONDS TYPE:
MESSAGE" when a sync point raises, or "no error"; a rank that must die exits at once."""

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

case = sys.argv[1]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]))
dist.init_process_group(timeout=timedelta(seconds=float(os.environ.get("RACCL_TEST_TIMEOUT", "20"))))
dev = torch.device("remote_accel", torch.accelerator.current_device_index())
x = torch.ones(1000, device=dev)
dist.all_reduce(x)  # the group works, and every rank's server joined it
print(f"rank {rank} joined, sum {x[0].item():g}", flush=True)

if case == "shapes":
    y = torch.ones(10 + rank, device=dev)  # ranks disagree on the size
elif case == "dtype":
    y = torch.ones(10, dtype=torch.int64, device=dev)  # AVG has no meaning for integers
elif case == "absent":
    y = torch.ones(10, device=dev)
    if rank == world - 1:
        print("never joins the collective", flush=True)
        time.sleep(3600)
elif case in ("peer_dies", "server_dies", "server_freezes"):
    y = torch.ones(10, device=dev)
    if rank == world - 1:
        if case in ("server_dies", "server_freezes"):
            os.kill(int(os.environ["RACCL_TEST_SERVER_PIDS"].split(",")[rank]),
                    signal.SIGKILL if case == "server_dies" else signal.SIGSTOP)
            time.sleep(1)
        else:
            print("dies now", flush=True)
            os._exit(17)
started = time.monotonic()
try:
    dist.all_reduce(y, op=dist.ReduceOp.AVG if case == "dtype" else dist.ReduceOp.SUM)
    print(f"rank {rank} sum {y.sum().item():g}", flush=True)  # the sync point
    dist.all_reduce(y)  # and the group stays broken
    y.sum().item()
    print("no error", flush=True)
except Exception as exc:  # noqa: BLE001 (the test reads what was raised)
    print(f"raised {time.monotonic() - started:.1f} {type(exc).__name__}: {exc}".replace("\n", " | "), flush=True)
os._exit(0)  # a broken group's destroy would wait on nothing useful; the test reads the lines above
