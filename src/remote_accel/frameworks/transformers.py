"""transformers' Trainer on remote_accel: TrainingArguments keeps the device accelerate chose.

accelerate (>= 1.16) finds remote_accel through torch.accelerator, but transformers'
`TrainingArguments` picks the device of a one-process run itself, from a fixed list
(mps, xpu, mlu, musa, npu, hpu, neuron, tpu, else cuda or cpu): the Trainer then trains
on accelerate's device and stops at the first step with "Calculated loss must be on the
original device: cpu but device in use is remote_accel:0". Three changes, for
transformers 5 (the code they wrap reads the same in 5.0.0, 5.23.0 and 5.25.0):

- `TrainingArguments._setup_devices`: where accelerate's state chose remote_accel and
  transformers' list chose another device (cpu; cuda:0 on a client with a GPU of its own)
  without `use_cpu`, the device is accelerate's. Multi-process runs already take
  accelerate's device there.
- `is_torch_bf16_gpu_available`, as `TrainingArguments.__post_init__` calls it for
  `bf16=True`: also true where remote_accel is the device in use and its server's
  device has bf16 kernels (torch.remote_accel.is_bf16_supported(): a CPU server, a GPU
  of compute capability 8.0 or more). Only training_args' name is rebound; the rest of
  transformers keeps its own.

- `kernelize` as `transformers.modeling_utils` calls it (from 5.25 `from_pretrained` does by
  default; before, `use_kernels=True` asks for it): the `kernels` library swaps layers for
  hub kernels built for local device types and refuses any other ("Unsupported device
  type 'remote_accel'"), so `from_pretrained(..., device_map="auto")` failed. A model
  placed on remote_accel keeps its layers' own code, which runs on the server.

`fp16=True` needs no change: accelerate builds `torch.amp.GradScaler("remote_accel")`,
and autocast on the device casts as on CUDA. What would make this module unnecessary:
`_setup_devices` taking `PartialState().device` for any accelerator torch.accelerator
reports (as accelerate's own `default_device` does since 1.16), and the bf16 check asking
`torch.accelerator`'s device module, and `kernels` falling back to the layers' own code
for a device type it has no kernels for, as it does for a layer it has none for
(docs/frameworks.md).
"""

from __future__ import annotations

import functools
import logging
import warnings

import torch

from . import _support

log = logging.getLogger("remote_accel")

SUPPORTED = ">=5.0,<6"
TESTED = "5.23.0"


def patch(module) -> None:
    """Called with transformers.training_args or transformers.modeling_utils once it has
    run (frameworks.install)."""
    problem = _support.unsupported("transformers", SUPPORTED, TESTED)
    if problem:
        if module.__name__.endswith(".training_args"):  # one warning, not one per module
            warnings.warn(f"{problem}: TrainingArguments will choose cpu where remote_accel is the device",
                          RuntimeWarning, stacklevel=2)
        return
    if module.__name__.endswith(".training_args"):
        _keep_accelerates_device(module.TrainingArguments)
        _bf16_check_knows_the_device(module)
    elif hasattr(module, "kernelize"):
        _no_hub_kernels_on_the_device(module)
    log.debug("%s adapted to the remote_accel device", module.__name__)


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


def _no_hub_kernels_on_the_device(module) -> None:
    kernelize = module.kernelize

    @functools.wraps(kernelize)
    def _kernelize(model, *args, **kwargs):
        if _placed_on_the_device(model, kwargs.get("device_map")):
            log.info("remote_accel: %s keeps its layers' own code (the kernels library has no kernels for "
                     "remote_accel)", type(model).__name__)
            return None
        return kernelize(model, *args, **kwargs)

    module.kernelize = _kernelize


def _placed_on_the_device(model, device_map) -> bool:
    """Where kernelize would look: the device map's first device that is not cpu or disk
    (an index is torch's accelerator's), else the model's device."""
    places = [place for place in (device_map or {}).values() if place not in ("cpu", "disk")]
    where = places[0] if places else model.device
    if isinstance(where, int):
        return _support.device_in_use()
    return torch.device(where).type == _support.DEVICE
