"""Cost of the remote_accel device against local CPU, measured side by side in one run.

    python benchmarks/bench_device.py [--transport tcp|dpdk|tls|both] [--steps N] [--server-threads N]
                                      [--chain-ops N] [--idle-matmuls N]

Starts a server (on CPU, or on $REMOTE_ACCEL_TEST_DEVICE) per transport (each in a
process of its own with `both`, the default: TCP and DPDK; `tls`: TCP with TLS, a
certificate made for the run by the openssl CLI) and reports: the tiny-op chain (40,000
in-place ops `x.mul_(1.0001).add_(-0.0001)` on 16 floats, then `.item()`) in ops per
second remote and local, and the same for 40,000 out-of-place ops `y = x + 1.0` (each
allocates its result and frees the last), every remote run checked end to end (the server
ran all its ops before the clock stopped, the result equals the local one); the server's cost per op beyond the kernel (the server's time
running the chain's requests, per op, less the same ops called locally from C++, i.e.
dispatcher and kernel; needs a server that counts its busy time); the tiny Transformer step
(2 encoder layers, d_model 64, 4 heads, ff 128, batch 8x32, AdamW) remote/local; and
client cost per queued op, round trips per step, remote/local for a small MLP (its
compiled step timed once the server has compiled the graphs, beside local Inductor; and its
step uploading a fresh batch each time, as a data loader's loop does); the sync
points of issue #20 (sync_points.py: synchronize() with nothing queued, x.sum().item(),
(x + 1).sum().item(), s.item() of a computed scalar, x.cpu() of 16 floats); a tiny GPT-2's
greedy generate() remote / CPU (skipped, saying so, without the transformers package); and
what a connected, idle client costs the user's own CPU work (2000 local 256x256
matmul+tanh in the same process, connected against before init()).

The local baselines run first, in a process of their own with no server alive, on
torch's default threads (with --server-threads N: on N threads, one core each when N is
1), as a user's plain script runs; the header says how. Every remote loss (eager MLP,
compiled MLP, MLP uploading its batches, Transformer) is checked against the local one,
and a mismatch fails the run. The Transformer has no dropout, so that its loss can be checked, and so that the
server's own CPU bernoulli_ kernel stays in bench_cpu_bernoulli.py's row, not here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

import torch
import torch.nn as nn

import remote_accel
from remote_accel.pytorch_ext import runtime
from remote_accel.server.testing import ServerProcess, local_server_certificate
from timing import (  # noqa: E402  (this folder, beside the script)
    add_server_threads_option, median_seconds, server_thread_options, wait_for_compiles)

import sync_points
from training import training_step  # noqa: E402


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def _step_fn(model, device):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(1)  # the same batch in every process
    x = torch.randn(32, 64, generator=data).to(device)
    y = torch.randint(0, 10, (32,), generator=data).to(device)
    return training_step(model, opt, x, y)


def _fresh_batch_step_fn(device):
    """The MLP step as a data loader's loop has it: every step uploads its own batch
    (`x.to(device)`, 8 KiB, and its labels) before the forward; eight batches in turn."""
    model = _mlp().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(2)
    batches = [(torch.randn(32, 64, generator=data), torch.randint(0, 10, (32,), generator=data)) for _ in range(8)]
    turn = iter(range(1 << 62))

    def step() -> float:
        x, y = batches[next(turn) % len(batches)]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        return loss.item()

    return step


def _timed_loss(step, steps: int, warmup: int = 2) -> tuple[float, float]:
    """(median seconds per step, the loss of one more step): local and remote take the
    same number of steps, warm-up included, so that their losses can be compared."""
    return median_seconds(step, steps, warmup), step()


CHAIN_OPS = 40_000


def _chain_start(device) -> torch.Tensor:
    # not all ones: 1.0 is a fixed point of the chain in float32, which would make the
    # check against the local result blind to dropped ops
    return torch.linspace(1.0, 2.0, 16).to(device)


def _chain(device) -> tuple[float, torch.Tensor]:
    """Seconds for the tiny-op chain, the final .item() included; and the result, which
    the caller checks against the local one."""
    x = _chain_start(device)
    x.mul_(1.0001).add_(-0.0001).sum().item()
    start = time.perf_counter()
    for _ in range(CHAIN_OPS // 2):
        x.mul_(1.0001).add_(-0.0001)
    x.sum().item()
    return time.perf_counter() - start, x


def _out_of_place_chain(device) -> tuple[float, torch.Tensor]:
    """Seconds for CHAIN_OPS out-of-place tiny ops `y = x + 1.0` (each allocates a result
    and frees the one before), the final .item() included; and the last result."""
    x = _chain_start(device)
    y = x + 1.0
    y.sum().item()
    start = time.perf_counter()
    for _ in range(CHAIN_OPS):
        y = x + 1.0
    y.sum().item()
    return time.perf_counter() - start, y


def _timed_remote(chain, session, expected: torch.Tensor) -> tuple[float, float]:
    """(seconds, server busy seconds per op) of one remote run of `chain`, checked end to
    end: the server ran every op before the clock stopped (the .item() reply comes after
    them), and the result read back equals the local one bit for bit."""
    before = session.stats()
    seconds, result = chain("remote_accel")
    after = session.stats()
    ops = after["ops_done"] - before["ops_done"]
    if ops < CHAIN_OPS:
        raise SystemExit(f"{chain.__name__}: the server ran {ops} ops, the chain has {CHAIN_OPS}")
    if not torch.equal(result.cpu(), expected):
        raise SystemExit(f"{chain.__name__}: the remote result differs from the local one")
    # servers before the C++ executor do not count their busy time
    busy = after.get("busy_ns", float("nan")) - before.get("busy_ns", float("nan"))
    return seconds, busy * 1e-9 / ops


@torch.jit.script
def _chain_in_cpp(x: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x.mul_(1.0001).add_(-0.0001)
    return x


def _kernel() -> float:
    """Seconds per op of the chain's ops called from C++ (TorchScript's interpreter): the
    dispatcher and the kernel, what the server cannot avoid, without Python's own cost."""
    x = torch.ones(16)
    _chain_in_cpp(x, 100)
    start = time.perf_counter()
    _chain_in_cpp(x, CHAIN_OPS // 2)
    return (time.perf_counter() - start) / CHAIN_OPS


def _transformer_step_fn(device):
    # no dropout: the loss is checked against local, and the server's own CPU bernoulli_
    # kernel (bench_cpu_bernoulli.py) stays out of this row
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 32, 64).to(device)

    def step():
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss.item()

    return step


