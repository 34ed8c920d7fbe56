"""A local GPU against remote_accel with a GPU server on the same machine, side by side.

    python benchmarks/bench_gpu.py [--transport tcp|dpdk|both] [--models gpt,gpt-bf16,resnet18,mlp]
                                   [--compile] [--layers 12 --d-model 768 --seq 512 --batch 16 --vocab 50257]
                                   [--resnet-batch 64 --image 224] [--steps 10]
    python benchmarks/bench_gpu.py --device cpu     # smoke run of every code path, no GPU

It times training steps (median of `--steps`, each step ending in `loss.item()`) of each
model run locally on `--device` (cuda by default) and through remote_accel with a server
on that device, per transport, and prints remote/local per model (the goal: <= 1.10).
The local run and each transport's client run in processes of their own: a process that
has registered remote_accel has it as its accelerator, not CUDA. Models: a GPT-style
decoder (pre-LayerNorm blocks, causal attention, AdamW) in fp32 and under bf16 autocast,
ResNet-18 (torchvision's if installed, else the local definition below; SGD with
momentum), and a small MLP (SGD). The first step's losses local and remote are printed
too: the same seed gives the same model, so they should agree (bf16 loosely).

`--compile` also times each model through torch.compile: locally with Inductor, and
remotely with `backend="remote_accel"` (the server compiles the graphs for its device,
CUDA graphs where shapes are static; timed once it has compiled them), and prints the
compiled remote step over the local eager step (issue #12's goal on a GPU: <= 1).

Without CUDA the default `--device cuda` exits with status 2 and says so; `--device cpu`
runs everything on a CPU server with small sizes (unless given), to prove the code paths.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import subprocess
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from timing import median_seconds, wait_for_compiles  # noqa: E402  (this folder, beside the script)

MODELS = ("gpt", "gpt-bf16", "resnet18", "mlp")
# sizes: (GPU defaults as the issue measured them, CPU smoke defaults)
SIZES = {
    "layers": (12, 2), "d_model": (768, 64), "seq": (512, 32), "batch": (16, 4), "vocab": (50257, 256),
    "resnet_batch": (64, 2), "image": (224, 32), "mlp_batch": (512, 32),
}


# -- models --------------------------------------------------------------------------------
class Block(nn.Module):
    """A GPT-2 block: pre-LayerNorm causal self-attention and a GELU MLP. Attention is
    written out (not scaled_dot_product_attention) so that local and remote run the same ops."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        att = att.masked_fill(mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int, layers: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, max(1, d // 64)) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x, self.mask)
        return self.head(self.ln(x))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


def resnet18(classes: int = 1000) -> nn.Module:
    """torchvision's ResNet-18 when torchvision is installed, else the same network here."""
    try:
        import torchvision
        return torchvision.models.resnet18(num_classes=classes)
    except ImportError:
        pass
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


def build(name: str, s: argparse.Namespace):
    """(model, optimizer factory, inputs on CPU, loss function, autocast dtype or None)."""
    torch.manual_seed(0)
    if name.startswith("gpt"):
        model = GPT(s.vocab, s.seq, s.d_model, s.layers)
        idx = torch.randint(0, s.vocab, (s.batch, s.seq + 1))
        inputs = (idx[:, :-1], idx[:, 1:])

        def loss_fn(model, x, y):
            return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())

        return model, lambda p: torch.optim.AdamW(p, lr=1e-4), inputs, loss_fn, (
            torch.bfloat16 if name == "gpt-bf16" else None)
    if name == "resnet18":
        model = resnet18()
        inputs = (torch.randn(s.resnet_batch, 3, s.image, s.image), torch.randint(0, 1000, (s.resnet_batch,)))
        return model, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), inputs, _ce, None
    if name == "mlp":
        model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
        inputs = (torch.randn(s.mlp_batch, 256), torch.randint(0, 10, (s.mlp_batch,)))
        return model, lambda p: torch.optim.SGD(p, lr=0.01), inputs, _ce, None
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def _ce(model, x, y):
    return F.cross_entropy(model(x), y)


