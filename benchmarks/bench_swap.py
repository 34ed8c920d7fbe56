"""Swapping to host memory: a model twice the device memory against the same model with
enough memory, side by side in one run.

    python benchmarks/bench_swap.py [--width 1024] [--layers 8] [--steps 5] [--foreach] [--json]

Starts two servers (on CPU or $REMOTE_ACCEL_TEST_DEVICE): one whose --device-memory is
half of what the model's training state takes (weights, gradients, AdamW's moments),
with --swap-space for the rest, and one with the device's whole memory. A client
process per server trains the same MLP (after warm-up steps) and times each step (one
`.item()` sync per step). Reported: the median step time of each and their ratio, the
prefetch hit rate of the swapping run (uses of a swapped-out storage that the look-ahead
had brought back in time) and its swap bandwidth in each direction (bytes over the time
spent copying). AdamW runs per parameter unless --foreach: a foreach op names every
parameter at once and can never fit a device smaller than the model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = "--worker"
WARMUP = 2


def state_bytes(width: int, layers: int) -> int:
    return 4 * 4 * (layers * (width * width + width) + width + 1)


def worker(args) -> int:
    import torch
    import torch.nn as nn

    import remote_accel
    from training import training_step  # this folder, beside the script

    remote_accel.init(transport="tcp", server=args.server, token=args.token, timeout=600)
    torch.manual_seed(0)
    blocks = []
    for _ in range(args.layers):
        blocks += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = nn.Sequential(*blocks, nn.Linear(args.width, 1)).to("remote_accel")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=args.foreach)
    x, y = torch.randn(8, args.width).to("remote_accel"), torch.randn(8, 1).to("remote_accel")
    step = training_step(model, opt, x, y, nn.functional.mse_loss)

    import time

    for _ in range(WARMUP):  # plans and AdamW's state exist after the first steps
        step()
    before = torch.remote_accel.memory_stats()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    after = torch.remote_accel.memory_stats()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in
             ("swap_ins", "swap_outs", "prefetch_hits", "prefetch_misses", "swap_in_bytes", "swap_out_bytes",
              "swap_in_ns", "swap_out_ns", "swap_overcommits")}
    print(json.dumps({"step_s": statistics.median(times), "swap": delta,
                      "device_memory": after.get("server_device_memory")}), flush=True)
    remote_accel.shutdown()
    return 0


def measure(server_options: list, args) -> dict:
    from remote_accel.server.testing import ServerProcess

    with ServerProcess(*server_options) as server:
        host, port = server.tcp
        cmd = [sys.executable, __file__, WORKER, "--server", f"{host}:{port}", "--token", server.token,
               "--width", str(args.width), "--layers", str(args.layers), "--steps", str(args.steps)]
        if args.foreach:
            cmd.append("--foreach")
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                             env=dict(os.environ, **server.client_env()))
        if out.returncode != 0:
            raise SystemExit(f"client failed:\n{out.stderr}\nserver log:\n{server.log()[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--foreach", action="store_true", help="AdamW's foreach ops (one op over every parameter)")
    p.add_argument("--json", action="store_true")
    p.add_argument(WORKER, action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--server", help=argparse.SUPPRESS)
    p.add_argument("--token", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    state = state_bytes(args.width, args.layers)
    half = state // 2
    swapping = measure(["--device-memory", str(half), "--swap-space", str(2 * state)], args)
    fits = measure([], args)
    sw = swapping["swap"]
    used = sw["prefetch_hits"] + sw["prefetch_misses"]
    report = {
        "model_state_bytes": state,
        "device_memory_bytes": half,
        "step_s_swapping": swapping["step_s"],
        "step_s_in_memory": fits["step_s"],
        "ratio": swapping["step_s"] / fits["step_s"],
        "prefetch_hit_rate": sw["prefetch_hits"] / used if used else None,
        "swap_in_gb_s": sw["swap_in_bytes"] / sw["swap_in_ns"] if sw["swap_in_ns"] else None,
        "swap_out_gb_s": sw["swap_out_bytes"] / sw["swap_out_ns"] if sw["swap_out_ns"] else None,
        "swapped_per_step_bytes": (sw["swap_in_bytes"] + sw["swap_out_bytes"]) / args.steps,
        "swap": sw,
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"model state {state / 2**20:.0f} MiB on a device memory of {half / 2**20:.0f} MiB "
          f"(AdamW {'foreach' if args.foreach else 'per parameter'}, {args.steps} steps, median)")
    print(f"  step, swapping        {swapping['step_s'] * 1e3:9.1f} ms")
    print(f"  step, enough memory   {fits['step_s'] * 1e3:9.1f} ms")
    print(f"  ratio                 {report['ratio']:9.2f} x")
    rate = report["prefetch_hit_rate"]
    print(f"  prefetch hit rate     {'n/a' if rate is None else f'{100 * rate:8.1f} %'}  "
          f"({sw['prefetch_hits']} hits, {sw['prefetch_misses']} misses)")
    print(f"  swap in               {report['swap_in_gb_s'] or 0:9.2f} GB/s  ({sw['swap_ins']} storages)")
    print(f"  swap out              {report['swap_out_gb_s'] or 0:9.2f} GB/s  ({sw['swap_outs']} storages)")
    print(f"  swapped per step      {report['swapped_per_step_bytes'] / 2**20:9.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
