"""Two tests in torch.distributed that name devices where they could ask them.

Each is a single condition in a torch function, recompiled here with that condition
widened for remote_accel, in place (the function object keeps its identity, so every
module that imported it gets the change). Each patch looks for the exact text it
changes: in a torch where the text differs (a release that fixed or moved it) nothing
is touched, and debug logging says so. docs/distributed.md says what upstream change
would make each one unnecessary.

- `init_device_mesh` (behind FSDP2's fully_shard, DTensor, DCP) takes only device type
  names made of letters, to catch a name with an index ("cuda:0"): "remote_accel" fails
  it for its underscore.
- DistributedDataParallel's check of the bf16 compression hook accepts CUDA with NCCL
  and XPU with XCCL only; the hook itself needs nothing of the device but bf16 tensors
  and an all-reduce, which raccl has.
"""

from __future__ import annotations

import inspect
import logging
import textwrap

from torch.distributed import device_mesh
from torch.nn.parallel import distributed as ddp

log = logging.getLogger(__name__)

_done = False


def apply() -> None:
    global _done
    if _done:
        return
    _done = True
    recompile(device_mesh.init_device_mesh, "not device_type.isalpha()",
              "not device_type.replace('_', '').isalpha()")
    recompile(ddp.DistributedDataParallel._check_comm_hook,
              "if not ((cuda_supported and nccl_supported) or xpu_xccl_supported):",
              "if not ((cuda_supported and nccl_supported) or xpu_xccl_supported "
              "or self.device_type == 'remote_accel'):")


def recompile(function, old: str, new: str) -> bool:
    """Compile `function` again from its source with `old` (found exactly once) read as
    `new`, and give it the new code; False (and nothing changed) where the source does
    not read so, is not available, or the function is a closure."""
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        source = ""
    if source.count(old) != 1 or function.__closure__:
        log.debug("remote_accel: %s does not read as expected; left as it is", function.__qualname__)
        return False
    padded = "\n" * (function.__code__.co_firstlineno - 1) + source.replace(old, new)  # tracebacks keep torch's lines
    compiled: dict = {}
    exec(compile(padded, inspect.getsourcefile(function), "exec"), function.__globals__, compiled)  # noqa: S102
    function.__code__ = compiled[function.__name__].__code__
    return True
