"""Data plane benchmark: bulk GB/s and small-message round trips, side by side, for
memcpy of the same buffer (the limit), DPDK memif between two processes, and TCP
loopback between two processes, plain and over TLS (what encryption costs); then what a
user sees: a tensor's round trip `y = x.to("remote_accel"); y.cpu()` through a real
server over memif, over TCP and over TLS, every round trip landing in fresh tensors on
both sides as a training loop's batches do (GB/s counts the bytes both ways).

    python benchmarks/bench_dataplane.py                  # defaults: 64 MiB x 32, 20000 round trips
    python benchmarks/bench_dataplane.py --only tcp,tls   # TCP with and without TLS
    python benchmarks/bench_dataplane.py --busy-poll      # both ends spin (lowest latency, 2 cores busy)
    python benchmarks/bench_dataplane.py --idle-ms 20     # idle RTT: each round trip after 20 ms of silence
    python benchmarks/bench_dataplane.py --json
    python benchmarks/bench_dataplane.py --user-size 0     # transport level only
    python benchmarks/bench_dataplane.py --only dpdk,tcp --sweep   # + sizes, many tensors, a model's .to()

The far end is this script in peer mode (`--peer tcp|dpdk`), in another process: it
receives bulk messages into one reused buffer (so page faults of fresh memory do not
count) and answers ECHO at once. This is a benchmark, not a test: numbers depend on
the machine and on what else runs on it.

RTT is measured back to back (both ends still polling) and after idle (each round trip
after --idle-ms of silence: both ends have gone to sleep, so it is the wake-up path). The
row "dpdk memif naps" runs the same round trips with the shim's doorbells off (waiters
nap with back-off instead of sleeping until the peer's frame), side by side. The row "tcp
no poll" runs the TCP round trips with both ends blocking at once in the kernel
(REMOTE_ACCEL_TCP_POLL_US=0) instead of polling briefly first, side by side.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

MIB = 1 << 20
KINDS = ("dpdk", "tcp", "tls")
ECHO, ECHO_REPLY, SINK = 64, 65, 66


# -- the far end ---------------------------------------------------------------------
def peer_main(kind: str, busy: bool, size: int, fresh: bool, cert: str = "", doorbell: bool = True) -> int:
    """Serve one client: SINK into a reused buffer (a fresh one each time with --fresh),
    ECHO answered with the same payloads."""
    buf = np.empty(size, np.uint8)

    def sink(header, meta, lengths):
        if header.type == SINK and len(lengths) == 1 and lengths[0] <= size and not fresh:
            return [buf[: lengths[0]]]
        return [np.empty(n, np.uint8) for n in lengths]

    if kind == "tcp":
        from remote_accel.dataplane.tcp import TcpListener

        listener = TcpListener("127.0.0.1", 0)
    elif kind == "tls":
        from remote_accel.dataplane.tls import TlsListener, server_context

        listener = TlsListener("127.0.0.1", 0, tls=server_context(cert, cert + ".key"))
    else:
        from remote_accel.dataplane import dpdk

        listener = dpdk.DpdkListener(options=dpdk.ChannelOptions(busy_poll=busy, doorbell=doorbell))
    print(f"READY {listener.address}", flush=True)
    t = listener.accept(timeout=120)
    try:
        while True:
            msg = t.recv(sink=sink)
            if msg.type == ECHO:
                t.send(ECHO_REPLY, msg.meta, msg.payloads, req_id=msg.req_id)
            elif msg.type != SINK:
                break
    except Exception:  # the client went away: done
        pass
    t.close()
    listener.close()
    return 0


def start_peer(kind: str, busy: bool, size: int, runtime: str, fresh: bool = False, cert: str = "",
               doorbell: bool = True, poll_us: int | None = None) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, REMOTE_ACCEL_RUNTIME_DIR=runtime)
    if poll_us is not None:
        env["REMOTE_ACCEL_TCP_POLL_US"] = str(poll_us)
    cmd = [sys.executable, os.path.abspath(__file__), "--peer", kind, "--size", str(size), "--cert", cert]
    if busy:
        cmd.append("--busy-poll")
    if not doorbell:
        cmd.append("--no-doorbell")
    if fresh:
        cmd.append("--fresh")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        raise RuntimeError(f"{kind} peer did not start: {line!r}")
    return proc, line.split()[1]


# -- measurements ----------------------------------------------------------------------
def bench_memcpy(size: int, count: int) -> dict:
    src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    started = time.perf_counter()
    for _ in range(count):
        np.copyto(dst, src)
    secs = time.perf_counter() - started
    return {"bulk_gbps": size * count / secs / 1e9, "rtt_p50_us": None, "rtt_p99_us": None}


def bench_transport(t, size: int, count: int, rtts: int, small: int, idle_ms: float = 5.0) -> dict:
    data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    t.send(SINK, b"", [data])  # warm up both ends (buffers, page faults)
    t.send(ECHO, b"sync", [])
    t.recv(timeout=120)
    started = time.perf_counter()
    for _ in range(count):
        t.send(SINK, b"", [data])
    t.send(ECHO, b"sync", [])  # answered after every SINK before it was taken
    t.recv(timeout=300)
    secs = time.perf_counter() - started
    payload = [np.zeros(small, np.uint8)]
    for _ in range(min(1000, rtts)):  # warm-up round trips
        t.send(ECHO, b"", payload)
        t.recv(timeout=60)
    samples = np.empty(rtts, np.int64)
    for i in range(rtts):
        t0 = time.perf_counter_ns()
        t.send(ECHO, b"", payload)
        t.recv(timeout=60)
        samples[i] = time.perf_counter_ns() - t0
    idle = np.empty(max(10, min(200, int(1000 / max(idle_ms, 1.0)))), np.int64)
    for i in range(len(idle)):  # after a silence: the wake-up path
        time.sleep(idle_ms / 1e3)
        t0 = time.perf_counter_ns()
        t.send(ECHO, b"", payload)
        t.recv(timeout=60)
        idle[i] = time.perf_counter_ns() - t0
    return {"bulk_gbps": size * count / secs / 1e9 if count else None,
            "rtt_p50_us": float(np.percentile(samples, 50)) / 1e3,
            "rtt_p99_us": float(np.percentile(samples, 99)) / 1e3,
            "idle_rtt_p50_us": float(np.percentile(idle, 50)) / 1e3}


def run_dpdk(args, runtime: str, doorbell: bool = True, count: int | None = None) -> tuple[dict, dict]:
    from remote_accel.dataplane import dpdk

    proc, _ = start_peer("dpdk", args.busy_poll, args.size, runtime, args.fresh, doorbell=doorbell)
    try:
        dpdk.ensure_eal(None, role="local")
        from remote_accel.dataplane.eal_args import MEMIF_BSIZE, memif_rsize

        port = dpdk.add_vdev(f"net_memif_bench{0 if doorbell else 1}", f"role=client,id=0,socket={runtime}/memif.sock,"
                                                f"bsize={MEMIF_BSIZE},rsize={memif_rsize(MEMIF_BSIZE)}")
        options = dpdk.ChannelOptions(busy_poll=args.busy_poll, doorbell=doorbell,
                                      zero_copy_min=(1 << 62) if args.no_zero_copy else (256 << 10))
        t = dpdk.DpdkTransport.connect(port, timeout=60, options=options)
        result = bench_transport(t, args.size, args.count if count is None else count, args.rtts, args.small,
                                 args.idle_ms)
        stats = t.stats()
        t.send(0, b"", [])  # not ECHO or SINK: the peer ends
        t.close()
        dpdk.remove_vdev(port)
    finally:
        proc.wait(30)
    return result, stats


def run_tcp(args, runtime: str, tls: bool = False, poll_us: int | None = None, count: int | None = None) -> dict:
    """TCP loopback; with `tls`, TLS over it with a self-signed certificate (openssl CLI);
    `poll_us`: both ends' poll window (None: the environment's or the default)."""
    from remote_accel.dataplane.tcp import TcpTransport
    from remote_accel.dataplane.tls import TlsTransport, client_context

    cert = ""
    if tls:
        cert = os.path.join(runtime, "bench.crt")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout",
                        cert + ".key", "-out", cert, "-subj", "/CN=localhost", "-addext",
                        "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    proc, address = start_peer("tls" if tls else "tcp", False, args.size, runtime, args.fresh, cert,
                               poll_us=poll_us)
    try:
        _, host, port = address.split(":")
        if tls:
            t = TlsTransport.connect(host, int(port), tls=client_context(cert))
        else:
            t = TcpTransport.connect(host, int(port), poll_us=poll_us)
        result = bench_transport(t, args.size, args.count if count is None else count, args.rtts, args.small,
                                 args.idle_ms)
        stats = t.stats()
        if not tls:
            result["polled_pct"] = 100 * stats["rx_polled"] / max(1, stats["rx_polled"] + stats["rx_slept"])
            result["poll_us"] = t._window.max_ns // 1000
        t.send(0, b"", [])
        t.close()
    finally:
        proc.wait(30)
    return result


# -- what a user sees ------------------------------------------------------------------
def user_main(kind: str, size: int, rounds: int) -> int:
    """In a process of its own (one session per process): a real server on CPU, then
    `rounds` round trips of a `size`-byte tensor, fresh tensors each time; prints JSON."""
    import torch

    import remote_accel
    from remote_accel.pytorch_ext import runtime
    from remote_accel.server.testing import ServerProcess

    from remote_accel.server.testing import local_server_certificate

    pki = tempfile.TemporaryDirectory(prefix="bench-dataplane-tls-")
    tls_server, tls_client = (), {}
    if kind == "tls":  # a certificate made for the run, which the client checks
        tls_server, ca = local_server_certificate(pki.name)
        tls_client = {"tls_ca": ca}
    with pki, ServerProcess("--transport", "tcp,dpdk" if kind == "dpdk" else "tcp", *tls_server) as server:
        host, port = server.tcp
        os.environ.update(server.client_env())  # the server's private memif socket
        remote_accel.init(transport="dpdk" if kind == "dpdk" else "tcp", server=f"{host}:{port}", token=server.token,
                          **tls_client)
        x = torch.randint(0, 1 << 30, (size // 4,), dtype=torch.int32, generator=torch.Generator().manual_seed(3))
        assert torch.equal(x.to("remote_accel").cpu(), x), "the tensor came back different"
        # the memcpy this row is compared with: the same bytes into warm memory, timed
        # right before each round trip, so that both see the same load on a shared machine
        src = x.numpy().view(np.uint8)
        dst = np.empty_like(src)
        np.copyto(dst, src)
        times, copies = [], []
        for _ in range(rounds):
            started = time.perf_counter()
            np.copyto(dst, src)
            copies.append(time.perf_counter() - started)
            started = time.perf_counter()
            y = x.to("remote_accel")
            z = y.cpu()
            times.append(time.perf_counter() - started)
            del y, z  # as a loop's batches: the next round trip gets fresh tensors
        stats = runtime.sessions()[0].transport.stats() if kind == "dpdk" else None
        remote_accel.shutdown()
    # median: a 2-core VM shared with other work has stray stalls
    print(json.dumps({"bulk_gbps": 2 * size / float(np.median(times)) / 1e9, "rtt_p50_us": None,
                      "rtt_p99_us": None, "memcpy_gbps": size / float(np.median(copies)) / 1e9,
                      "stats": stats}), flush=True)
    return 0


#: the size sweep: one tensor of each of these sizes up to half of --sweep-mib; then
#: --sweep-mib as tensors of each of these sizes below it; then a model of 30
#: Linear(MODEL_WIDTH, MODEL_WIDTH) layers (504 MB) per 512 MiB of --sweep-mib, at least one
SWEEP_SINGLE = (64 << 10, MIB, 16 * MIB, 256 * MIB)
SWEEP_MANY = (64 * MIB, 16 * MIB, 4 * MIB, MIB)
MODEL_WIDTH = 2048


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= MIB else f"{nbytes >> 10} KiB"


def sweep_layouts(total_mib: int) -> list:
    """(label, tensor bytes, how many) of a sweep over `total_mib` MiB."""
    total = total_mib * MIB
    out = [(_size(n), n, 1) for n in SWEEP_SINGLE if n <= total // 2]
    out += [(f"{_size(total)} as {total // n} x {_size(n)}", n, total // n) for n in SWEEP_MANY if n < total]
    return out


def sweep_main(kind: str, total_mib: int) -> int:
    """In a process of its own: a real server on CPU, then each SWEEP layout up
    (`.to("remote_accel")` of fresh client tensors, until the server has them) and down
    (`.cpu()`), twice: round 1 is the first use of that much memory on both sides (fresh
    pages), round 2 reuses what round 1 freed. Then a model's first `.to()` and its
    `.cpu()`. Every download is checked against what went up. Prints JSON."""
    import torch
    import torch.nn as nn

    import remote_accel
    from remote_accel.server.testing import ServerProcess

    out = {}
    with ServerProcess("--transport", "tcp" if kind == "tcp" else "tcp,dpdk") as server:
        host, port = server.tcp
        os.environ.update(server.client_env())
        remote_accel.init(transport=kind, server=f"{host}:{port}", token=server.token)
        gen = torch.Generator().manual_seed(3)
        layers = max(1, total_mib * 30 // 512)
        model = nn.Sequential(*(nn.Linear(MODEL_WIDTH, MODEL_WIDTH) for _ in range(layers)))
        for label, nbytes, count in sweep_layouts(total_mib):
            for rnd in (1, 2):
                xs = [torch.randint(0, 1 << 30, (nbytes // 4,), dtype=torch.int32, generator=gen)
                      for _ in range(count)]
                started = time.perf_counter()
                ys = [x.to("remote_accel") for x in xs]
                torch.remote_accel.synchronize()
                up = time.perf_counter() - started
                started = time.perf_counter()
                zs = [y.cpu() for y in ys]
                down = time.perf_counter() - started
                if not all(torch.equal(x, z) for x, z in zip(xs, zs)):
                    raise SystemExit(f"{kind} {label}: a tensor came back different")
                total = nbytes * count
                out[f"{label} round {rnd}"] = {"up_gbps": total / up / 1e9, "down_gbps": total / down / 1e9}
                del xs, ys, zs
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        weight = model[0].weight.detach().clone()
        started = time.perf_counter()
        model.to("remote_accel")
        torch.remote_accel.synchronize()
        up = time.perf_counter() - started
        started = time.perf_counter()
        model.to("cpu")
        down = time.perf_counter() - started
        if not torch.equal(model[0].weight, weight):
            raise SystemExit(f"{kind}: the model's weights came back different")
        out[f"model .to(), {total / 1e6:.0f} MB"] = {"up_gbps": total / up / 1e9, "down_gbps": total / down / 1e9}
        remote_accel.shutdown()
    print(json.dumps(out), flush=True)
    return 0


def _rate(gbps: float) -> str:
    """Two decimals, or three significant digits below 0.1 GB/s: a first transfer on a
    loaded host can take milliseconds, and it must not print as 0.00."""
    if gbps <= 0 or gbps >= 0.1:
        return f"{gbps:.2f}"
    return f"{gbps:.{2 - math.floor(math.log10(gbps))}f}"


def sweep_table(results: dict) -> str:
    """results: transport -> sweep_main's rows."""
    kinds = list(results)
    head = f"{'user sweep, GB/s one way':34}" + "".join(f" {k + ' up':>10} {k + ' down':>10}" for k in kinds)
    lines = [head]
    for label in next(iter(results.values())):
        lines.append(f"{label:34}" + "".join(f" {_rate(results[k][label]['up_gbps']):>10} "
                                             f"{_rate(results[k][label]['down_gbps']):>10}" for k in kinds))
    lines.append("(up: .to('remote_accel') of fresh client tensors until the server holds them; down: .cpu(); "
                 "round 1: memory first used on both sides, round 2: what round 1 freed; each checked)")
    return "\n".join(lines)


