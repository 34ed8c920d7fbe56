"""A copy remote_accel:0 -> remote_accel:1: server to server (direct) vs through the client.

    python benchmarks/bench_pool.py [--mib 256] [--repeat 3] [--ray] [--json]

Starts two servers (plain processes on 127.0.0.1, or with --ray a remote_accel.ray
ServerPool of two CPU servers on a local Ray cluster), puts --mib MiB on server 0, then
in one run times `x.to("remote_accel:1")` + a sync of server 1, first with direct
copies (init(direct_copies=True): the source server sends to the destination itself),
then through the client (direct_copies=False: a download to this host and an upload).
Each figure is the best of --repeat copies; the ratio is through-client time over direct
time. The client's and servers' byte counters show where the bytes went.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

MIB = 1 << 20


def _copy_time(mib: int, repeat: int) -> tuple[float, dict]:
    import torch

    import remote_accel

    host = torch.randint(0, 256, (mib * MIB,), dtype=torch.uint8)
    x = host.to("remote_accel:0")
    torch.remote_accel.synchronize(0)
    best = float("inf")
    wire0 = sum(remote_accel.stats(f"remote_accel:{i}")["bytes_sent"] + remote_accel.stats(f"remote_accel:{i}")
                ["bytes_received"] for i in (0, 1))
    peer0 = remote_accel.server_stats(1)["peer_bytes_received"]
    for _ in range(repeat):
        start = time.perf_counter()
        y = x.to("remote_accel:1")
        torch.remote_accel.synchronize(1)
        best = min(best, time.perf_counter() - start)
        del y
    wire = sum(remote_accel.stats(f"remote_accel:{i}")["bytes_sent"] + remote_accel.stats(f"remote_accel:{i}")
               ["bytes_received"] for i in (0, 1)) - wire0
    peer = remote_accel.server_stats(1)["peer_bytes_received"] - peer0
    check = x.to("remote_accel:1")
    if not torch.equal(check.cpu(), host):
        raise SystemExit("the copy is not bit-identical")
    return best, {"client_wire_bytes_per_copy": wire // repeat, "peer_bytes_per_copy": peer // repeat}


def _run(servers, tokens, mib: int, repeat: int) -> dict:
    import remote_accel

    out = {}
    for name, direct in (("direct", True), ("through_client", False)):
        remote_accel.init(transport="tcp", servers=servers, tokens=tokens, direct_copies=direct, timeout=120)
        try:
            seconds, counts = _copy_time(mib, repeat)
        finally:
            remote_accel.shutdown()
        out[name] = {"seconds": seconds, "GB_per_s": mib * MIB / seconds / 1e9, **counts}
    out["ratio"] = out["through_client"]["seconds"] / out["direct"]["seconds"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="MiB copied (default: 256)")
    p.add_argument("--repeat", type=int, default=3, help="copies per way; the best counts (default: 3)")
    p.add_argument("--ray", action="store_true", help="servers from a remote_accel.ray.ServerPool")
    p.add_argument("--json", action="store_true", help="print JSON only")
    args = p.parse_args(argv)
    if args.ray:
        import ray

        import remote_accel.ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        pool = remote_accel.ray.ServerPool(num_servers=2, resources_per_server={"num_cpus": 1})
        try:
            result = _run(pool.addresses(), pool.tokens(), args.mib, args.repeat)
        finally:
            pool.shutdown()
            ray.shutdown()
    else:
        from remote_accel.server.testing import ServerProcess

        with ServerProcess(token="bench-a") as a, ServerProcess(token="bench-b") as b:
            result = _run([f"{a.tcp[0]}:{a.tcp[1]}", f"{b.tcp[0]}:{b.tcp[1]}"], [a.token, b.token], args.mib,
                          args.repeat)
    result["mib"] = args.mib
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"copy of {args.mib} MiB remote_accel:0 -> remote_accel:1 ({'Ray pool' if args.ray else 'two servers'}, "
          f"best of {args.repeat})")
    for name in ("direct", "through_client"):
        r = result[name]
        print(f"  {name:15s} {r['seconds'] * 1e3:8.1f} ms  {r['GB_per_s']:6.2f} GB/s  "
              f"client wire bytes/copy {r['client_wire_bytes_per_copy']:>11d}  "
              f"peer bytes/copy {r['peer_bytes_per_copy']:>11d}")
    print(f"  ratio (through client / direct): {result['ratio']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