# -- timing --------------------------------------------------------------------------------
def step_fn(name: str, s: argparse.Namespace, device: str, backend: str | None = None):
    """A training step of model `name` on `device`; `backend`: the model through
    torch.compile with that backend (the optimizer's step stays eager)."""
    model, make_opt, inputs, loss_fn, amp = build(name, s)
    model = copy.deepcopy(model).to(device)
    opt = make_opt(model.parameters())
    forward = torch.compile(model, backend=backend) if backend else model
    x, y = (t.to(device) for t in inputs)
    amp_device = torch.device(device).type

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        if amp is None:
            loss = loss_fn(forward, x, y)
        else:
            with torch.autocast(amp_device, dtype=amp):
                loss = loss_fn(forward, x, y)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def time_steps(step, n: int, settle=None) -> tuple[float, float]:
    """(first step's loss, median seconds per step after one more warm-up step).
    `settle`: called after the first step (a remote compile finishing on the server)."""
    first = step()
    if settle is not None:
        settle()
    return first, median_seconds(step, n, warmup=1)


def measure_local(s: argparse.Namespace) -> list[dict]:
    """Each model's step on the local device, eager (and Inductor with --compile). It runs
    in a process that never imports remote_accel: with a PrivateUse1 backend registered,
    PyTorch takes that for the process's accelerator and no longer CUDA."""
    rows = []
    for name in s.models:
        row = {"model": name}
        row["local_loss"], local = time_steps(step_fn(name, s, s.device), s.steps)
        row["local_ms"] = local * 1e3
        if s.compile:
            torch._dynamo.reset()
            _, local_compiled = time_steps(step_fn(name, s, s.device, backend="inductor"), s.steps)
            row["local_compiled_ms"] = local_compiled * 1e3
        rows.append(row)
    return rows


def measure_remote(transport_name: str, s: argparse.Namespace) -> list[dict]:
    """Each model's step through remote_accel with a server on `s.device`, eager (and with
    --compile, the model through torch.compile(backend="remote_accel"): the server
    compiles its graphs for its device)."""
    import remote_accel
    from remote_accel.pytorch_ext import runtime
    from remote_accel.server.testing import ServerProcess

    transport = "tcp" if transport_name == "tcp" else "tcp,dpdk"  # the fixture finds the server by TCP
    rows = []
    with ServerProcess("--transport", transport, device=s.device) as server:
        host, port = server.tcp
        os.environ.update(server.client_env())
        # a server compiling a large graph holds its GIL for a while: allow syncs to wait
        remote_accel.init(transport=transport_name, server=f"{host}:{port}", token=server.token,
                          timeout=300 if s.compile else 10)
        session = runtime.sessions()[0]
        try:
            for name in s.models:
                row = {"transport": transport_name, "model": name}
                row["remote_loss"], remote = time_steps(step_fn(name, s, "remote_accel"), s.steps)
                row["remote_ms"] = remote * 1e3
                if s.compile:
                    torch._dynamo.reset()
                    before = session.stats()
                    step = step_fn(name, s, "remote_accel", backend="remote_accel")
                    row["remote_compiled_loss"], remote_compiled = time_steps(
                        step, s.steps, settle=lambda: wait_for_compiles(session, s.compile_wait, failures_fail=False))
                    row["remote_compiled_ms"] = remote_compiled * 1e3
                    row["graphs"] = {k: v - before.get(k, 0) for k, v in session.stats().items()
                                     if k.startswith("graph")}  # this model's graphs alone
                rows.append(row)
        finally:
            remote_accel.shutdown()
            if s.server_log:  # compile times and any fallback's reason are in it
                with open(s.server_log, "a") as f:
                    f.write(server.log())
    return rows


