"""The training step the benchmarks time: zero_grad, forward, loss, backward, step, and
the loss read back (`.item()`, a sync point, as a user's loop has)."""

from __future__ import annotations

from typing import Callable

import torch.nn as nn


def training_step(model: nn.Module, opt, x, y, loss_fn: Callable = nn.functional.cross_entropy) -> Callable[[], float]:
    def step() -> float:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return step
