"""A client process for test_swap.py: trains an MLP on CPU, then on remote_accel, and
prints one JSON line with both loss curves and the client's memory_stats().

    python swap_client.py --server HOST:PORT --token T --width W --layers L --steps N [--seed S]
    python swap_client.py ... --expect-oom    # the model must not fit: prints what was raised

AdamW runs as a user would write it (foreach, the default on remote_accel), so one
optimizer op names every parameter at once.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

import torch
import torch.nn as nn

import remote_accel


def mlp(width: int, layers: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(width, 1))


def train(device: str, args) -> list:
    model = mlp(args.width, args.layers, args.seed).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(args.seed + 1)
    losses = []
    for _ in range(args.steps):
        x = torch.randn(4, args.width, generator=gen)
        y = torch.randn(4, 1, generator=gen)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if device == "cpu":
        return losses, {}, 0
    # while the model is alive: what this client holds, wherever the server keeps it
    return losses, torch.remote_accel.memory_stats(), torch.remote_accel.memory_allocated()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--expect-oom", action="store_true")
    args = p.parse_args()
    remote_accel.init(transport="tcp", server=args.server, token=args.token)
    if args.expect_oom:
        out = {}
        try:
            train("remote_accel", args)
            out["raised"] = None
        except torch.OutOfMemoryError as exc:
            out["raised"] = "OutOfMemoryError"
            out["message"] = str(exc).splitlines()[0]
        gc.collect()
        # the session goes on: a small computation after the failure
        x = torch.arange(6.0).to("remote_accel")
        out["after"] = (x * 2 + 1).cpu().tolist()
        print(json.dumps(out), flush=True)
        return 0
    cpu, _, _ = train("cpu", args)
    gc.collect()  # the CPU model's memory, before the remote run needs as much on the server
    remote, stats, allocated = train("remote_accel", args)
    gc.collect()
    after = torch.remote_accel.memory_stats()
    print(json.dumps({"cpu": cpu, "remote": remote, "stats": stats, "memory_allocated": allocated,
                      "after": after}), flush=True)
    remote_accel.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