def measure(transport_name: str, steps: int, sync_only: bool = False, server_threads: int = 0) -> dict:
    # the server always serves TCP too: its address is how the fixture knows it is up
    transport = "tcp,dpdk" if transport_name == "dpdk" else "tcp"
    threads = server_thread_options(server_threads)
    tls_dir = tempfile.TemporaryDirectory(prefix="bench-device-tls-")
    tls_server, tls_client = (), {}
    if transport_name == "tls":
        tls_server, ca = local_server_certificate(tls_dir.name)
        tls_client = {"tls_ca": ca}
    with tls_dir, ServerProcess("--transport", transport, *threads, *tls_server) as server:
        host, port = server.tcp
        os.environ.update(server.client_env())  # the server's private memif socket
        unconnected = sync_points.idle_matmuls()
        remote_accel.init(transport="dpdk" if transport_name == "dpdk" else "tcp", server=f"{host}:{port}",
                          token=server.token, **tls_client)
        time.sleep(0.5)  # idle: the poll threads back off as they would between a user's steps
        connected = sync_points.idle_matmuls()
        idle_cpu = sync_points.idle_cpu()
        syncs = sync_points.sync_latencies()
        generate = sync_points.generate_ratio()
        if sync_only:
            remote_accel.shutdown()
            return {"transport": transport_name, "idle_connected_s": connected, "idle_unconnected_s": unconnected,
                    "idle_cpu": idle_cpu, **syncs, **generate}
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

        remote_step = _step_fn(_mlp().to("remote_accel"), "remote_accel")
        before = session.counters["round_trips"]
        remote, remote_loss = _timed_loss(remote_step, steps)
        trips = (session.counters["round_trips"] - before) / (steps + 3)
        fresh, fresh_loss = _timed_loss(_fresh_batch_step_fn("remote_accel"), steps)
        compiled_model = torch.compile(_mlp().to("remote_accel"), backend="remote_accel")
        compiled_step = _step_fn(compiled_model, "remote_accel")
        compiled_step()  # sends the graphs: time the steps once the server runs them compiled,
        wait_for_compiles(session)  # not while its compiler thread takes a core
        compiled, compiled_loss = _timed_loss(compiled_step, steps, warmup=1)  # one step already taken

        # the chains' results, computed here (untimed) to check the remote ones against
        runs = [_timed_remote(_chain, session, _chain("cpu")[1]) for _ in range(3)]
        chain_remote = statistics.median(t for t, _ in runs)
        server_per_op = statistics.median(b for _, b in runs)
        expected = _out_of_place_chain("cpu")[1]
        oop_remote = statistics.median(_timed_remote(_out_of_place_chain, session, expected)[0] for _ in range(3))

        tf_remote, tf_remote_loss = _timed_loss(_transformer_step_fn("remote_accel"), steps)
        remote_accel.shutdown()
    return {
        "transport": transport_name, "enqueue_us": enqueue * 1e6, "add_ops_per_s": ops_per_s, "trips": trips,
        "mlp_remote_ms": remote * 1e3, "mlp_compiled_ms": compiled * 1e3, "mlp_remote_loss": remote_loss,
        "mlp_compiled_loss": compiled_loss, "mlp_fresh_ms": fresh * 1e3, "mlp_fresh_loss": fresh_loss,
        "chain_remote_ops_per_s": CHAIN_OPS / chain_remote,
        "oop_remote_ops_per_s": CHAIN_OPS / oop_remote, "server_us_per_op": server_per_op * 1e6,
        "tf_remote_ms": tf_remote * 1e3, "tf_remote_loss": tf_remote_loss,
        "idle_connected_s": connected, "idle_unconnected_s": unconnected, "idle_cpu": idle_cpu,
        **syncs, **generate,
    }


