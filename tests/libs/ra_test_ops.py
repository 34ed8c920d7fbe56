"""A library that registers ops of its own namespace, `ra_test::`, the way torchvision and
torchaudio do (a schema, a CPU kernel, a Meta kernel where shapes follow from metadata):
tests import it on both sides to check that such ops run on the server without needing
torchvision itself."""

from __future__ import annotations

import torch

_lib = torch.library.Library("ra_test", "DEF")
_lib.define("scale(Tensor x, float factor) -> Tensor")
# its result's shape depends on the data: no Meta kernel, like torchvision::nms
_lib.define("positive(Tensor x) -> Tensor")


def _scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


def _scale_meta(x: torch.Tensor, factor: float) -> torch.Tensor:
    return torch.empty_like(x)


def _positive(x: torch.Tensor) -> torch.Tensor:
    return x[x > 0]


_lib.impl("scale", _scale, "CPU")
_lib.impl("scale", _scale_meta, "Meta")
_lib.impl("positive", _positive, "CPU")


# A kernel that ends the server process, as a CUDA device-side assert does (the server then
# exits with status 3): the recovery tests' op that kills the server every time it runs.
_lib.define("crash(Tensor x) -> Tensor")


def _crash(x: torch.Tensor) -> torch.Tensor:
    import os

    os._exit(3)


_lib.impl("crash", _crash, "CPU")
_lib.impl("crash", torch.empty_like, "Meta")

# The same after a pause, for a client that must still reach the server after queueing it
# (the direct-copy tests queue a copy from the server behind it).
_lib.define("crash_after(Tensor x, float seconds) -> Tensor")


def _crash_after(x: torch.Tensor, seconds: float) -> torch.Tensor:
    import os
    import time

    time.sleep(seconds)
    os._exit(3)


_lib.impl("crash_after", _crash_after, "CPU")
_lib.impl("crash_after", lambda x, seconds: torch.empty_like(x), "Meta")
