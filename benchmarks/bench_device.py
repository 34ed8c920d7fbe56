"""Client-side cost of the remote_accel device, measured side by side in one run.

    python benchmarks/bench_device.py [--transport tcp|dpdk] [--steps N]

Starts a server (on CPU, or on $REMOTE_ACCEL_TEST_DEVICE) and reports: client cost per
queued op (enqueue only), ops per second end to end, round trips per training step, and
remote vs local step time for a small MLP, eager and compiled.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.nn as nn

import remote_accel
from remote_accel.pytorch_ext import runtime
from remote_accel.server.testing import ServerProcess


def _step_fn(model, device):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64).to(device)
    y = torch.randint(0, 10, (32,)).to(device)

    def step():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def _time(fn, n: int) -> float:
    """Median seconds per call: on a small shared machine the mean follows stray stalls."""
    fn()
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", choices=("tcp", "dpdk"), default="tcp")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    # the server always serves TCP too: its address is how the fixture knows it is up
    transport = "tcp" if args.transport == "tcp" else "tcp,dpdk"
    with ServerProcess("--transport", transport) as server:
        host, port = server.tcp
        os.environ.update(server.client_env())  # the server's private memif socket
        remote_accel.init(transport=args.transport, server=f"{host}:{port}", token=server.token)
        session = runtime.sessions()[0]
        a = torch.randn(16, 16, device="remote_accel")
        n, enqueues, rates = 2000, [], []
        for _ in range(5):  # the median of five rounds
            session.sync()
            start = time.perf_counter()
            for _ in range(n):
                a.add_(1.0)
            enqueues.append((time.perf_counter() - start) / n)
            session.sync()
            rates.append(n / (time.perf_counter() - start))
        enqueue, ops_per_s = statistics.median(enqueues), statistics.median(rates)

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        local = _time(_step_fn(copy.deepcopy(model), "cpu"), args.steps)
        remote_step = _step_fn(copy.deepcopy(model).to("remote_accel"), "remote_accel")
        before = session.counters["round_trips"]
        remote = _time(remote_step, args.steps)
        trips = (session.counters["round_trips"] - before) / (args.steps + 2)
        compiled_model = torch.compile(copy.deepcopy(model).to("remote_accel"), backend="remote_accel")
        compiled = _time(_step_fn(compiled_model, "remote_accel"), args.steps)
        remote_accel.shutdown()
    print(f"transport: {args.transport}")
    print(f"client cost per queued op (enqueue):   {enqueue * 1e6:8.1f} us")
    print(f"ops per second end to end:             {ops_per_s:8.0f}")
    print(f"round trips per eager step (loss.item): {trips:8.2f}")
    print(f"step time local CPU:                   {local * 1e3:8.2f} ms")
    print(f"step time remote eager:                {remote * 1e3:8.2f} ms  ({remote / local:.1f}x local)")
    print(f"step time remote compiled:             {compiled * 1e3:8.2f} ms  ({compiled / local:.1f}x local)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
