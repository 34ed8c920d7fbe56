"""A model's layers in stages over several servers, micro-batches through them (GPipe).

`pipeline(module, devices, chunks)` takes an nn.Sequential (or any module's top-level
children, in order: its own forward is not used) and splits the layers into one
contiguous stage per device, balanced by bytes: each layer costs its parameters' bytes
plus the bytes of its output for one micro-batch (found on the meta device, no server
involved). The split needs the input's shape, so the stages are placed at the first
forward (or by `place(example)`); the parameters keep their identity when they move, so
an optimizer made before still holds them.

Each forward splits the batch into `chunks` micro-batches and issues them in GPipe's
order: at clock t, stage s runs micro-batch t - s. Nothing waits on the client: each
server runs its stage's micro-batches in order and starts micro-batch m as soon as the
previous stage's activation arrives (a direct copy, server to server), so the stages
overlap. Backward goes through autograd, stage by stage back. Gradients equal the unsplit
module's, except for layers that mix samples of a batch (BatchNorm in training sees one
micro-batch at a time, as in GPipe).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn
from torch.func import functional_call

from .parallel import check_alive, resolve_devices


def _output_bytes(out) -> int:
    if isinstance(out, torch.Tensor):
        return out.numel() * out.element_size()
    if isinstance(out, (tuple, list)):
        return sum(_output_bytes(o) for o in out)
    return 0


def layer_costs(layers: Sequence[nn.Module], example: torch.Tensor) -> list[int]:
    """Each layer's parameter bytes plus its output's bytes for `example`, run on the
    meta device (shapes only: no bytes, no server). A model that the meta device cannot
    run (a value read with .item(), an op without a meta kernel) is weighed by its
    parameters alone."""
    params = [sum(t.numel() * t.element_size() for t in layer.parameters()) for layer in layers]
    x = example.to("meta") if isinstance(example, torch.Tensor) else example
    outputs = []
    try:
        for layer in layers:
            tensors = {n: torch.empty_like(t, device="meta") for n, t in
                       list(layer.named_parameters()) + list(layer.named_buffers())}
            with torch.no_grad():
                x = functional_call(layer, tensors, (x,))
            outputs.append(_output_bytes(x))
    except (RuntimeError, NotImplementedError, TypeError):
        return params
    return [p + o for p, o in zip(params, outputs)]


def balanced_split(costs: Sequence[int], parts: int) -> list[int]:
    """Where each of `parts` contiguous stages starts, minimising the largest stage's
    cost (the pipeline runs at the pace of its slowest stage); every stage non-empty."""
    n = len(costs)
    parts = min(parts, n)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][i]: the smallest possible largest stage for the first i layers in k stages
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    starts, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


class Pipeline(nn.Module):
    """See the module's docstring. `layers` holds the module's children (parameters(),
    state_dict() as before the split); `stages` (nn.Sequential views of them, one per
    device used) is a plain list, not registered again, filled when placed."""

    def __init__(self, module: nn.Module, devices=None, chunks: int = 4):
        super().__init__()
        if chunks < 1:
            raise ValueError(f"pipeline: chunks must be at least 1, got {chunks}")
        self.layers = nn.ModuleList(module.children())
        if not len(self.layers):
            raise ValueError("pipeline: the module has no children to split into stages")
        self.devices = resolve_devices(devices)
        self.chunks = chunks
        self.stages: Optional[list[nn.Sequential]] = None
        check_alive(self.devices)

    def place(self, example: torch.Tensor) -> None:
        """Split the layers into stages for inputs shaped as `example` (a whole batch)
        and move each stage to its device."""
        micro = example.chunk(self.chunks)[0]
        starts = balanced_split(layer_costs(list(self.layers), micro), len(self.devices))
        ends = starts[1:] + [len(self.layers)]
        stages = []
        for dev, start, end in zip(self.devices, starts, ends):
            stage = nn.Sequential(*self.layers[start:end])
            stages.append(stage.to(dev))  # between servers: direct copies
        self.stages = stages
        self.stage_devices = self.devices[:len(stages)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stages is None:
            self.place(x)
        micro = list(x.chunk(self.chunks))
        acts: list = [None] * len(micro)
        n_stages = len(self.stages)
        for clock in range(len(micro) + n_stages - 1):
            for s in range(n_stages):
                m = clock - s
                if 0 <= m < len(micro):
                    dev = self.stage_devices[s]
                    with torch.remote_accel.device(dev.index):
                        acts[m] = self.stages[s]((micro[m] if s == 0 else acts[m]).to(dev))
        return torch.cat(acts)


def pipeline(module: nn.Module, devices=None, chunks: int = 4) -> Pipeline:
    """`module`'s layers split over `devices` (default every server) and run as a GPipe
    pipeline of `chunks` micro-batches; the output lands on the last stage's device."""
    return Pipeline(module, devices, chunks)
