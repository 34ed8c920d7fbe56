"""Sync latency in bursts on a new connection and after idle pauses, slice by slice.

    python benchmarks/sync_after_idle.py [--transport dpdk|tcp] [--rounds N] [--pause S]

A fresh server (on CPU) and this client: 5 warm-up calls, then `rounds` times: a pause of
`pause` seconds (none before the first round), then 900 calls of `x.sum().item()` (16
floats), printed as the medians of 75-call slices with the minor page faults each slice
took in this process and in the server, so a slow stretch, how long it lasts and whether
page faults go with it all show. What it showed on a 2-core VM (docs/design/doorbells.md,
"A new connection's first round trips" and "Two threads on one core"): a new memif connection's
first ~500 round trips faulted on fresh pages of the shared region (~5 faults per trip per
side; the shim now maps them at connect), and after a pause the first slices can run at
~41 us instead of ~17 while the kernel keeps client and server thread on one core.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

SLICE = 75
CALLS = 900


def _minor_faults(pid) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", choices=("dpdk", "tcp"), default="dpdk")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--pause", type=float, default=2.0)
    args = parser.parse_args()
    import torch

    import remote_accel
    from remote_accel.server.testing import ServerProcess

    with ServerProcess("--transport", "tcp" if args.transport == "tcp" else "tcp,dpdk") as server:
        host, port = server.tcp
        os.environ.update(server.client_env())
        remote_accel.init(transport=args.transport, server=f"{host}:{port}", token=server.token)
        x = torch.randn(16, device="remote_accel")
        for _ in range(5):
            x.sum().item()
        print(f"x.sum().item() over {args.transport}: medians of {SLICE}-call slices, us "
              f"[minor faults: client, server]")
        for round_ in range(args.rounds):
            if round_:
                time.sleep(args.pause)
            slices = []
            for _ in range(CALLS // SLICE):
                faults = _minor_faults("self"), _minor_faults(server.proc.pid)
                times = []
                for _ in range(SLICE):
                    start = time.perf_counter()
                    x.sum().item()
                    times.append(time.perf_counter() - start)
                slices.append((statistics.median(times) * 1e6, _minor_faults("self") - faults[0],
                               _minor_faults(server.proc.pid) - faults[1]))
            when = "new connection" if round_ == 0 else f"after {args.pause:g} s"
            print(f"{when:>15}: median {statistics.median(s[0] for s in slices):5.1f}  "
                  + " ".join(f"{us:.0f}[{c},{s}]" for us, c, s in slices))
        remote_accel.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
