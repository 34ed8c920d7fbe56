"""Lightning on remote_accel: `Trainer(accelerator="remote_accel")` and `Fabric(accelerator="remote_accel")`.

Lightning has no entry point for accelerators: a third-party one must be in the
registry before `Trainer()` or `Fabric()` is built. Its connectors then choose the rest
from fixed lists. What this module does, for Lightning 2.4 to 2.x (the code it wraps reads
the same in 2.4.0, 2.5.0 and 2.6.6), in each of Lightning's package layouts (`lightning.pytorch`
and `lightning.fabric`, and the standalone `pytorch_lightning` and `lightning_fabric`):

- registers `RemoteAccelAccelerator` under "remote_accel" in the accelerator registry of
  `*.accelerators` (Trainer's and Fabric's): one device per server, `devices=N` gives
  remote_accel:0..N-1, `get_device_stats` the device's memory (torch.remote_accel.memory_stats);
- in the connectors (`*.trainer.connectors.accelerator_connector`, `*.fabric.connector`):
  - `accelerator="auto"` (the default) picks remote_accel where it is torch's accelerator
    in use (init() connected, or autoload from the environment), as "auto" picks CUDA;
  - with one device, the strategy is `SingleDeviceStrategy(device=remote_accel:i)`, not
    the `SingleDeviceStrategy(device="cpu")` Lightning gives an accelerator it does not
    know; with several Lightning chooses (DDP, with the process-group backend that
    torch.distributed maps to the device);
  - `precision="16-mixed"` / `"bf16-mixed"` get `MixedPrecision(device="remote_accel")`
    (autocast and GradScaler on the device), what a user would pass as `plugins=`, where
    Lightning builds `MixedPrecision(device="cuda")` for every accelerator but cpu and mps;
- in the DDP strategies (`*.strategies.ddp`: the Trainer's `_setup_model`, Fabric's
  `setup_module`), a model on remote_accel is wrapped in `DistributedDataParallel` as
  Lightning wraps one on a GPU, without the `torch.cuda.Stream()` Lightning makes
  around it for every device but cpu (which fails on a client without a CUDA driver, and
  would make a CUDA context on one with it; remote_accel has one stream per device).

A Lightning outside the supported versions gets the accelerator registered still, and
`accelerator="remote_accel"` raises an error naming the versions supported. Upstream,
Lightning PR #20349 (accelerators from entry points, devices from the accelerator) would
make the registration and the strategy choice unnecessary (docs/frameworks.md).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional, Union

import torch

from ..errors import ConfigError, RemoteAccelError
from . import _support

log = logging.getLogger("remote_accel")

SUPPORTED = ">=2.4,<3"
TESTED = "2.6.6"

#: the precision flags of each connector: (the user's Precision plugin, the precision string)
_PRECISION_FLAGS = {
    "_AcceleratorConnector": ("_precision_plugin_flag", "_precision_flag"),
    "_Connector": ("_precision_instance", "_precision_input"),
}


def patch(module) -> None:
    """Called with a Lightning accelerators module or connector module once it has run
    (frameworks.install)."""
    problem = _support.unsupported(module.__name__.split(".")[0], SUPPORTED, TESTED)
    if module.__name__.endswith(".accelerators"):
        _register(module, problem)
    elif problem is None and module.__name__.endswith(".strategies.ddp"):
        _adapt_ddp(module)
    elif problem is None:
        _adapt_connector(module)
    log.debug("%s adapted to the remote_accel device%s", module.__name__, f" ({problem})" if problem else "")


# -- the accelerator ---------------------------------------------------------------------------
class _RemoteAccelDevice:
    """The remote_accel device for Lightning: one device per server (the servers given to
    init(), or the one the environment names), `remote_accel:0` to `remote_accel:N-1`.

    A mixin: Lightning's Trainer and Fabric (and their standalone packages) each have an
    Accelerator base class of their own, and _register makes one class per base."""

    #: why this Lightning is not supported (an error at construction), or None
    _unsupported: Optional[str] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if self._unsupported:
            raise RemoteAccelError(self._unsupported)
        super().__init__(*args, **kwargs)

    def setup_device(self, device: torch.device) -> None:
        if device.type != _support.DEVICE:
            raise ConfigError(f"the remote_accel accelerator was given the device {device}")
        _support.device_module().set_device(device.index or 0)

    def teardown(self) -> None:
        """Nothing to release: the session (and the server's memory cache) belongs to the
        process, as a CUDA context does, and lives on for a next fit."""

    def get_device_stats(self, device: Union[str, torch.device]) -> dict[str, float]:
        """torch.remote_accel.memory_stats() (torch.cuda's keys where CUDA has the figure,
        then the server's own), the numbers only (a CPU server has no device allocator's)."""
        stats = _support.device_module().memory_stats(device)
        return {key: value for key, value in stats.items() if isinstance(value, (int, float))}

    @staticmethod
    def parse_devices(devices: Union[int, str, list[int]]) -> list[int]:
        """Lightning's meaning, as for GPUs: an int (or a string of one) is a count, -1 all,
        a list (or "0,2") the indices."""
        count = _support.device_module().device_count()
        if isinstance(devices, str):
            text = devices.strip()
            devices = [int(i) for i in text.split(",") if i.strip()] if "," in text else int(text)
        if isinstance(devices, int):
            indices = list(range(count)) if devices == -1 else list(range(devices))
        else:
            indices = [int(i) for i in devices]
        if not indices or any(not 0 <= i < count for i in indices):
            raise ConfigError(f"devices={devices!r} asks for remote_accel devices {indices}, and this process has "
                              f"{count} (remote_accel:0 to remote_accel:{count - 1}: one per server given to "
                              "init(servers=[...]), or the one REMOTE_ACCEL_SERVER names)")
        return indices

    @staticmethod
    def get_parallel_devices(devices: list[int]) -> list[torch.device]:
        return [torch.device(_support.DEVICE, i) for i in devices]

    @staticmethod
    def auto_device_count() -> int:
        return _support.device_module().device_count()

    @staticmethod
    def is_available() -> bool:
        return _support.device_module().is_available()

    @staticmethod
    def name() -> str:
        return _support.DEVICE


def _register(module, problem: Optional[str]) -> None:
    registry = getattr(module, "AcceleratorRegistry", None)  # Trainer's; Fabric's is ACCELERATOR_REGISTRY
    if registry is None:
        registry = module.ACCELERATOR_REGISTRY
    if _support.DEVICE in registry:
        return

    class RemoteAccelAccelerator(_RemoteAccelDevice, module.Accelerator):
        __doc__ = _RemoteAccelDevice.__doc__
        _unsupported = problem

    RemoteAccelAccelerator.__qualname__ = RemoteAccelAccelerator.__name__  # Lightning's messages name it
    registry.register(_support.DEVICE, RemoteAccelAccelerator, description="a device on another machine (remote_accel)")


# -- the connectors ------------------------------------------------------------------------------
def _adapt_connector(module) -> None:
    name = next(n for n in _PRECISION_FLAGS if hasattr(module, n))
    connector = getattr(module, name)
    plugin_flag, precision_flag = _PRECISION_FLAGS[name]

    choose_auto = connector._choose_auto_accelerator

    @functools.wraps(choose_auto)
    def _choose_auto_accelerator(*args, **kwargs) -> str:
        return _support.DEVICE if _support.device_in_use() else choose_auto(*args, **kwargs)

    choose_strategy = connector._choose_strategy

    @functools.wraps(choose_strategy)
    def _choose_strategy(self):
        strategy = choose_strategy(self)
        if isinstance(self.accelerator, _RemoteAccelDevice) and isinstance(strategy, module.SingleDeviceStrategy):
            return module.SingleDeviceStrategy(device=self._parallel_devices[0])
        return strategy

    init_precision = connector._check_and_init_precision

    @functools.wraps(init_precision)
    def _check_and_init_precision(self):
        precision = getattr(self, precision_flag)
        if (isinstance(self.accelerator, _RemoteAccelDevice) and getattr(self, plugin_flag) is None
                and precision in ("16-mixed", "bf16-mixed")):
            setattr(self, plugin_flag, module.MixedPrecision(precision=precision, device=_support.DEVICE))
        return init_precision(self)

    connector._choose_auto_accelerator = staticmethod(_choose_auto_accelerator)
    connector._choose_strategy = _choose_strategy
    connector._check_and_init_precision = _check_and_init_precision


# -- the DDP strategies ----------------------------------------------------------------------------
def _adapt_ddp(module) -> None:
    strategy = module.DDPStrategy
    # the Trainer's strategy wraps in _setup_model, Fabric's in setup_module; each asks
    # its own method for the device ids
    name, ids = (("_setup_model", "determine_ddp_device_ids") if "_setup_model" in vars(strategy)
                 else ("setup_module", "_determine_ddp_device_ids"))
    wrap = getattr(strategy, name)

    @functools.wraps(wrap)
    def _wrap_in_ddp(self, model):
        if self.root_device.type != _support.DEVICE:
            return wrap(self, model)
        return module.DistributedDataParallel(module=model, device_ids=getattr(self, ids)(), **self._ddp_kwargs)

    setattr(strategy, name, _wrap_in_ddp)
