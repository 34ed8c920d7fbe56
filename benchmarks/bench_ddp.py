"""torch.distributed on remote_accel: DDP and FSDP2 step time at 1, 2 and 4 ranks (each
rank on a server of its own, on this host), scaling against one rank, client bytes per
step, and all_reduce bus bandwidth by size as nccl-tests reports it, against a direct
copy between the same servers; then a stated model for 8 GPU servers.

    python benchmarks/bench_ddp.py [--ranks 1,2,4] [--models ddp,fsdp2] [--steps 10]
                                   [--batch 32] [--width 512] [--depth 2] [--sizes 4K-256M]
                                   [--server-threads N] [--tls | --dpdk] [--json]

Each run is a real `torchrun --standalone --nproc_per_node N` job of this script's
worker, whose ranks never import remote_accel: each sees its own server through
REMOTE_ACCEL_SERVER (with --tls a server speaking TLS only, with a CA made for the run;
with --dpdk a `--transport tcp,dpdk` server that the rank reaches over memif), as a
torchrun user's script does. The worker trains an MLP (--depth blocks of Linear(width,
4 width), ReLU, Linear(4 width, width)) with AdamW, data parallel over the ranks with a
fixed per-rank batch (weak scaling: efficiency(N) = step(1) / step(N)); DDP's steps again
inside `no_sync()` (no reduction) say what the collectives add to a step, to compare
with one all_reduce of the gradients' bytes below (how much of it the step hid). A step uploads
its batch from the rank's host and reads the loss back (`.item()`): those bytes, and
the messages that queue the work, are all that should cross a client; the gradients
go server to server.

Bus bandwidth (nccl-tests' definitions): algbw = bytes / time of one all_reduce,
busbw = algbw * 2 (N - 1) / N, the rate each link carries in a ring. Timed over enough
back-to-back all_reduces to take ~0.3 s, after one warm-up, ended by one synchronize.
Beside it: a direct copy of the same bytes from server 0 to server 1 (`t.to(
"remote_accel:1")`, one client holding both), the rate of one server-to-server stream.

On a 2-core host N servers and N ranks share two cores: 4 ranks measure the overhead of
the protocol more than the scaling a GPU cluster would see. The model for GPU servers:
    step(N) = compute + 2 (N - 1) / N * grad_bytes / busbw(N)
    busbw   = efficiency * NCCL_RING_BUSBW_GBPS   (efficiency: busbw / direct copy here)
with compute the step's FLOPs at --gpu-tflops, NCCL's ring busbw on a 100 Gb/s network
as the anchor, and no overlap of the all-reduce with the backward (a server runs a
rank's collectives in order with its ops); for this MLP and for GPT-2 small (124M
parameters, 8 x 1024 tokens per rank, bf16 gradients), a step a GPU cluster runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MIB = 1 << 20
#: NCCL's all_reduce ring busbw over one 100 Gb/s NIC per server (nccl-tests on 8 nodes
#: of 8 GPUs, RoCE or InfiniBand HDR-100: 11-12 GB/s, ~93% of the link's 12.5 GB/s)
NCCL_RING_BUSBW_GBPS = 11.6
#: GPT-2 small's parameters, the model's second, GPU-sized workload
GPT2_PARAMS = 124_439_808
SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


# -- the worker: one rank of a torchrun job ----------------------------------------------------------
def worker(args) -> None:
    settings = json.loads(os.environ["BENCH_DDP_RANKS"])[int(os.environ["LOCAL_RANK"])]
    os.environ.update(settings)  # this rank's own server, before torch (autoload) reads them
    import torch
    import torch.distributed as dist

    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("remote_accel", 0)
    if args.worker == "bandwidth":
        rows = []
        for size in args.size_list:
            t = torch.ones(size // 4, device=dev)
            dist.all_reduce(t)
            torch.remote_accel.synchronize()
            iterations = 1
            while True:
                start = time.perf_counter()
                for _ in range(iterations):
                    dist.all_reduce(t)
                torch.remote_accel.synchronize()
                elapsed = time.perf_counter() - start
                if elapsed > 0.3 or iterations >= 64:
                    break
                iterations *= 4
            seconds = elapsed / iterations
            rows.append({"bytes": size, "us": seconds * 1e6, "algbw": size / seconds / 1e9,
                         "busbw": size / seconds / 1e9 * 2 * (world - 1) / world})
            del t
        if rank == 0:
            print(json.dumps({"bandwidth": rows}), flush=True)
        dist.destroy_process_group()
        return
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(args.width, 4 * args.width), nn.ReLU(),
                                          nn.Linear(4 * args.width, args.width)) for _ in range(args.depth)]).to(dev)
    if args.worker == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model:
            fully_shard(block)
        fully_shard(model)
        trained = model
    else:
        trained = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-3)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def steps(n: int) -> list:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
            loss = nn.functional.mse_loss(trained(x.to(dev)), y.to(dev))
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss.item()
            times.append(time.perf_counter() - start)
        return times

    steps(2)  # warm-up: plans, buckets, the group's connections
    stats = torch.remote_accel.stats()
    times = steps(args.steps)
    after = torch.remote_accel.stats()
    row = {"step_ms": statistics.median(times) * 1e3, "grad_bytes": grad_bytes,
           "client_wire_bytes": (after["bytes_sent"] + after["bytes_received"] - stats["bytes_sent"]
                                 - stats["bytes_received"]) / args.steps,
           "client_tensor_bytes": (after["bytes_up"] + after["bytes_down"] - stats["bytes_up"]
                                   - stats["bytes_down"]) / args.steps}
    if args.worker == "ddp":  # the same steps with no reduction: what the collectives add to a step
        with trained.no_sync():
            row["local_step_ms"] = statistics.median(steps(args.steps)) * 1e3
    gathered = [None] * world
    dist.all_gather_object(gathered, row)
    if rank == 0:
        print(json.dumps({"train": gathered}), flush=True)
    dist.destroy_process_group()


def direct_copies(args) -> None:
    """One client holding servers 0 and 1: each size copied straight from one to the other."""
    settings = json.loads(os.environ["BENCH_DDP_RANKS"])
    import torch

    import remote_accel

    remote_accel.init(servers=[s["REMOTE_ACCEL_SERVER"] for s in settings[:2]],
                      tokens=[s["REMOTE_ACCEL_TOKEN"] for s in settings[:2]], transport="tcp",
                      tls_ca=settings[0].get("REMOTE_ACCEL_TLS_CA"))
    rows = []
    for size in args.size_list:
        t = torch.ones(size // 4, device="remote_accel:0")
        t.to("remote_accel:1")
        torch.remote_accel.synchronize(1)
        iterations = 1
        while True:
            start = time.perf_counter()
            for _ in range(iterations):
                u = t.to("remote_accel:1")
            torch.remote_accel.synchronize(1)
            elapsed = time.perf_counter() - start
            if elapsed > 0.3 or iterations >= 64:
                break
            iterations *= 4
        del u
        rows.append({"bytes": size, "copy_gbps": size / (elapsed / iterations) / 1e9})
    print(json.dumps({"copies": rows}), flush=True)


# -- the parent: servers, jobs, tables --------------------------------------------------------------------
def run_job(args, servers, settings, mode: str) -> dict:
    env = dict(os.environ, BENCH_DDP_RANKS=json.dumps(settings))
    for name in ("REMOTE_ACCEL_SERVER", "REMOTE_ACCEL_TOKEN", "REMOTE_ACCEL_TRANSPORT"):
        env.pop(name, None)
    job = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                          str(len(servers)), __file__, "--worker", mode, *_passed_on(args)], env=env,
                         capture_output=True, text=True, timeout=1800)
    lines = [line for line in job.stdout.splitlines() if line.startswith("{")]
    if job.returncode != 0 or not lines:
        raise SystemExit(f"the {mode} job at {len(servers)} ranks failed (rc {job.returncode}):\n"
                         f"{job.stderr[-4000:]}")
    return json.loads(lines[-1])


def _passed_on(args) -> list:
    return ["--steps", str(args.steps), "--batch", str(args.batch), "--width", str(args.width), "--depth",
            str(args.depth), "--sizes", args.sizes]


def start_servers(args, n: int, folder: str):
    from remote_accel.server.testing import ServerProcess, local_server_certificate
    from timing import server_thread_options

    options = list(server_thread_options(args.server_threads))
    ca = None
    if args.tls:
        tls, ca = local_server_certificate(folder)
        options += tls
    if args.dpdk:
        options += ["--transport", "tcp,dpdk"]
    servers = [ServerProcess(*options, token=f"bench-ddp-{i}").start() for i in range(n)]
    settings = []
    for s in servers:
        address = next(a.split(":", 1)[1] for a in s.addresses if a.startswith(("tcp:", "tls:")))
        rank = {"REMOTE_ACCEL_SERVER": address, "REMOTE_ACCEL_TOKEN": s.token}
        if ca:
            rank["REMOTE_ACCEL_TLS_CA"] = ca
        if args.dpdk:
            rank.update(REMOTE_ACCEL_TRANSPORT="dpdk", **s.client_env())
        settings.append(rank)
    return servers, settings


def parse_sizes(text: str) -> list:
    def one(word: str) -> int:
        word = word.strip().upper().removesuffix("B").removesuffix("I")
        return int(word[:-1]) * SIZE_UNITS[word[-1]] if word[-1] in SIZE_UNITS else int(word)

    if "-" in text and "," not in text:
        low, high = map(one, text.split("-"))
        sizes = [low]
        while sizes[-1] * 4 <= high:
            sizes.append(sizes[-1] * 4)
        return sizes
    return [one(w) for w in text.split(",")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="1,2,4", help="rank counts, each rank with a server (default 1,2,4)")
    parser.add_argument("--models", default="ddp,fsdp2", help="ddp, fsdp2 or both (default)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps after two warm-up steps (default 10)")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step (default 32)")
    parser.add_argument("--width", type=int, default=512, help="the MLP's width (default 512)")
    parser.add_argument("--depth", type=int, default=2, help="the MLP's blocks (default 2)")
    parser.add_argument("--sizes", default="4K-256M", help="all_reduce sizes: LOW-HIGH (by 4x) or a list (default 4K-256M)")
    parser.add_argument("--gpu-tflops", type=float, default=400.0, help="the model's GPU (default 400, bf16 H100)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    link = parser.add_mutually_exclusive_group()
    link.add_argument("--tls", action="store_true", help="servers that speak TLS only (and TLS between them)")
    link.add_argument("--dpdk", action="store_true", help="each rank reaches its server over memif")
    parser.add_argument("--worker", choices=("ddp", "fsdp2", "bandwidth", "copies"), help=argparse.SUPPRESS)
    from timing import add_server_threads_option

    add_server_threads_option(parser)
    args = parser.parse_args(argv)
    args.size_list = parse_sizes(args.sizes)
    if args.worker == "copies":
        direct_copies(args)
        return 0
    if args.worker:
        worker(args)
        return 0
    ranks = sorted({int(n) for n in args.ranks.split(",")})
    models = [m for m in args.models.split(",") if m]
    if not set(models) <= {"ddp", "fsdp2"} or not ranks or ranks[0] < 1:
        parser.error("--models takes ddp and fsdp2; --ranks positive counts")
    out = {"date": time.strftime("%Y-%m-%d"), "link": "tls" if args.tls else "dpdk" if args.dpdk else "tcp",
           "train": {}, "bandwidth": {}, "copies": []}
    with tempfile.TemporaryDirectory(prefix="bench-ddp-") as folder:
        for n in ranks:
            servers, settings = start_servers(args, n, folder)
            try:
                for model in models:
                    out["train"][f"{model} {n}"] = run_job(args, servers, settings, model)["train"]
                if n > 1:
                    out["bandwidth"][n] = run_job(args, servers, settings, "bandwidth")["bandwidth"]
                    if not out["copies"]:
                        env = dict(os.environ, BENCH_DDP_RANKS=json.dumps(settings))
                        from timing import json_child

                        out["copies"] = json_child(__file__, ["--worker", "copies", "--sizes", args.sizes], env=env,
                                                   what="direct copy")["copies"]
            finally:
                for s in servers:
                    s.stop()
    if args.json:
        print(json.dumps(out))
    else:
        print_tables(args, out, ranks, models)
    return 0


def print_tables(args, out: dict, ranks: list, models: list) -> None:
    print(f"bench_ddp {out['date']}, link {out['link']}, MLP width {args.width} depth {args.depth}, "
          f"batch {args.batch} per rank, {args.steps} steps")
    print(f"{'model':<7}{'ranks':>6}{'step ms':>10}{'no_sync ms':>12}{'efficiency':>12}{'client B/step':>15}"
          f"{'tensor B/step':>15}{'grad bytes':>12}")
    for model in models:
        one = None
        for n in ranks:
            rows = out["train"].get(f"{model} {n}")
            if not rows:
                continue
            step = max(r["step_ms"] for r in rows)  # the slowest rank sets the pace
            one = one or (step if n == ranks[0] == 1 else None)
            efficiency = f"{one / step:.2f}" if one else "-"
            local = max(r.get("local_step_ms", float("nan")) for r in rows)
            print(f"{model:<7}{n:>6}{step:>10.2f}{local:>12.2f}{efficiency:>12}{rows[0]['client_wire_bytes']:>15.0f}"
                  f"{rows[0]['client_tensor_bytes']:>15.0f}{rows[0]['grad_bytes']:>12}")
    copies = {c["bytes"]: c["copy_gbps"] for c in out["copies"]}
    for n, rows in out["bandwidth"].items():
        print(f"\nall_reduce over {n} ranks (nccl-tests' algbw and busbw, GB/s) against a direct copy server 0 -> 1")
        print(f"{'bytes':>12}{'time us':>12}{'algbw':>9}{'busbw':>9}{'copy':>9}{'busbw/copy':>12}")
        for r in rows:
            copy = copies.get(r["bytes"])
            ratio = f"{r['busbw'] / copy:.2f}" if copy else "-"
            print(f"{r['bytes']:>12}{r['us']:>12.1f}{r['algbw']:>9.3f}{r['busbw']:>9.3f}"
                  f"{(copy or 0):>9.3f}{ratio:>12}")
    largest = max(out["bandwidth"]) if out["bandwidth"] else None
    if largest is None:
        return
    big = out["bandwidth"][largest][-1]
    efficiency = big["busbw"] / copies[big["bytes"]] if copies.get(big["bytes"]) else 1.0
    busbw = efficiency * NCCL_RING_BUSBW_GBPS
    grads = out["train"][f"{models[0]} {ranks[0]}"][0]["grad_bytes"]
    print(f"\nmodel for 8 GPU servers on 100 Gb/s (NCCL ring busbw {NCCL_RING_BUSBW_GBPS} GB/s as the anchor, "
          f"raccl's busbw/copy here {efficiency:.2f} at {big['bytes']} B: {busbw:.1f} GB/s; no overlap of the "
          f"all_reduce with the backward), at {args.gpu_tflops:g} TFLOPS:")
    # this MLP: 6 FLOPs per parameter per sample (forward and backward of a dense model)
    model_rows(f"this MLP, batch {args.batch} per rank", 6 * grads / 4 * args.batch, grads, busbw, args.gpu_tflops)
    # a model a GPU cluster trains: GPT-2 small (124M parameters), 8 x 1024 tokens per rank, bf16 gradients
    model_rows("GPT-2 124M, 8 x 1024 tokens per rank, bf16 gradients", 6 * GPT2_PARAMS * 8 * 1024,
               GPT2_PARAMS * 2, busbw, args.gpu_tflops)


def model_rows(name: str, flops: float, grad_bytes: float, busbw_gbps: float, tflops: float) -> None:
    """step(N) = compute + ring all_reduce of the gradients at busbw, for 1, 2, 4 and 8 servers."""
    compute_ms = flops / (tflops * 1e12) * 1e3
    print(f"  {name}: compute {compute_ms:.3f} ms a step")
    for n in (1, 2, 4, 8):
        comm_ms = 2 * (n - 1) / n * grad_bytes / (busbw_gbps * 1e9) * 1e3
        print(f"  {n} servers: step {compute_ms + comm_ms:.3f} ms (all_reduce {comm_ms:.3f} ms), efficiency "
              f"{compute_ms / (compute_ms + comm_ms):.2f}")

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # timing, the benchmarks' helpers
    sys.exit(main())
