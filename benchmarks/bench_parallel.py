"""remote_accel.parallel.DataParallel over 1, 2, 3 servers: throughput, client bytes and
client CPU per training step, and a projection for 8 GPU servers.

    python benchmarks/bench_parallel.py [--servers 1,2,3] [--steps 10] [--batch 256] [--width 512]
                                        [--depth 2] [--server-threads 1] [--ray | --tls | --dpdk] [--json]

Starts max(--servers) server processes on 127.0.0.1 (or with --ray a remote_accel.ray
ServerPool on a local Ray cluster; with --tls servers that speak TLS only, with a
certificate of a CA made for the run, whose direct copies run over TLS too; with --dpdk
server 0 also serves DPDK on a memif port, which the client reaches it by with
transport="auto", the others over TCP, each N in a client process of its own), each with
--server-threads CPU threads, and for each
N trains an MLP (--depth blocks of Linear(width, 4 width), ReLU, Linear(4 width, width))
with SGD: N = 1 is the plain module on one server, N > 1 DataParallel over the first N.
Every step uploads its batch from this host (as a data loader would) and reads the loss
back (`.item()`): those are the only tensor bytes that should cross the client. Figures
over --steps timed steps after two warm-up steps: samples/s, client tensor bytes (up +
down) and all wire bytes per step, server-to-server bytes per step, and client CPU per
step (this process's CPU time, all its threads). Beside each N > 1 the ceiling: N
independent copies of the model, one per server, each on 1/N of the batch with no copy
between servers, which says what this host lets N servers do side by side at the time.

On a 2-core host two servers of one thread each have a core each, and the client shares
them: the N = 2 row says how much of a second server one process can use; N = 3 has
more servers than cores and cannot be faster.

The projection for GPU servers is a model, not a run:
    step(N) = max(client_cpu(N), compute / N + comm(N))
    comm(N) = 2 * ceil(log2 N) * (latency + param_bytes / link)     (tree broadcast + reduce)
            + (N - 1) / N * (input_bytes + output_bytes) / link     (scatter + gather)
client_cpu(N) is fitted (a + b * N) to the measured rows; latency (one direct copy of 4
bytes, both servers idle) is measured here; compute is the model's FLOPs at
--gpu-tflops; link is --link-gbps between servers (the measured local copy bandwidth is
printed beside it). The model ignores overlap of communication with compute (there is
none yet: the reduce starts after the last replica's backward) and the optimizer step.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

MIB = 1 << 20


def _model(width: int, depth: int):
    from torch import nn

    blocks = [nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width))
              for _ in range(depth)]
    return nn.Sequential(*blocks)


def _counters(n: int) -> dict:
    import remote_accel

    out = {"tensor": 0, "wire": 0, "peer": 0}
    for i in range(n):
        s = remote_accel.stats(f"remote_accel:{i}")
        out["tensor"] += s["bytes_up"] + s["bytes_down"]
        out["wire"] += s["bytes_sent"] + s["bytes_received"]
        out["peer"] += s["peer_bytes"]
    return out


def _copy_costs(param_bytes: int) -> dict:
    """One direct copy 0 -> 1 of 4 bytes (latency) and of the parameters' bytes
    (bandwidth), best of 3, each waited for on the destination."""
    import torch

    out = {}
    for name, nbytes in (("latency_s", 4), ("param_copy_s", param_bytes)):
        x = torch.zeros(nbytes // 4, device="remote_accel:0")
        torch.remote_accel.synchronize(0)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            x.to("remote_accel:1")
            torch.remote_accel.synchronize(1)
            best = min(best, time.perf_counter() - start)
        out[name] = best
    out["local_copy_GBps"] = param_bytes / out["param_copy_s"] / 1e9
    return out


def _ceiling(model, n: int, x, y, steps: int) -> float:
    """Samples/s of n independent copies of the model, one per server, each training on
    its 1/n of the batch with no copy between servers: what this host lets n servers do
    side by side at this moment, the most DataParallel could reach."""
    import copy

    import torch
    from torch import nn

    models = [copy.deepcopy(model).to(f"remote_accel:{i}") for i in range(n)]
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in models]
    xs, ys = x.chunk(n), y.chunk(n)

    def step() -> None:
        losses = []
        for i, (m, o) in enumerate(zip(models, opts)):
            dev = f"remote_accel:{i}"
            loss = nn.functional.mse_loss(m(xs[i].to(dev)), ys[i].to(dev))
            o.zero_grad()
            loss.backward()
            o.step()
            losses.append(loss)
        for loss in losses:
            loss.item()

    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return x.shape[0] * steps / (time.perf_counter() - start)


def run(n: int, addresses, tokens, args) -> dict:
    import torch
    from torch import nn

    import remote_accel
    from remote_accel.parallel import DataParallel

    # with --dpdk the port leads to server 0; "auto" reaches the others over TCP
    transport = "auto" if args.dpdk else "tcp"
    remote_accel.init(transport=transport, servers=addresses[:n], tokens=tokens[:n], timeout=120, tls_ca=args.tls_ca)
    try:
        from remote_accel.pytorch_ext import runtime

        links = [runtime.session(i).transport.peer.partition(":")[0] for i in range(n)]  # "tcp", "dpdk", "tls"
        torch.manual_seed(0)
        model = _model(args.width, args.depth).to("remote_accel:0")
        net = DataParallel(model) if n > 1 else model
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        x, y = torch.randn(args.batch, args.width, generator=gen), torch.randn(args.batch, args.width, generator=gen)

        def step() -> float:
            out = net(x.to("remote_accel:0"))
            loss = nn.functional.mse_loss(out, y.to("remote_accel:0"))
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.item()

        for _ in range(2):
            step()
        before, cpu0, t0 = _counters(n), time.process_time(), time.perf_counter()
        for _ in range(args.steps):
            step()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        after = _counters(n)
        result = {"servers": n, "links": links, "samples_per_s": args.batch * args.steps / seconds,
                  "step_ms": seconds / args.steps * 1e3, "client_cpu_ms": cpu / args.steps * 1e3}
        for key in before:
            result[f"{key}_bytes_per_step"] = (after[key] - before[key]) // args.steps
        if n > 1:
            result["ceiling_samples_per_s"] = _ceiling(model, n, x, y, args.steps)
        if n > 1 and args.copy_costs:
            param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            result["copies"] = _copy_costs(param_bytes)
        return result
    finally:
        remote_accel.shutdown()


def _run_child(n: int, addresses, tokens, env: dict, argv) -> dict:
    """run(n, ...) in a client process of its own, with the DPDK server's environment."""
    import os
    import subprocess

    cmd = [sys.executable, __file__, *(sys.argv[1:] if argv is None else argv),
           "--child", json.dumps([n, addresses, tokens])]
    proc = subprocess.run(cmd, env=dict(os.environ, **env), capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"the client for {n} server(s) failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def project(rows: list[dict], args, param_bytes: int, latency_s: float) -> list[dict]:
    """The model of the docstring for 1, 2, 4, 8 GPU servers."""
    ns = [r["servers"] for r in rows]
    cpus = [r["client_cpu_ms"] / 1e3 for r in rows]
    if len(ns) > 1:  # least squares a + b * N
        mean_n, mean_c = sum(ns) / len(ns), sum(cpus) / len(cpus)
        b = sum((n - mean_n) * (c - mean_c) for n, c in zip(ns, cpus)) / sum((n - mean_n) ** 2 for n in ns)
        a = mean_c - b * mean_n
    else:
        a, b = cpus[0], 0.0
    flops = 6 * args.batch * param_bytes / 4  # forward 2, backward 4 per parameter and sample
    compute = flops / (args.gpu_tflops * 1e12)
    link = args.link_gbps * 1e9 / 8
    act = 2 * args.batch * args.width * 4  # inputs scattered, outputs gathered
    out = []
    for n in (1, 2, 4, 8):
        comm = 0.0 if n == 1 else (2 * math.ceil(math.log2(n)) * (latency_s + param_bytes / link)
                                   + (n - 1) / n * act / link)
        client = a + b * n
        step = max(client, compute / n + comm)
        out.append({"servers": n, "step_ms": step * 1e3, "samples_per_s": args.batch / step,
                    "client_cpu_ms": client * 1e3, "compute_ms": compute / n * 1e3, "comm_ms": comm * 1e3,
                    "bound": "client CPU" if client >= compute / n + comm else "servers"})
    base = out[0]["samples_per_s"]
    for row in out:
        row["speedup"] = row["samples_per_s"] / base
        # the one-server step time from which N servers reach half of N times its speed:
        # compute / N + comm <= 2 compute / N and client <= 2 compute / N
        n = row["servers"]
        row["pays_from_ms"] = max(n * row["comm_ms"], n * row["client_cpu_ms"] / 2)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", default="1,2,3", help="server counts, comma-separated (default: 1,2,3)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per server count (default: 10)")
    p.add_argument("--batch", type=int, default=256, help="samples per step, split over the servers (default: 256)")
    p.add_argument("--width", type=int, default=512, help="the MLP's width (default: 512)")
    p.add_argument("--depth", type=int, default=2, help="the MLP's blocks (default: 2)")
    p.add_argument("--server-threads", type=int, default=1, help="each server's --threads (default: 1)")
    p.add_argument("--gpu-tflops", type=float, default=50.0,
                   help="achieved TFLOP/s of one GPU server, for the projection (default: 50)")
    p.add_argument("--link-gbps", type=float, default=100.0,
                   help="Gbit/s between two servers, for the projection (default: 100)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--ray", action="store_true", help="servers from a remote_accel.ray.ServerPool")
    where.add_argument("--tls", action="store_true", help="TLS servers (a CA and certificate made for the run)")
    where.add_argument("--dpdk", action="store_true", help="server 0 over DPDK (memif), the others over TCP")
    p.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    p.add_argument("--child", help=argparse.SUPPRESS)  # with --dpdk: one N in a process of its own
    args = p.parse_args(argv)
    args.tls_ca = None
    args.copy_costs = True
    if args.child:
        n, addresses, tokens = json.loads(args.child)
        print(json.dumps(run(n, addresses, tokens, args)))
        return 0
    counts = sorted({int(c) for c in args.servers.split(",")})
    most = max(counts)

    if args.ray:
        import ray

        import remote_accel.ray

        ray.init(num_cpus=most * args.server_threads, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
        # the pool gives each server as many threads as CPUs it reserves for it
        pool = remote_accel.ray.ServerPool(num_servers=most, resources_per_server={"num_cpus": args.server_threads})
        try:
            rows = [run(n, pool.addresses(), pool.tokens(), args) for n in counts]
        finally:
            pool.shutdown()
            ray.shutdown()
    else:
        import tempfile

        from remote_accel.server.testing import ServerProcess, local_server_certificate

        procs = []
        pki = tempfile.TemporaryDirectory(prefix="bench-parallel-pki-")
        tls = ()
        if args.tls:
            tls, args.tls_ca = local_server_certificate(pki.name)
        try:
            for i in range(most):
                dpdk = ("--transport", "tcp,dpdk") if args.dpdk and i == 0 else ()
                procs.append(ServerProcess("--threads", str(args.server_threads), *tls, *dpdk,
                                           token=f"bench-{i}").start())
            addresses, tokens = ["%s:%d" % s.tcp for s in procs], [s.token for s in procs]
            if args.dpdk:  # a process per N: DPDK's EAL starts once per process
                rows = [_run_child(n, addresses, tokens, procs[0].client_env(), argv) for n in counts]
            else:
                rows = [run(n, addresses, tokens, args) for n in counts]
        finally:
            for s in procs:
                s.stop()
            pki.cleanup()

    param_bytes = sum(p.numel() * p.element_size() for p in _model(args.width, args.depth).parameters())
    copies = next((r["copies"] for r in rows if "copies" in r), None)
    # the model needs the client's cost at two server counts and a measured copy
    projection = project(rows, args, param_bytes, copies["latency_s"]) if copies and len(rows) > 1 else None
    if args.json:
        print(json.dumps({"rows": rows, "param_bytes": param_bytes, "projection": projection}))
        return 0
    input_bytes = 2 * args.batch * args.width * 4
    print(f"DataParallel, MLP {args.depth} x ({args.width} -> {4 * args.width} -> {args.width}), "
          f"{param_bytes / MIB:.1f} MiB of parameters, batch {args.batch} (inputs {input_bytes / MIB:.2f} MiB), "
          f"servers of {args.server_threads} thread(s){', Ray pool' if args.ray else ''}{', TLS' if args.tls else ''}"
          f"{', server 0 over DPDK (memif)' if args.dpdk else ''}")
    print(f"{'servers':>7} {'samples/s':>10} {'step ms':>8} {'speedup':>7} {'ceiling':>8} {'client CPU ms':>13} "
          f"{'client tensor B/step':>20} {'client wire B/step':>18} {'server-server B/step':>20}  links")
    base = rows[0]["samples_per_s"]
    for r in rows:
        ceiling = r.get("ceiling_samples_per_s", r["samples_per_s"]) / base
        print(f"{r['servers']:>7} {r['samples_per_s']:>10.1f} {r['step_ms']:>8.1f} {r['samples_per_s'] / base:>6.2f}x "
              f"{ceiling:>7.2f}x {r['client_cpu_ms']:>13.1f} {r['tensor_bytes_per_step']:>20,} "
              f"{r['wire_bytes_per_step']:>18,} {r['peer_bytes_per_step']:>20,}  {'/'.join(r['links'])}")
    print("ceiling: n independent models, one per server, no copies (what this host allows side by side)")
    if copies:
        print(f"direct copy 0 -> 1: latency {copies['latency_s'] * 1e3:.2f} ms; parameters "
              f"{copies['param_copy_s'] * 1e3:.1f} ms ({copies['local_copy_GBps']:.2f} GB/s on this host)")
    if projection is None:
        print("projection: needs two server counts, one of them 2 or more (--servers 1,2)")
        return 0
    print(f"projection (a model, see the docstring): GPU servers at {args.gpu_tflops:g} TFLOP/s, "
          f"{args.link_gbps:g} Gbit/s between servers, copy latency {copies['latency_s'] * 1e3:.2f} ms, "
          "client CPU fitted")
    print(f"{'servers':>7} {'samples/s':>10} {'step ms':>8} {'speedup':>7} {'compute ms':>10} {'comm ms':>8} "
          f"{'client CPU ms':>13}  bound")
    for r in projection:
        print(f"{r['servers']:>7} {r['samples_per_s']:>10.1f} {r['step_ms']:>8.2f} {r['speedup']:>6.2f}x "
              f"{r['compute_ms']:>10.2f} {r['comm_ms']:>8.2f} {r['client_cpu_ms']:>13.2f}  {r['bound']}")
    for r in projection[1:]:
        print(f"  {r['servers']} GPU servers reach half of {r['servers']}x once one server's step (same parameters) "
              f"takes {r['pays_from_ms']:.0f} ms or more")
    return 0


if __name__ == "__main__":
    sys.exit(main())