def _child_rows(argv: list[str], side: str, transport: str | None = None) -> list[dict] | None:
    """Run this script for one side (and transport) in a process of its own; its JSON rows,
    or None (and its stderr shown) when it failed."""
    extra = ["--side", side] + (["--transport", transport] if transport else [])
    child = subprocess.run([sys.executable, __file__, *argv, *extra], capture_output=True, text=True)
    lines = child.stdout.strip().splitlines()
    if child.returncode != 0 or not lines:
        print(f"{side} {transport or ''}: failed (rc {child.returncode})\n{child.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])


# -- driver --------------------------------------------------------------------------------
def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="where the local run and the server run (cuda or cpu)")
    parser.add_argument("--transport", choices=("tcp", "dpdk", "both"), default="both")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, from " + ", ".join(MODELS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compile", action="store_true",
                        help="also time each model compiled: locally with Inductor, remotely with "
                             "torch.compile(backend='remote_accel')")
    parser.add_argument("--compile-wait", type=float, default=600.0,
                        help="seconds to wait for the server to compile a model's graphs before timing")
    parser.add_argument("--server-log", help="append each server's log to this file")
    parser.add_argument("--json", action="store_true", help="one JSON list of rows, for machines")
    parser.add_argument("--side", choices=("local", "remote"), help=argparse.SUPPRESS)  # a child process's part
    for key in SIZES:
        parser.add_argument("--" + key.replace("_", "-"), dest=key, type=int, default=None)
    s = parser.parse_args(argv)
    s.models = [m for m in s.models.split(",") if m]
    unknown = [m for m in s.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    cpu = torch.device(s.device).type == "cpu"
    for key, (gpu_default, cpu_default) in SIZES.items():
        if getattr(s, key) is None:
            setattr(s, key, cpu_default if cpu else gpu_default)
    if s.steps < 1:
        parser.error("--steps must be at least 1")
    if s.side == "remote" and s.transport == "both":
        parser.error("--side remote takes one transport")
    return s


def _child_argv(s: argparse.Namespace) -> list[str]:
    """The options a child process needs to measure what this one was asked for."""
    argv = ["--device", s.device, "--models", ",".join(s.models), "--steps", str(s.steps),
            "--compile-wait", str(s.compile_wait)]
    argv += ["--compile"] if s.compile else []
    argv += ["--server-log", s.server_log] if s.server_log else []
    for key in SIZES:
        argv += ["--" + key.replace("_", "-"), str(getattr(s, key))]
    return argv


def report(s: argparse.Namespace, rows: list[dict]) -> None:
    print(f"device {s.device}, {s.steps} steps per model (median); GPT {s.layers} layers d {s.d_model} "
          f"seq {s.seq} batch {s.batch}; ResNet-18 batch {s.resnet_batch} {s.image}x{s.image}")
    compiled = s.compile
    head = f"{'transport':9s} {'model':9s} {'local ms':>10s} {'remote ms':>10s} {'remote/local':>12s}"
    if compiled:
        head += f" {'local cmp':>10s} {'remote cmp':>10s} {'rcmp/local':>10s}"
    print(head + f" {'loss local':>11s} {'loss remote':>11s}")
    for r in rows:
        line = (f"{r['transport']:9s} {r['model']:9s} {r['local_ms']:10.2f} {r['remote_ms']:10.2f} "
                f"{r['remote_ms'] / r['local_ms']:11.2f}x")
        if compiled:
            line += (f" {r['local_compiled_ms']:10.2f} {r['remote_compiled_ms']:10.2f} "
                     f"{r['remote_compiled_ms'] / r['local_ms']:9.2f}x")
        print(line + f" {r['local_loss']:11.4f} {r['remote_loss']:11.4f}")
    if compiled:
        print("rcmp/local: the remote step with the model compiled on the server, over the local eager step")
        for r in rows:
            print(f"{r['transport']} {r['model']}: compiled remote first loss {r['remote_compiled_loss']:.4f}; "
                  f"server graphs {r.get('graphs')}")


def main(argv=None) -> int:
    s = parse(argv)
    if torch.device(s.device).type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu.py: no CUDA here (torch.cuda.is_available() is False): it compares a local GPU with a "
              "GPU server and needs one; run it with --device cpu for a smoke run of its code paths",
              file=sys.stderr)
        return 2
    if s.side is not None:
        rows = measure_local(s) if s.side == "local" else measure_remote(s.transport, s)
        print(json.dumps(rows))
        return 0
    # Local and each transport in a process of its own: the device and DPDK's EAL are set
    # up once per process, and the local run must not share a process with remote_accel.
    argv = _child_argv(s)
    local = _child_rows(argv, "local")
    remote = []
    for transport in (("tcp", "dpdk") if s.transport == "both" else (s.transport,)):
        remote += _child_rows(argv, "remote", transport) or []
    by_model = {row["model"]: row for row in local or []}
    rows = [{**by_model[r["model"]], **r} for r in remote if r["model"] in by_model]
    if s.json:
        print(json.dumps(rows))
    else:
        report(s, rows)
    expected = len(s.models) * (2 if s.transport == "both" else 1)
    return 0 if len(rows) == expected else 1


if __name__ == "__main__":
    raise SystemExit(main())
