"""Many clients of one server: aggregate ops/s and per-client step time, memif and TCP.

    python benchmarks/bench_clients.py [--clients 1,4,16] [--transports dpdk,tcp] [--steps N] [--json]

For each transport and client count, starts a server (tcp,dpdk, on CPU or
$REMOTE_ACCEL_TEST_DEVICE) and that many client processes; each connects, warms up, then
(all at once, on "go") trains a small MLP for --steps steps, timing each step (one
`.item()` sync per step). Reported: the server's ops per second over all clients (its
own op counter over the wall time of the run) and the median step time per client
(median over clients, and the slowest client's). On a 2-core machine the clients and
the server share two cores: the figures say how the load is shared, not peak speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WORKER = "--worker"


def worker(transport: str, steps: int) -> int:
    import torch
    import torch.nn as nn

    import remote_accel
    from training import training_step  # this folder, beside the script

    remote_accel.init(transport=transport, timeout=120)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to("remote_accel")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64).to("remote_accel"), torch.randint(0, 10, (32,)).to("remote_accel")
    step = training_step(model, opt, x, y)

    for _ in range(3):  # meta shapes and plans are cached after the first steps
        step()
    print("ready", flush=True)
    sys.stdin.readline()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    print(json.dumps({"step_s": statistics.median(times)}), flush=True)
    sys.stdin.readline()
    remote_accel.shutdown()
    return 0


def run(server, transport: str, n: int, steps: int) -> dict:
    from remote_accel.server.testing import Client

    env = dict(os.environ, **server.client_env(), REMOTE_ACCEL_SERVER="%s:%d" % server.tcp,
               REMOTE_ACCEL_TOKEN=server.token)
    procs = [subprocess.Popen([sys.executable, __file__, WORKER, transport, str(steps)], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in range(n)]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a {transport} client failed to start (rc {p.wait()})")
        with Client.tcp(*server.tcp, token=server.token) as observer:
            ops0 = observer.stats()["server_ops_done"]
            start = time.perf_counter()
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            results = [json.loads(p.stdout.readline()) for p in procs]
            wall = time.perf_counter() - start
            ops = observer.stats()["server_ops_done"] - ops0
        for p in procs:
            p.stdin.write("exit\n")
            p.stdin.flush()
            p.wait(120)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    step_s = sorted(r["step_s"] for r in results)
    return {"transport": "memif" if transport == "dpdk" else "tcp", "clients": n, "ops": ops, "wall_s": wall,
            "ops_per_s": ops / wall, "step_ms_median": statistics.median(step_s) * 1e3,
            "step_ms_slowest": step_s[-1] * 1e3}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == WORKER:
        return worker(sys.argv[2], int(sys.argv[3]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,4,16", help="client counts, comma-separated (default: 1,4,16)")
    parser.add_argument("--transports", default="dpdk,tcp", help="dpdk (memif), tcp or both (default: dpdk,tcp)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per client (default: 30)")
    parser.add_argument("--json", action="store_true", help="one JSON line per run instead of a table")
    args = parser.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    transports = [t.strip() for t in args.transports.split(",")]
    if any(t not in ("dpdk", "tcp") for t in transports) or any(c < 1 for c in counts):
        parser.error("transports are dpdk and tcp; client counts are positive")

    from remote_accel.server.testing import ServerProcess

    if not args.json:
        print(f"{'transport':>9} {'clients':>7} {'ops/s (all)':>11} {'step ms (median client)':>23} "
              f"{'step ms (slowest)':>17}")
    for transport in transports:
        for n in counts:
            # A fresh server per run: each client count starts from the same state.
            with ServerProcess("--transport", "tcp,dpdk", "--max-clients", str(n + 1)) as server:
                r = run(server, transport, n, args.steps)
            if args.json:
                print(json.dumps(r), flush=True)
            else:
                print(f"{r['transport']:>9} {n:>7} {r['ops_per_s']:>11.0f} {r['step_ms_median']:>23.1f} "
                      f"{r['step_ms_slowest']:>17.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
