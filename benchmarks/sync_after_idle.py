"""Sync latency in bursts after idle pauses, with and without the server's move off its
client's core, side by side in one run.

    python benchmarks/sync_after_idle.py [--transport dpdk|tcp] [--rounds N] [--pause S]

For each setting of REMOTE_ACCEL_DPDK_MOVE_OFF_PEER (1, the default, and 0; the setting
only matters over DPDK) a fresh server (on CPU) and this client: 50 warm-up calls, then
`rounds` times: a pause of `pause` seconds, then 900 calls of `x.sum().item()` (16
floats), printed as the medians of 75-call slices, so a slow stretch (and how long it
lasts) shows. After a pause the server's session thread sleeps; the client's request
wakes it, and the kernel tends to wake it on the client's core, where the two then take
turns (each round trip slower, on a 2-core VM about 41 us instead of 17 over memif) until
the load balancer parts them; a server waiter that finds its client on its own core moves
off it (dpdk_shim/doorbell.c, db_spin). A fresh connection's first round trips used to
fault on the pages of memif's shared region; the shim now maps them at connect
(dpdk_shim/prefault.c).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SLICE = 75
CALLS = 900


def _client(transport: str, rounds: int, pause: float) -> None:
    import torch

    import remote_accel
    from remote_accel.pytorch_ext import runtime
    from remote_accel.server.testing import ServerProcess

    with ServerProcess("--transport", "tcp" if transport == "tcp" else "tcp,dpdk") as server:
        host, port = server.tcp
        os.environ.update(server.client_env())
        remote_accel.init(transport=transport, server=f"{host}:{port}", token=server.token)
        x = torch.randn(16, device="remote_accel")
        for _ in range(50):
            x.sum().item()
        slices = []
        for _ in range(rounds):
            time.sleep(pause)
            times = []
            for _ in range(CALLS):
                start = time.perf_counter()
                x.sum().item()
                times.append(time.perf_counter() - start)
            slices.append([statistics.median(times[i:i + SLICE]) * 1e6 for i in range(0, CALLS, SLICE)])
        moves = runtime.session(0).stats()["transport"].get("moves_off_peer", 0)
        remote_accel.shutdown()
    print(json.dumps({"slices": slices, "moves": moves}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", choices=("dpdk", "tcp"), default="dpdk")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--pause", type=float, default=2.0)
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)  # one setting, in a process of its own
    args = parser.parse_args()
    if args.client:
        _client(args.transport, args.rounds, args.pause)
        return 0
    print(f"x.sum().item() over {args.transport}, us: medians of {SLICE}-call slices of {CALLS} calls after each "
          f"{args.pause:g} s pause")
    results = {}
    for setting in ("1", "0"):  # each in a process of its own (one EAL per process)
        env = dict(os.environ, REMOTE_ACCEL_DPDK_MOVE_OFF_PEER=setting, OMP_WAIT_POLICY="PASSIVE")
        out = subprocess.run([sys.executable, __file__, "--client", "--transport", args.transport, "--rounds",
                              str(args.rounds), "--pause", str(args.pause)], env=env, text=True,
                             capture_output=True, check=True)
        results[setting] = json.loads(out.stdout.strip().splitlines()[-1])
    for setting, name in (("1", "server moves off its client's core"), ("0", "REMOTE_ACCEL_DPDK_MOVE_OFF_PEER=0")):
        r = results[setting]
        print(f"{name} (moves: {r['moves']})")
        for i, row in enumerate(r["slices"], 1):
            print(f"  round {i}: median {statistics.median(row):5.1f}  slices " + " ".join(f"{v:.0f}" for v in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
