"""accelerate on remote_accel: nothing to change from 1.16 on; older releases are named.

accelerate 1.16 finds out-of-tree devices through torch.accelerator (its
`get_torch_accelerator_backend`, upstream PR #4278 for issue #3813): `PartialState`'s device,
the fp16 check in `Accelerator.__init__` (`torch.amp.is_autocast_available` and the
device module's `get_amp_supported_dtype`), `GradScaler("remote_accel")`, bf16, `set_seed`
(torch.manual_seed seeds registered backends), `clear_device_cache` and `get_max_memory`
(torch.accelerator.get_memory_info, so `device_map="auto"` places on the device) all ask
torch, which knows remote_accel. Releases before 1.16 choose from fixed device lists and
train on cpu; setting `ACCELERATE_TORCH_DEVICE=remote_accel:0` by hand makes them use the
device, but also overrides `cpu=True` (transformers' `use_cpu`), so this module does not
set it: it says which release to install instead.

Multi-process runs (`accelerate launch --num_processes N`, torchrun) look the device's
process-group backend up in accelerate's TORCH_DISTRIBUTED_BACKENDS and name the run
`DistributedType(f"MULTI_{TYPE}")`; neither knows remote_accel yet. The changes for that,
once remote_accel has a torch.distributed backend, belong here: the backend's name for
the device, and each process on `remote_accel:LOCAL_RANK`.
"""

from __future__ import annotations

import logging
import warnings

from . import _support

log = logging.getLogger("remote_accel")

SUPPORTED = ">=1.16,<2"
TESTED = "1.16.0"


def patch(module) -> None:
    """Called with accelerate.state once it has run (frameworks.install)."""
    problem = _support.unsupported("accelerate", SUPPORTED, TESTED)
    if problem:
        warnings.warn(f"{problem} (accelerate before 1.16 picks cpu where remote_accel is torch's accelerator)",
                      RuntimeWarning, stacklevel=2)
        return
    log.debug("accelerate finds remote_accel through torch.accelerator: nothing to change")
