"""A CPU server beside its client: how its kernels' threads wait, against local CPU.

    python benchmarks/bench_cpu_wait.py [--rounds N] [--steps N] [--transport tcp|dpdk]

The tiny Transformer of bench_compile.py, trained eagerly with AdamW (batch 8x32), timed
as the median of steps 6..N: local CPU in a clean process (torch's threads, and one
thread), then remote over loopback TCP (or memif) with the server on torch's threads
waiting as OpenMP does by default (the server's default), with OMP_WAIT_POLICY=PASSIVE
(its default until 2026-11-28), and on one thread (--threads 1). Every round is printed,
local and remote alternating, so that a slow spell of a shared host shows in both.
docs/design/cpu-threads.md says what the figures decided.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from timing import json_child  # noqa: E402  (this folder, beside the script)

SERVERS = {  # name: (server options, server environment)
    "default": ((), {}),
    "PASSIVE": ((), {"OMP_WAIT_POLICY": "PASSIVE"}),
    "--threads 1": (("--threads", "1"), {}),
}


def _steps(side: str, steps: int) -> None:
    """One run in this (child) process: prints {"ms": median step, "loss": last loss}."""
    import torch
    import torch.nn as nn

    from bench_compile import TinyTransformer

    device = "cpu"
    if side == "local-1":
        torch.set_num_threads(1)
    elif side == "remote":
        import remote_accel

        if os.environ["BENCH_TRANSPORT"] == "dpdk":
            remote_accel.init(transport="dpdk", port=0, token=os.environ["BENCH_TOKEN"])
        else:
            remote_accel.init(transport="tcp", server=os.environ["BENCH_SERVER"], token=os.environ["BENCH_TOKEN"])
        device = "remote_accel"
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randint(0, 1000, (8, 32)).to(device), torch.randint(0, 10, (8,)).to(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        last = loss.item()
        times.append(time.perf_counter() - start)
    print(json.dumps({"ms": statistics.median(times[5:]) * 1e3, "loss": last}))


def _child(side: str, steps: int, env: dict) -> dict:
    return json_child(__file__, ["--side", side, "--steps", str(steps)], env, side, timeout=600)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--transport", choices=("tcp", "dpdk"), default="tcp")
    p.add_argument("--side", choices=("local", "local-1", "remote"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        _steps(args.side, args.steps)
        return 0
    from remote_accel.server.testing import ServerProcess

    local_env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}  # as a user's script
    print(f"tiny Transformer eager step, ms (median of steps 6-{args.steps}), server over {args.transport}, "
          "every round")
    print(f"{'round':>5}  {'local':>6}  {'local 1 thread':>14}  " + "  ".join(f"{n:>12}" for n in SERVERS))
    for rnd in range(1, args.rounds + 1):
        row = [_child("local", args.steps, local_env)["ms"], _child("local-1", args.steps, local_env)["ms"]]
        for options, env in SERVERS.values():
            transports = ("--transport", "tcp,dpdk") if args.transport == "dpdk" else ()
            with ServerProcess(*options, *transports, env=env) as server:
                host, port = server.tcp
                child_env = dict(local_env, **server.client_env(), BENCH_TRANSPORT=args.transport,
                                 BENCH_SERVER=f"{host}:{port}", BENCH_TOKEN=server.token)
                row.append(_child("remote", args.steps, child_env)["ms"])
        print(f"{rnd:>5}  {row[0]:6.2f}  {row[1]:14.2f}  " + "  ".join(f"{ms:12.2f}" for ms in row[2:]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