def run_sweep(kind: str, total_mib: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--sweep-peer", kind, "--sweep-mib", str(total_mib)]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=1800)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"sweep {kind} failed (rc {out.returncode}): {out.stdout[-2000:]}")
    return json.loads(lines[-1])


def run_user(kind: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--user-peer", kind, "--user-size", str(args.user_size),
           "--user-rounds", str(args.user_rounds)]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=900)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"user-level {kind} run failed (rc {out.returncode}): {out.stdout[-2000:]}")
    return json.loads(lines[-1])


def table(rows: dict, small: int, user_size: int = 0, idle_ms: float = 5.0) -> str:
    memcpy, tcp = rows["memcpy"]["bulk_gbps"], rows.get("tcp loopback", rows["memcpy"])["bulk_gbps"]
    user_tcp = rows.get("user tcp", {}).get("bulk_gbps")
    out = [f"{'':16} {'bulk GB/s':>10} {'x TCP':>7} {'% memcpy':>9} {'RTT p50 us':>11} {'RTT p99 us':>11} "
           f"{'idle RTT p50':>13}"]

    def us(r, key):
        return f"{r[key]:.1f}" if r.get(key) is not None else "-"

    for name, r in rows.items():
        base = user_tcp if name.startswith("user") and user_tcp else tcp
        limit = r.get("memcpy_gbps") or memcpy
        bulk = (f"{r['bulk_gbps']:10.2f} {r['bulk_gbps'] / base:7.2f} {100 * r['bulk_gbps'] / limit:8.0f}%"
                if r["bulk_gbps"] is not None else f"{'-':>10} {'-':>7} {'-':>9}")
        out.append(f"{name:16} {bulk} {us(r, 'rtt_p50_us'):>11} {us(r, 'rtt_p99_us'):>11} "
                   f"{us(r, 'idle_rtt_p50_us'):>13}")
    out.append(f"(bulk: messages of the given size, one way; RTT: {small}-byte payload, ECHO and reply, "
               f"back to back; idle RTT: each after {idle_ms:g} ms of silence)")
    if "tcp no poll" in rows:
        out.append(f"(tcp loopback: both ends poll up to {rows['tcp loopback']['poll_us']} us before they block, "
                   f"{rows['tcp loopback']['polled_pct']:.0f}% of the client's waits ended while polling; "
                   "tcp no poll: both block at once, REMOTE_ACCEL_TCP_POLL_US=0)")
    if user_size:
        out.append(f"(user: {user_size >> 20} MiB tensor, x.to('remote_accel').cpu() into fresh tensors, "
                   "bytes both ways per second, median round trip; x TCP against user tcp; % memcpy against "
                   "a warm memcpy of the tensor timed before each round trip, median: "
                   + ", ".join(f"{n} {r['memcpy_gbps']:.2f} GB/s" for n, r in rows.items() if r.get("memcpy_gbps"))
                   + ")")
    return "\n".join(out)


