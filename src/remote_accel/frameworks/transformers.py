"""transformers' Trainer on remote_accel: TrainingArguments keeps the device accelerate chose.

accelerate (>= 1.16) finds remote_accel through torch.accelerator, but transformers'
`TrainingArguments` picks the device of a one-process run itself, from a fixed list
(mps, xpu, mlu, musa, npu, hpu, neuron, tpu, else cuda or cpu): the Trainer then trains
on accelerate's device and stops at the first step with "Calculated loss must be on the
original device: cpu but device in use is remote_accel:0". Two changes, both in
`transformers.training_args`, for transformers 5 (the code they wrap reads the same in
5.0.0, 5.23.0 and 5.25.0):

- `TrainingArguments._setup_devices`: where accelerate's state chose remote_accel and
  transformers' list chose another device (cpu; cuda:0 on a client with a GPU of its own)
  without `use_cpu`, the device is accelerate's. Multi-process runs already take
  accelerate's device there.
- `is_torch_bf16_gpu_available`, as `TrainingArguments.__post_init__` calls it for
  `bf16=True`: also true where remote_accel is the device in use and its server's
  device has bf16 kernels (torch.remote_accel.is_bf16_supported(): a CPU server, a GPU
  of compute capability 8.0 or more). Only training_args' name is rebound; the rest of
  transformers keeps its own.

`fp16=True` needs no change: accelerate builds `torch.amp.GradScaler("remote_accel")`,
and autocast on the device casts as on CUDA. What would make this module unnecessary:
`_setup_devices` taking `PartialState().device` for any accelerator torch.accelerator
reports (as accelerate's own `default_device` does since 1.16), and the bf16 check asking
`torch.accelerator`'s device module (docs/frameworks.md).
"""

from __future__ import annotations

import functools
import logging
import warnings

from . import _support

log = logging.getLogger("remote_accel")

SUPPORTED = ">=5.0,<6"
TESTED = "5.23.0"


def patch(module) -> None:
    """Called with transformers.training_args once it has run (frameworks.install)."""
    problem = _support.unsupported("transformers", SUPPORTED, TESTED)
    if problem:
        warnings.warn(f"{problem}: TrainingArguments will choose cpu where remote_accel is the device",
                      RuntimeWarning, stacklevel=2)
        return
    _keep_accelerates_device(module.TrainingArguments)
    _bf16_check_knows_the_device(module)
    log.debug("transformers.training_args adapted to the remote_accel device")


def _keep_accelerates_device(arguments_class) -> None:
    chosen = arguments_class.__dict__["_setup_devices"]  # a functools.cached_property
    choose = chosen.func

    @functools.wraps(choose)
    def _setup_devices(self):
        device = choose(self)
        state = getattr(self, "distributed_state", None)
        if (device.type != _support.DEVICE and not self.use_cpu and state is not None
                and state.device is not None and state.device.type == _support.DEVICE):
            # transformers' list ends in cuda:0 where the client has a GPU too (torch
            # names a registered PrivateUse1 device its accelerator first), counting the
            # GPUs for nn.DataParallel: one device, as for every accelerator but CUDA
            self._n_gpu = 1
            return state.device
        return device

    keep = functools.cached_property(_setup_devices)
    keep.__set_name__(arguments_class, "_setup_devices")
    arguments_class._setup_devices = keep


def _bf16_check_knows_the_device(module) -> None:
    check = module.is_torch_bf16_gpu_available

    @functools.wraps(check)
    def is_torch_bf16_gpu_available() -> bool:
        return check() or (_support.device_in_use() and _support.device_module().is_bf16_supported())

    module.is_torch_bf16_gpu_available = is_torch_bf16_gpu_available
