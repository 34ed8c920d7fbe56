"""Compiled training step: remote (the server compiles the graphs) vs local eager CPU.

    python benchmarks/bench_compile.py [--transport tcp|dpdk] [--steps N] [--rounds N] [--server-threads N]
                                       [--runs replayed,compiled,...]

The tiny Transformer of issue #12 (2 encoder layers, d_model 64, 4 heads, ff 128, batch
8x32, AdamW), medians of --steps steps of: local eager CPU (torch's threads as they are,
and one thread), local Inductor, and the model `torch.compile(backend="remote_accel")`d
with the server replaying its graphs node by node (REMOTE_ACCEL_COMPILE_GRAPHS=0),
running them compiled by Inductor, and with AdamW's step compiled too (also with the
server drawing dropout's masks with torch's CPU kernel instead of its own,
REMOTE_ACCEL_SERVER_CPU_BERNOULLI=0); and forward + backward alone (no optimizer step),
local and remote, for what AdamW's step costs.
Remote steps are timed once the server has compiled every graph. The server runs on CPU
(or on $REMOTE_ACCEL_TEST_DEVICE); compile times are in its log. Each run happens in a
process of its own, local and remote runs alternate for --rounds rounds (a slow spell
of a shared host hits both), and the figures are the medians over the rounds, with each
round's ratio to local eager. The local runs have OpenMP's default wait policy, as a
user's training script has it (an OMP_WAIT_POLICY given to this script applies to the
remote runs alone, whose server inherits it)."""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics

import torch
import torch.nn as nn

import remote_accel
from remote_accel.pytorch_ext import runtime
from timing import (  # noqa: E402  (this folder, beside the script)
    add_server_threads_option, json_child, median_seconds, server_thread_options, wait_for_compiles)
from remote_accel.server.testing import ServerProcess


class TinyTransformer(nn.Module):
    def __init__(self, vocab=1000, d_model=64, classes=10):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=128, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)).mean(dim=1))


def _step_fn(model, device, compiled, backend="remote_accel", optimizer=False, opt_step_too=True):
    """A training step; `compiled`: the model through torch.compile with `backend`,
    `optimizer`: AdamW's step too (one more graph, instead of its eager ops);
    `opt_step_too` False: forward and backward only (what the optimizer's step costs)."""
    torch.manual_seed(0)
    # compiled: step counts on the device (capturable), so the server updates them in place
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=optimizer)
    x = torch.randint(0, 1000, (8, 32)).to(device)
    y = torch.randint(0, 10, (8,)).to(device)
    forward = torch.compile(model, backend=backend) if compiled else model
    opt_step = torch.compile(opt.step, backend=backend) if optimizer else opt.step

    def step():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(forward(x), y)
        loss.backward()
        if opt_step_too:
            opt_step()
        return loss.item()

    return step