def measure_local(steps: int, threads: int = 0) -> dict:
    """The local baselines, in a process of their own with no server running (main runs
    this as a child first): what a user's plain script gets. `threads`: torch's threads
    (0: its default)."""
    if threads:
        torch.set_num_threads(threads)
    local, local_loss = _timed_loss(_step_fn(_mlp(), "cpu"), steps)
    local_compiled, _ = _timed_loss(_step_fn(torch.compile(_mlp()), "cpu"), steps)
    local_fresh, local_fresh_loss = _timed_loss(_fresh_batch_step_fn("cpu"), steps)
    chain_local = statistics.median(_chain("cpu")[0] for _ in range(3))
    oop_local = statistics.median(_out_of_place_chain("cpu")[0] for _ in range(3))
    kernel = statistics.median(_kernel() for _ in range(3))
    tf_local, tf_local_loss = _timed_loss(_transformer_step_fn("cpu"), steps)
    return {"local_threads": torch.get_num_threads(), "mlp_local_ms": local * 1e3, "mlp_local_loss": local_loss,
            "mlp_local_compiled_ms": local_compiled * 1e3, "mlp_local_fresh_ms": local_fresh * 1e3,
            "mlp_local_fresh_loss": local_fresh_loss, "chain_local_ops_per_s": CHAIN_OPS / chain_local,
            "oop_local_ops_per_s": CHAIN_OPS / oop_local, "kernel_us": kernel * 1e6, "tf_local_ms": tf_local * 1e3,
            "tf_local_loss": tf_local_loss}


#: remote loss key -> the local loss it must match, and how closely (float reassociation:
#: the server's compiled graphs fuse, and its threads may split a reduction differently)
LOSS_CHECKS = {"mlp_remote_loss": "mlp_local_loss", "mlp_compiled_loss": "mlp_local_loss",
               "mlp_fresh_loss": "mlp_local_fresh_loss", "tf_remote_loss": "tf_local_loss"}
