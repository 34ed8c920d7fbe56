"""The main job: a server and a client training a real model on remote_accel.

    ra-demo [--transport dpdk|tcp] [--steps N] [--batch N]

Starts `remote-accel-server` (over DPDK memif on this host by default), trains a small
CNN on remote_accel with a progress line (step, loss, samples/s, bytes moved), then the
same run on the local CPU, and compares losses and times.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.nn as nn

log = logging.getLogger("ra-demo")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Dropout(0.1), nn.Linear(32 * 7 * 7, 64), nn.ReLU(), nn.Linear(64, 10),
        )

    def forward(self, x):
        return self.body(x)


def _data(steps: int, batch: int):
    g = torch.Generator().manual_seed(0)
    # a learnable synthetic task: the class is the quadrant with the brightest patch
    x = torch.randn(steps, batch, 1, 28, 28, generator=g) * 0.3
    y = torch.randint(0, 10, (steps, batch), generator=g)
    for i in range(10):
        r, c = divmod(i, 4)
        x[..., 0, r * 7 : r * 7 + 5, c * 7 : c * 7 + 5] += (y == i).float()[..., None, None] * 2
    return x, y


def train(model, device: str, x, y, progress: bool):
    from remote_accel.pytorch_ext import runtime

    torch.manual_seed(1)
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses, start = [], time.perf_counter()
    for step in range(len(x)):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[step].to(device)), y[step].to(device))
        loss.backward()
        opt.step()
        losses.append(loss.item())  # one round trip per step
        if progress:
            rate = (step + 1) * x.shape[1] / (time.perf_counter() - start)
            moved = sum(s.counters["bytes_up"] + s.counters["bytes_down"] for s in runtime.sessions())
            bar = "#" * int(30 * (step + 1) / len(x))
            print(f"\r[{bar:<30}] step {step + 1}/{len(x)}  loss {losses[-1]:.4f}  "
                  f"{rate:7.1f} samples/s  {moved / 1e6:7.1f} MB moved", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return losses, time.perf_counter() - start


def _start_server(transport: str, token_file: str, listen: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "remote_accel.server", "--transport", transport, "--device", "auto",
           "--token-file", token_file, "--listen", listen]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    lines: list = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(120)
    if not lines or not lines[0].startswith("listening on"):
        proc.kill()
        raise SystemExit(f"ra-demo: the server did not start (exit {proc.poll()})")
    print(f"server: {lines[0].strip()}", file=sys.stderr)
    return proc


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ra-demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", choices=("dpdk", "tcp"), default="dpdk", help="default: dpdk (memif)")
    parser.add_argument("--steps", type=int, default=30, help="training steps, 1..10000 (default: 30)")
    parser.add_argument("--batch", type=int, default=64, help="batch size, 1..4096 (default: 64)")
    parser.add_argument("--listen", default="127.0.0.1:18590", help="the server's TCP address (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import remote_accel

    with tempfile.TemporaryDirectory() as tmp:
        token_file = os.path.join(tmp, "token")
        server = _start_server(args.transport, token_file, args.listen)
        try:
            with open(token_file) as f:
                token = f.read().strip()
            remote_accel.init(transport=args.transport, port=0, server=args.listen, token=token)
            x, y = _data(args.steps, args.batch)
            torch.manual_seed(0)
            model = Net()
            print(f"training on remote_accel over {args.transport} "
                  f"(server device: {torch.remote_accel.get_device_name()})", file=sys.stderr)
            remote_losses, remote_s = train(copy.deepcopy(model), "remote_accel", x, y, progress=True)
            remote_accel.shutdown()
            print("the same run on the local CPU", file=sys.stderr)
            local_losses, local_s = train(copy.deepcopy(model), "cpu", x, y, progress=False)
        finally:
            server.terminate()
            server.wait(30)
    worst = max(abs(a - b) for a, b in zip(remote_losses, local_losses))
    print(f"final loss: remote {remote_losses[-1]:.4f}, local {local_losses[-1]:.4f} "
          f"(largest difference over {args.steps} steps: {worst:.2e})")
    print(f"step time: remote {1e3 * remote_s / args.steps:.1f} ms, local {1e3 * local_s / args.steps:.1f} ms "
          f"(remote/local {remote_s / local_s:.2f}x)")
    # Dropout draws from the server's generator on remote_accel and from the CPU's locally,
    # so the two runs agree closely but not exactly; what must hold is that both learned.
    learned = remote_losses[-1] < remote_losses[0] and all(l == l for l in remote_losses)
    return 0 if learned else 1


if __name__ == "__main__":
    sys.exit(main())
