"""Training runs for the end-to-end tests, as a user would write them.

    python train_models.py --transport tcp|dpdk [--server HOST:PORT] --token T --workdir DIR
                           [--reference cpu|cuda]

Trains each model 20 steps locally (on CPU, or on the --reference device) and on
remote_accel (in this one process, so a DPDK client owns its EAL for its whole life) and
prints one JSON line per model with both loss curves. The remote run of the Transformer saves a checkpoint at step 10,
rebuilds model, optimizer and scheduler from it with map_location="remote_accel", and
goes on, so its curve must equal an uninterrupted run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys

import torch
import torch.nn as nn

import remote_accel

STEPS = 20


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.25), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        return self.head(self.features(x))


class TinyTransformer(nn.Module):
    def __init__(self, vocab=50, d_model=32, classes=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(1, 12, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, classes)

    def forward(self, tokens):
        h = self.encoder(self.embed(tokens) + self.pos)
        return self.head(self.norm(h).mean(dim=1))


def cnn_data():
    """Four batches seen five times; the class is which quadrant of the image is brightest."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 16, 1, 12, 12, generator=g)
    quadrants = torch.stack([x[..., :6, :6], x[..., :6, 6:], x[..., 6:, :6], x[..., 6:, 6:]], dim=-1)
    y = quadrants.sum(dim=(2, 3, 4)).argmax(dim=-1)
    return x.repeat(STEPS // 4, 1, 1, 1, 1), y.repeat(STEPS // 4, 1)


def transformer_data():
    """Four batches seen five times; the class is the first token modulo 4."""
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 50, (4, 8, 12), generator=g)
    return tokens.repeat(STEPS // 4, 1, 1), (tokens[:, :, 0] % 4).repeat(STEPS // 4, 1)


def train_cnn(device: str) -> list[float]:
    torch.manual_seed(0)
    model = ConvNet().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    xs, ys = cnn_data()
    torch.manual_seed(10)  # the dropout masks: the same stream locally and on a server of that kind
    losses = []
    for x, y in zip(xs, ys):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _transformer_parts(device: str):
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warmup = 5
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / STEPS)))
    return model, opt, sched


def train_transformer(device: str, checkpoint: str | None = None) -> list[float]:
    model, opt, sched = _transformer_parts(device)
    xs, ys = transformer_data()
    torch.manual_seed(20)
    losses = []
    for step, (x, y) in enumerate(zip(xs, ys)):
        if checkpoint and step == STEPS // 2:
            device_rng = getattr(torch, device) if device != "cpu" else None  # torch.cuda, torch.remote_accel
            rng = torch.get_rng_state(), device_rng.get_rng_state() if device_rng else None
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()},
                       checkpoint)
            del model, opt, sched
            model, opt, sched = _transformer_parts(device)  # fresh objects, other weights
            state = torch.load(checkpoint, map_location=device)
            assert all(t.device.type == device for t in state["model"].values())
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])
            torch.set_rng_state(rng[0])
            if rng[1] is not None:
                device_rng.set_rng_state(rng[1])
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def train_locally(device: str, workdir: str) -> dict:
    attention = contextlib.nullcontext()
    if device == "cuda":
        # On remote_accel, attention runs in its decomposed math form (the client picks the
        # kernel by device type); CUDA's fused kernels draw their dropout differently.
        from torch.nn.attention import SDPBackend, sdpa_kernel

        attention = sdpa_kernel(SDPBackend.MATH)
    with attention:
        return {"cnn": train_cnn(device),
                "transformer": train_transformer(device, os.path.join(workdir, "local.pt"))}


def reference_curves(args) -> dict:
    if args.reference == "cpu":
        return train_locally("cpu", args.workdir)
    # PyTorch takes a registered PrivateUse1 backend for the process's one accelerator, and
    # local CUDA autograd then fails its stream checks: the reference runs in a process that
    # never calls remote_accel.init().
    child = subprocess.run([sys.executable, __file__, "--local-only", "--reference", args.reference,
                            "--workdir", args.workdir, "--transport", args.transport, "--token", "-"],
                           capture_output=True, text=True, check=True)
    return json.loads(child.stdout.splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--transport", choices=("tcp", "dpdk"), required=True)
    p.add_argument("--server", default=None)
    p.add_argument("--token", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--reference", default="cpu", help="the local device to compare with (default: cpu)")
    p.add_argument("--local-only", action="store_true", help="only the reference runs, one JSON line")
    args = p.parse_args()
    if args.local_only:
        print(json.dumps(train_locally(args.reference, args.workdir)), flush=True)
        return 0
    # init before any backward: autograd makes its per-device queues at the first one
    remote_accel.init(transport=args.transport, server=args.server, token=args.token, timeout=60)
    local = reference_curves(args)
    peer = remote_accel.pytorch_ext.runtime.sessions()[0].transport.peer
    print(json.dumps({"peer": peer}), flush=True)
    remote = {"cnn": train_cnn("remote_accel"),
              "transformer": train_transformer("remote_accel", os.path.join(args.workdir, "remote.pt"))}
    for name in remote:
        print(json.dumps({"model": name, "local": local[name], "remote": remote[name]}), flush=True)
    remote_accel.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