LOSS_RTOL = 1e-3


def check_losses(result: dict) -> None:
    """SystemExit when a remote run's loss is not the local run's: a benchmark of wrong
    results measures nothing."""
    for remote, local in LOSS_CHECKS.items():
        if remote in result and not math.isclose(result[remote], result[local], rel_tol=LOSS_RTOL, abs_tol=1e-6):
            raise SystemExit(f"{result['transport']}: {remote} {result[remote]!r} is not {local} "
                             f"{result[local]!r} (relative tolerance {LOSS_RTOL})")


def _generate_row(r: dict) -> str:
    if "gen_remote_ms" not in r:
        return "skipped: transformers is not installed"
    same = "" if r["gen_tokens_equal"] else " (tokens differ!)"
    return f"{r['gen_remote_ms']:.1f} / {r['gen_local_ms']:.1f} = {r['gen_remote_ms'] / r['gen_local_ms']:.2f}x{same}"


ROWS = (
    ("tiny-op chain, remote (ops/s)", lambda r: f"{r['chain_remote_ops_per_s']:,.0f}"),
    ("tiny-op chain, local (ops/s)", lambda r: f"{r['chain_local_ops_per_s']:,.0f}"),
    ("out-of-place chain y = x + 1.0, remote (ops/s)", lambda r: f"{r['oop_remote_ops_per_s']:,.0f}"),
    ("out-of-place chain y = x + 1.0, local (ops/s)", lambda r: f"{r['oop_local_ops_per_s']:,.0f}"),
    ("server cost per op beyond the kernel (us)",
     lambda r: f"{r['server_us_per_op']:.1f} - {r['kernel_us']:.1f} = {r['server_us_per_op'] - r['kernel_us']:.1f}"),
    ("tiny Transformer step remote / local (ms)",
     lambda r: f"{r['tf_remote_ms']:.1f} / {r['tf_local_ms']:.1f} = {r['tf_remote_ms'] / r['tf_local_ms']:.2f}x"),
    ("client cost per queued op, enqueue (us)", lambda r: f"{r['enqueue_us']:.1f}"),
    ("16x16 add_ ops per second end to end", lambda r: f"{r['add_ops_per_s']:,.0f}"),
    ("round trips per eager MLP step", lambda r: f"{r['trips']:.2f}"),
    ("MLP step remote eager / local (ms)",
     lambda r: f"{r['mlp_remote_ms']:.2f} / {r['mlp_local_ms']:.2f} = {r['mlp_remote_ms'] / r['mlp_local_ms']:.1f}x"),
    ("MLP step remote compiled / local",
     lambda r: f"{r['mlp_compiled_ms']:.2f} / {r['mlp_local_ms']:.2f} = {r['mlp_compiled_ms'] / r['mlp_local_ms']:.1f}x"),
    ("MLP step local compiled (Inductor) (ms)", lambda r: f"{r['mlp_local_compiled_ms']:.2f}"),
    ("MLP step uploading its batch, remote / local (ms)",
     lambda r: f"{r['mlp_fresh_ms']:.2f} / {r['mlp_local_fresh_ms']:.2f} = {r['mlp_fresh_ms'] / r['mlp_local_fresh_ms']:.1f}x"),
    *((name, lambda r, key=key: f"{r[key]:.1f}") for name, key in sync_points.SYNC_ROWS),
    ("tiny GPT-2 generate 16 tokens remote / CPU (ms)", _generate_row),
    ("idle client: {matmuls} local matmul+tanh (s)",
     lambda r: f"{r['idle_connected_s']:.2f} / {r['idle_unconnected_s']:.2f} = "
               f"{r['idle_connected_s'] / r['idle_unconnected_s']:.2f}x"),
    ("idle client's own CPU use (% of a core)", lambda r: f"{r['idle_cpu'] * 100:.1f}"),
)
#: what the idle-client row compares
IDLE_NOTE = "idle client: connected (idle) / before init() in the same process"