def _idle_ms(text: str) -> float:
    try:
        ms = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of milliseconds") from None
    if not 0.1 <= ms <= 1000:
        raise argparse.ArgumentTypeError(f"{text} ms is outside 0.1..1000")
    return ms


def _kinds(text: str) -> tuple:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    if not kinds or any(k not in KINDS for k in kinds):
        raise argparse.ArgumentTypeError(f"{text!r}: expected some of {','.join(KINDS)}")
    return kinds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=64 * MIB, help="bulk message bytes (default 64 MiB)")
    p.add_argument("--count", type=int, default=32, help="bulk messages per transport (default 32)")
    p.add_argument("--rtts", type=int, default=20000, help="round trips measured (default 20000)")
    p.add_argument("--small", type=int, default=64, help="round-trip payload bytes (default 64)")
    p.add_argument("--busy-poll", action="store_true", help="DPDK ends never nap (burns both cores)")
    p.add_argument("--idle-ms", type=_idle_ms, default=5.0,
                   help="silence before each idle round trip, ms (default 5; 0.1..1000)")
    p.add_argument("--no-doorbell", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-zero-copy", action="store_true", help="DPDK sends copy payloads into mbufs")
    p.add_argument("--fresh", action="store_true",
                   help="the receiver takes each bulk message into a new buffer (page faults count)")
    p.add_argument("--only", type=_kinds, default=KINDS, metavar="dpdk,tcp,tls",
                   help="which transports to measure (default: all three; memcpy always)")
    p.add_argument("--user-size", type=int, default=256 * MIB,
                   help="user-level round trip tensor bytes (default 256 MiB; 0: skip)")
    p.add_argument("--user-rounds", type=int, default=10, help="user-level round trips (default 10)")
    p.add_argument("--sweep", action="store_true",
                   help="also tensors of 64 KiB to 256 MiB, 512 MiB as many tensors and a 504 MB model's .to(), "
                        "up and down apart, through a real server (memif and TCP as --only has them)")
    p.add_argument("--sweep-mib", type=int, default=512,
                   help="the sweep's many-tensor total and model size, MiB; single tensors up to half (default 512)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--user-peer", choices=("tcp", "dpdk", "tls"), help=argparse.SUPPRESS)
    p.add_argument("--sweep-peer", choices=("tcp", "dpdk"), help=argparse.SUPPRESS)
    p.add_argument("--peer", choices=("tcp", "tls", "dpdk"), help=argparse.SUPPRESS)
    p.add_argument("--cert", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peer:
        return peer_main(args.peer, args.busy_poll, args.size, args.fresh, args.cert, not args.no_doorbell)
    if args.user_peer:
        return user_main(args.user_peer, args.user_size, args.user_rounds)
    if args.sweep_peer:
        return sweep_main(args.sweep_peer, args.sweep_mib)
    rows = {"memcpy": bench_memcpy(args.size, max(4, args.count // 2))}
    dpdk_stats = None
    with tempfile.TemporaryDirectory(prefix="ra-bench-") as runtime:
        if "dpdk" in args.only:
            rows["dpdk memif"], dpdk_stats = run_dpdk(args, runtime)
            if not args.busy_poll:  # the same round trips without doorbells (bulk not repeated)
                rows["dpdk memif naps"], _ = run_dpdk(args, runtime, doorbell=False, count=0)
        if "tcp" in args.only:
            rows["tcp loopback"] = run_tcp(args, runtime)
            rows["tcp no poll"] = run_tcp(args, runtime, poll_us=0, count=0)  # RTT only, side by side
        if "tls" in args.only:
            rows["tls loopback"] = run_tcp(args, runtime, tls=True)
    user_stats = None
    if args.user_size > 0:
        if "dpdk" in args.only:
            rows["user memif"] = run_user("dpdk", args)
            user_stats = rows["user memif"].pop("stats")
        if "tcp" in args.only:
            rows["user tcp"] = run_user("tcp", args)
            rows["user tcp"].pop("stats")
        if "tls" in args.only:
            rows["user tls"] = run_user("tls", args)
            rows["user tls"].pop("stats")
    sweep = {}
    if args.sweep:
        sweep = {name: run_sweep(kind, args.sweep_mib) for kind, name in (("dpdk", "memif"), ("tcp", "tcp")) if kind in args.only}
    if args.json:
        print(json.dumps({"rows": rows, "dpdk_stats": dpdk_stats, "user_dpdk_stats": user_stats, "sweep": sweep,
                          "args": vars(args)}, indent=2))
    else:
        print(table(rows, args.small, args.user_size, args.idle_ms))
        if sweep:
            print(sweep_table(sweep))
        if dpdk_stats:
            print(f"dpdk: {dpdk_stats['tx_frames']} frames, {dpdk_stats['tx_zero_copy_frames']} zero-copy, "
                  f"{dpdk_stats['tx_retransmits']} retransmitted; busy poll: {args.busy_poll}; "
                  f"receiver buffers: {'fresh' if args.fresh else 'reused'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
