"""Recovery (issue #35): what keeping a session recoverable costs, and what a recovery takes.

    python benchmarks/bench_recovery.py [--transport tcp|dpdk] [--steps N] [--rounds N]
                                        [--server-threads N] [--big-mb MB]
                                        [--only overhead,loader,recovery]

overhead: the tiny Transformer's eager training step (bench_compile.py's model, AdamW,
a loss.item() per step) with recovery on and off, alternating --rounds times in this one
process against one server (a slow spell of the shared host hits both); medians of
--steps steps per round, and their ratio per round.

loader: a loop that uploads a fresh batch per step, as from a data loader (a linear
model on 3 MiB batches, SGD, loss.item() per step: 5 x --steps steps), recovery on and
off alternating --rounds times: median step times, their ratio, and with recovery on the
client's RSS growth over the run and the most host memory recovery kept (recovery_bytes:
each batch is kept by reference until a snapshot replaces the journal).

recovery: per model (the tiny Transformer; an MLP of about --big-mb MB of parameters,
AdamW), --steps steps (the larger model: a few), then the server killed with SIGKILL and
started again on its address. Timed from the moment it listens again: "recovery s",
stats()["recovery_seconds"] (reconnect, restore, and the replay up to the last sync
point, run on the server), and "then s", the rest of the first read after it; beside
them the original time of the work replayed ("work s"), the ops replayed and the host
memory recovery kept (recovery_bytes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn as nn

import remote_accel
from bench_compile import TinyTransformer  # noqa: E402  (this folder, beside the script)
from timing import add_server_threads_option, server_thread_options  # noqa: E402
from training import training_step  # noqa: E402
from remote_accel.server.testing import ServerProcess


def _step_fn(model: nn.Module, batch: tuple, lr: float = 1e-3):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return training_step(model, opt, *batch)


def _tiny():
    torch.manual_seed(0)
    model = TinyTransformer().to("remote_accel")
    batch = (torch.randint(0, 1000, (8, 32)).to("remote_accel"), torch.randint(0, 10, (8,)).to("remote_accel"))
    return model, batch


def _big(mb: int):
    torch.manual_seed(0)
    width = 2048
    layers = max(1, (mb << 20) // (4 * width * width))
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())],
                          nn.Linear(width, 10)).to("remote_accel")
    batch = (torch.randn(32, width).to("remote_accel"), torch.randint(0, 10, (32,)).to("remote_accel"))
    return model, batch


def _connect(server: ServerProcess, transport: str, recovery: bool) -> None:
    host, port = server.tcp
    remote_accel.init(transport=transport, server=f"{host}:{port}", token=server.token, timeout=60,
                      recovery=recovery)


def overhead(server: ServerProcess, args) -> None:
    print(f"steady-state cost of recovery: tiny Transformer, eager step with loss.item(), medians of "
          f"{args.steps} steps, {args.rounds} rounds alternating")
    print(f"{'round':>5} {'on ms':>8} {'off ms':>8} {'on/off':>7}")
    ratios = []
    for r in range(args.rounds):
        medians = {}
        for recovery in ((True, False) if r % 2 == 0 else (False, True)):
            _connect(server, args.transport, recovery)
            model, batch = _tiny()
            step = _step_fn(model, batch)
            for _ in range(5):
                step()
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            medians[recovery] = statistics.median(times)
            remote_accel.shutdown()
        ratios.append(medians[True] / medians[False])
        print(f"{r:>5} {medians[True] * 1e3:8.2f} {medians[False] * 1e3:8.2f} {ratios[-1]:7.3f}")
    print(f"median on/off: {statistics.median(ratios):.3f}")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def loader(server: ServerProcess, args) -> None:
    steps = 5 * args.steps
    print(f"a fresh 3 MiB batch uploaded per step (linear model, SGD, loss.item()), medians of {steps} steps, "
          f"{args.rounds} rounds alternating; recovery on: client RSS growth, most recovery_bytes")
    print(f"{'loader':>6} {'on ms':>8} {'off ms':>8} {'on/off':>7} {'RSS +MiB':>9} {'kept MB':>8}")
    ratios = []
    for r in range(args.rounds):
        medians, grown, kept = {}, 0.0, 0
        for recovery in ((True, False) if r % 2 == 0 else (False, True)):
            _connect(server, args.transport, recovery)
            torch.manual_seed(0)
            model = nn.Linear(3072, 10).to("remote_accel")
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            start_rss, times = _rss_mib(), []
            for i in range(steps + 5):
                start = time.perf_counter()
                x = torch.randn(256, 3072).to("remote_accel")
                y = torch.randint(0, 10, (256,)).to("remote_accel")
                loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                loss.item()
                if i >= 5:
                    times.append(time.perf_counter() - start)
                if recovery:
                    kept = max(kept, remote_accel.stats()["recovery_bytes"])
            if recovery:
                grown = _rss_mib() - start_rss
            medians[recovery] = statistics.median(times)
            remote_accel.shutdown()
        ratios.append(medians[True] / medians[False])
        print(f"{'loader ' + str(r):>6} {medians[True] * 1e3:8.2f} {medians[False] * 1e3:8.2f} {ratios[-1]:7.3f} "
              f"{grown:9.0f} {kept / 1e6:8.1f}")
    print(f"loader median on/off: {statistics.median(ratios):.3f}")


def recover(server: ServerProcess, args) -> None:
    print("recovery: killed with SIGKILL after the steps, restarted on its address; seconds from listening again")
    print(f"{'model':>14} {'steps':>5} {'step s':>7} {'kept MB':>8} {'ops':>7} "
          f"{'recovery s':>10} {'then s':>7} {'work s':>7}")
    for name, make, steps in (("tiny", _tiny, args.steps), ("mlp", lambda: _big(args.big_mb),
                                                             max(2, args.steps // 20))):
        _connect(server, args.transport, True)
        model, batch = make()
        if name == "mlp":
            name = f"mlp {sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6:.0f} MB"
        step = _step_fn(model, batch)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        work = time.perf_counter() - start
        stats = remote_accel.stats()
        server.kill()
        server.restart()
        back = time.perf_counter()
        next(model.parameters()).sum().item()  # the recovery, then the replayed work run to its end
        done = time.perf_counter() - back
        after = remote_accel.stats()
        print(f"{name:>14} {steps:5d} {work / steps:7.3f} {stats['recovery_bytes'] / 1e6:8.1f} "
              f"{after['replayed_ops']:7d} {after['recovery_seconds']:10.3f} "
              f"{done - after['recovery_seconds']:7.3f} {work:7.3f}")
        step()  # and training goes on
        remote_accel.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", choices=("tcp", "dpdk"), default="tcp")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--big-mb", type=int, default=100, help="parameter megabytes of the larger model")
    parser.add_argument("--only", default="overhead,loader,recovery")
    add_server_threads_option(parser)
    args = parser.parse_args()
    parts = set(args.only.split(","))
    options = ("--transport", "tcp" if args.transport == "tcp" else "tcp,dpdk",
               *server_thread_options(args.server_threads))
    with ServerProcess(*options) as server:
        os.environ.update(server.client_env())
        if "overhead" in parts:
            overhead(server, args)
        if "loader" in parts:
            loader(server, args)
        if "recovery" in parts:
            recover(server, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