def _set_sizes(chain_ops: int, idle_matmuls: int) -> None:
    """--chain-ops and --idle-matmuls (defaults: CHAIN_OPS, sync_points.IDLE_MATMULS)."""
    global CHAIN_OPS
    CHAIN_OPS = chain_ops
    sync_points.IDLE_MATMULS = idle_matmuls


def _name(name: str) -> str:
    return name.format(matmuls=sync_points.IDLE_MATMULS)


def _cell(fmt, result: dict) -> str:
    try:
        return fmt(result)
    except KeyError:  # not measured (--sync-only)
        return "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", choices=("tcp", "dpdk", "tls", "both"), default="both")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", action="store_true", help="one JSON object per transport, for machines")
    parser.add_argument("--sync-only", action="store_true",
                        help="only the sync points, the generate ratio and the idle-client cost")
    add_server_threads_option(parser)
    # smaller runs (a smoke test's): the chains' length and the idle-client work
    parser.add_argument("--chain-ops", type=int, default=CHAIN_OPS,
                        help=f"ops per tiny-op chain (default: {CHAIN_OPS})")
    parser.add_argument("--idle-matmuls", type=int, default=sync_points.IDLE_MATMULS,
                        help=f"local matmuls of the idle-client rows (default: {sync_points.IDLE_MATMULS})")
    parser.add_argument("--side", choices=("local", "remote"), help=argparse.SUPPRESS)  # a child's part
    args = parser.parse_args()
    if args.chain_ops < 2 or args.idle_matmuls < 1:
        parser.error("--chain-ops is at least 2, --idle-matmuls at least 1")
    _set_sizes(args.chain_ops, args.idle_matmuls)
    if args.side == "local":
        print(json.dumps(measure_local(args.steps, args.server_threads)))
        return 0
    if args.side == "remote":
        print(json.dumps(measure(args.transport, args.steps, args.sync_only, args.server_threads)))
        return 0
    # The local baselines first, in a clean process with no server alive (one core each
    # with --server-threads: local on as many threads); then a process per transport (the
    # device and DPDK's EAL are set up once per process).
    local = {} if args.sync_only else _child(args, "local", "tcp")  # (no transport: any valid one)
    results = []
    for transport in (("tcp", "dpdk") if args.transport == "both" else (args.transport,)):
        remote = _child(args, "remote", transport)
        if remote is not None:
            results.append({**remote, **(local or {})})
    if local is None or len(results) < (2 if args.transport == "both" else 1):
        return 1
    for result in results:
        check_losses(result)
    if args.json:
        print(json.dumps(results if args.transport == "both" else results[0]))
        return 0
    server = f"{args.server_threads} CPU thread(s)" if args.server_threads else "its default CPU threads"
    where = (f"local: {local['local_threads']} thread(s), torch's default unless --server-threads" if local
             else "no local runs")
    print(f"server: {server}; {where}, in a process of its own before any server started; "
          f"remote losses checked against local (rtol {LOSS_RTOL})")
    print(f"{'':48s} " + " ".join(f"{r['transport']:>30s}" for r in results))
    for name, fmt in ROWS:
        print(f"{_name(name):48s} " + " ".join(f"{_cell(fmt, r):>30s}" for r in results))
    print(IDLE_NOTE)
    return 0


def _child(args, side: str, transport: str) -> Optional[dict]:
    """This script's `side` part (local baselines, or one transport's remote figures) in a
    process of its own: its JSON line; None, saying why, when it failed."""
    child = subprocess.run([sys.executable, __file__, "--side", side, "--transport", transport,
                            "--steps", str(args.steps), "--server-threads", str(args.server_threads),
                            "--chain-ops", str(args.chain_ops), "--idle-matmuls", str(args.idle_matmuls)]
                           + (["--sync-only"] if args.sync_only else []), capture_output=True, text=True)
    lines = child.stdout.strip().splitlines()
    if child.returncode != 0 or not lines:
        print(f"{side} {transport}: failed\n{child.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])


if __name__ == "__main__":
    raise SystemExit(main())