def _time(fn, n: int, threads: int = 0) -> float:
    """Median seconds per call: on a small shared machine the mean follows stray stalls.
    `threads`: torch's intra-op threads meanwhile (0: as they are)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return median_seconds(fn, n)
    finally:
        torch.set_num_threads(before)


def _remote_step(model, transport: str, steps: int, compile_graphs: bool, optimizer: bool = False,
                 opt_step_too: bool = True, server_threads: int = 0,
                 torch_bernoulli: bool = False) -> tuple[float, dict]:
    env = {"REMOTE_ACCEL_COMPILE_GRAPHS": "1" if compile_graphs else "0"}
    if torch_bernoulli:  # dropout's masks from torch's CPU kernel instead of the server's
        env["REMOTE_ACCEL_SERVER_CPU_BERNOULLI"] = "0"
    threads = server_thread_options(server_threads)
    with ServerProcess("--transport", "tcp" if transport == "tcp" else "tcp,dpdk", *threads, env=env) as server:
        host, port = server.tcp
        os.environ.update(server.client_env())
        # a long compile in the server shares its GIL: allow syncs more than the default 10 s
        remote_accel.init(transport=transport, server=f"{host}:{port}", token=server.token, timeout=120)
        torch._dynamo.reset()
        session = runtime.sessions()[0]
        step = _step_fn(copy.deepcopy(model).to("remote_accel"), "remote_accel", compiled=True, optimizer=optimizer,
                        opt_step_too=opt_step_too)
        step()  # sends the graphs; the server compiles them in the background
        step()  # a compiled optimizer step sends its graph at its second call
        if compile_graphs:
            wait_for_compiles(session)
        seconds = _time(step, steps)
        stats = {k: v for k, v in session.stats().items() if k.startswith("graph")}
        remote_accel.shutdown()
    return seconds, stats


def _local_steps(model, steps: int) -> dict:
    """The local steps, in seconds (run in a process of its own, see main)."""
    return {
        "local": _time(_step_fn(copy.deepcopy(model), "cpu", compiled=False), steps),
        "local_no_opt": _time(_step_fn(copy.deepcopy(model), "cpu", compiled=False, opt_step_too=False), steps,
                              threads=1),
        "local_compiled": _time(_step_fn(copy.deepcopy(model), "cpu", compiled=True, backend="inductor"), steps),
        "local_1": _time(_step_fn(copy.deepcopy(model), "cpu", compiled=False), steps, threads=1),
        "threads": torch.get_num_threads(),
    }


#: The remote runs, each in a process of its own (DPDK's EAL starts once per process, on
#: the first server's memif socket): name -> _remote_step's keyword arguments.
REMOTE_RUNS = {
    "replayed": dict(compile_graphs=False),
    "compiled": dict(compile_graphs=True),
    "with_opt": dict(compile_graphs=True, optimizer=True),
    "with_opt_torch_bernoulli": dict(compile_graphs=True, optimizer=True, torch_bernoulli=True),
    "no_opt": dict(compile_graphs=True, opt_step_too=False),
}


def _child(side: str, args: argparse.Namespace, env: dict) -> dict:
    """This script's `side` part in a process of its own: its JSON line."""
    return json_child(__file__, ["--steps", str(args.steps), "--transport", args.transport,
                                 "--server-threads", str(args.server_threads), "--side", side], env, side)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", choices=("tcp", "dpdk"), default="tcp")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3, help="local and remote runs alternate this many times")
    add_server_threads_option(parser)
    parser.add_argument("--runs", default=",".join(REMOTE_RUNS),
                        help="the remote runs, comma-separated (default: all of " + ", ".join(REMOTE_RUNS) + ")")
    parser.add_argument("--side", choices=("local", *REMOTE_RUNS), help=argparse.SUPPRESS)  # a child's part
    args = parser.parse_args()
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not runs or any(r not in REMOTE_RUNS for r in runs):
        parser.error(f"--runs: some of {', '.join(REMOTE_RUNS)}")
    torch.manual_seed(0)
    model = TinyTransformer()
    if args.side == "local":
        print(json.dumps(_local_steps(model, args.steps)))
        return 0
    if args.side is not None:
        seconds, stats = _remote_step(model, args.transport, args.steps, server_threads=args.server_threads,
                                      **REMOTE_RUNS[args.side])
        print(json.dumps({"seconds": seconds, "stats": stats}))
        return 0
    # OpenMP's default wait policy for the local runs, as a user's script has it: an
    # OMP_WAIT_POLICY given to this script is for the server (docs/design/cpu-threads.md)
    local_env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    rounds: list = []  # local and remote alternate, so that a slow spell of the host hits both
    for _ in range(args.rounds):
        rounds.append({"local": _child("local", args, local_env),
                       **{name: _child(name, args, dict(os.environ)) for name in runs}})
    median = lambda pick: statistics.median(pick(r) for r in rounds)  # noqa: E731
    local_eager, local_1 = median(lambda r: r["local"]["local"]), median(lambda r: r["local"]["local_1"])
    rows = ((f"local eager CPU ({rounds[0]['local']['threads']} threads)", lambda r: r["local"]["local"]),
            ("local eager CPU, 1 thread", lambda r: r["local"]["local_1"]),
            ("local compiled CPU (Inductor, model)", lambda r: r["local"]["local_compiled"]),
            ("remote compiled model, graphs replayed", lambda r: r["replayed"]["seconds"]),
            ("remote compiled model, graphs compiled", lambda r: r["compiled"]["seconds"]),
            ("remote compiled model and AdamW step", lambda r: r["with_opt"]["seconds"]),
            ("the same, server on torch's bernoulli_ kernel", lambda r: r["with_opt_torch_bernoulli"]["seconds"]),
            ("local eager CPU, 1 thread, no optimizer step", lambda r: r["local"]["local_no_opt"]),
            ("remote compiled model, no optimizer step", lambda r: r["no_opt"]["seconds"]))
    print(f"transport: {args.transport}; server threads: {args.server_threads or 'its default'}; "
          f"tiny Transformer, batch 8x32, AdamW; medians of {args.steps} steps, "
          f"then of {args.rounds} rounds; each run in a process of its own, the local ones with OpenMP's "
          "default wait policy; [per-round ratios to local eager]")
    for name, pick in rows:
        try:
            seconds = median(pick)
        except KeyError:  # a remote run that --runs left out
            continue
        ratios = ", ".join(f"{pick(r) / r['local']['local']:.2f}" for r in rounds)
        print(f"step time {name + ':':46s} {seconds * 1e3:8.2f} ms  ({seconds / local_eager:.2f}x local eager, "
              f"{seconds / local_1:.2f}x on 1 thread) [{ratios}]")
    remote = rounds[-1]
    figures = {name: remote[name]["stats"] for name in ("compiled", "with_opt") if name in remote}
    if figures:
        print("server graph figures: " + "; ".join(
            f"{'with the optimizer: ' if name == 'with_opt' else ''}{stats}" for name, stats in figures.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
