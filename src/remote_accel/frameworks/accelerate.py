"""accelerate on remote_accel: one process needs no change from 1.16 on; several processes
(`accelerate launch --num_processes N`, torchrun) need three small ones.

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

Several processes: a process started by a launcher (LOCAL_RANK set) asks accelerate's
`TORCH_DISTRIBUTED_BACKENDS` for its device's process-group backend, names the run
`DistributedType(f"MULTI_{TYPE}")` and takes the device of that type's torch module; none
knows remote_accel. What this module changes (accelerate 1.16, the code read in 1.16.0):

- `TORCH_DISTRIBUTED_BACKENDS["remote_accel"]`: the backend torch maps the device to
  (`raccl`). The launcher (`accelerate launch` counts the devices of a device with a
  backend, and starts one process per device through torchrun where there are several)
  and `PartialState` (`init_process_group(backend="raccl")`) read it there.
- `DistributedType("MULTI_REMOTE_ACCEL")` (the name accelerate builds, and what
  `accelerate config default` writes) is `DistributedType.MULTI_GPU`, the member every
  list of accelerate's multi-device code names (DDP in `prepare_model`, `gather`,
  `wait_for_everyone`, the RNG broadcast, autocast): the enum's `_missing_` hook, for this
  one value. Nothing in accelerate 1.16 reads MULTI_GPU as "CUDA" except through the
  device, which is remote_accel's.
- `PartialState.set_device`, where the backend is raccl: `remote_accel:LOCAL_RANK` (modulo
  the servers the process sees, as accelerate does for GPUs), where it would take
  torch.cuda for MULTI_GPU.

Upstream, a generic distributed type for devices torch.accelerator reports, and the
backend from `torch.distributed.get_default_backend_for_device` where accelerate's table
has none, would make these unnecessary (docs/frameworks.md).
"""

from __future__ import annotations

import functools
import logging
import warnings

from . import _support

log = logging.getLogger("remote_accel")

SUPPORTED = ">=1.16,<2"
TESTED = "1.16.0"

#: the distributed type accelerate builds for the device: f"MULTI_{device.upper()}"
_OUR_TYPE = f"MULTI_{_support.DEVICE.upper()}"


def patch(module) -> None:
    """Called with accelerate.state once it has run (frameworks.install)."""
    problem = _support.unsupported("accelerate", SUPPORTED, TESTED)
    if problem:
        warnings.warn(f"{problem} (accelerate before 1.16 picks cpu where remote_accel is torch's accelerator)",
                      RuntimeWarning, stacklevel=2)
        return
    _several_processes(module)
    log.debug("accelerate adapted to several processes on remote_accel")


def _several_processes(state) -> None:
    import torch.distributed as dist
    from accelerate.utils import constants

    backend = dist.Backend.default_device_backend_map.get(_support.DEVICE)
    if backend is None:  # raccl registers with the device (pytorch_ext/_register.py)
        log.debug("no torch.distributed backend for remote_accel: accelerate stays one process per device")
        return
    constants.TORCH_DISTRIBUTED_BACKENDS.setdefault(_support.DEVICE, backend)
    _our_type_is_multi_gpu(state.DistributedType)
    _rank_takes_its_device(state.PartialState, backend)


def _our_type_is_multi_gpu(distributed_type) -> None:
    missing = distributed_type._missing_  # a bound classmethod: Enum's own returns None
    if getattr(missing, "_remote_accel", False):
        return

    def _missing_(cls, value):
        if value == _OUR_TYPE:
            return cls.MULTI_GPU
        return missing(value)

    _missing_._remote_accel = True
    distributed_type._missing_ = classmethod(_missing_)


def _rank_takes_its_device(partial_state, backend: str) -> None:
    set_device = partial_state.set_device
    if getattr(set_device, "_remote_accel", False):
        return

    @functools.wraps(set_device)
    def _set_device(self):
        if self.device is None and self.backend == backend:
            import torch

            module = _support.device_module()
            self.device = torch.device(_support.DEVICE, max(self.local_process_index, 0) % module.device_count())
            module.set_device(self.device.index)
            return None
        return set_device(self)

    _set_device._remote_accel = True
    partial_state.set_device = _set_device
