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

# The device fails while this op runs, as under a CUDA device-side assert: the error is
# sticky (the server's device counts as lost from then on: it answers the client
# `device_lost` and exits with status 3, EXIT_DEVICE_LOST), so that a CPU server takes the
# path a GPU server takes. `once`: a file whose existence arms the failure; the op removes
# it, so the failure happens once (a transient fault: a replay then runs the op cleanly),
# where "" fails every time (a deterministic assert: its replay fails again). Its output's
# shape is not known ahead (no Meta kernel), so the client runs it with a reply, and that
# reply carries the server's `device_lost` answer, as a sync point's does on CUDA.
_lib.define("lose_device(Tensor x, str once) -> Tensor")


class DeviceAssert(RuntimeError):
    """What a CUDA kernel's failed assert raises (torch.AcceleratorError on CUDA)."""


def _lose_device(x: torch.Tensor, once: str) -> torch.Tensor:
    import os

    if once:
        try:
            os.remove(once)
        except FileNotFoundError:
            return x.clone()
    from remote_accel.server.device import ComputeDevice

    ComputeDevice.lost = lambda self, exc: True  # sticky, as a CUDA context's error is
    raise DeviceAssert("CUDA error: device-side assert triggered (ra_test::lose_device)")


_lib.impl("lose_device", _lose_device, "CPU")

# A pause inside the server's work, for a test to act while a client waits on it: when the
# file `once` exists, the op removes it (the test sees that the server is in the op) and
# sleeps `seconds` (the test kills the server meanwhile); otherwise, a replay's for one,
# it returns at once. The result is a copy of x.
_lib.define("pause(Tensor x, str once, float seconds) -> Tensor")


def _pause(x: torch.Tensor, once: str, seconds: float) -> torch.Tensor:
    import os
    import time

    try:
        os.remove(once)
    except FileNotFoundError:
        return x.clone()
    time.sleep(seconds)
    return x.clone()


_lib.impl("pause", _pause, "CPU")
_lib.impl("pause", lambda x, once, seconds: torch.empty_like(x), "Meta")
