"""Training frameworks (transformers, accelerate, Lightning) on the remote_accel device, unchanged.

A framework picks its device from fixed lists in a few places. Each framework's changes
live in one module of this package (`transformers.py`, `accelerate.py`, `lightning.py`),
each checked against the framework's version, and each loaded only once the framework's
module that it changes has been imported by a process that uses the device: `init()` and
autoload (remote_accel.pytorch_ext.lifecycle) call install(), which waits for them
(remote_accel._import_hooks, as _torch_hook waits for torch). A process that never uses the device (no
server in its environment, no init()) imports nothing of this package, and its frameworks
run as shipped; the patches themselves change a framework's choice only where the device
is in use (frameworks/_support.py).

This module imports no framework and no torch: install() costs a look at sys.modules.
"""

from __future__ import annotations

import importlib
import logging
import threading
import warnings

from .._import_hooks import after_import

log = logging.getLogger("remote_accel")

#: the framework modules that hold what an integration changes -> that integration (a
#: module of this package). The accelerator registries come before the connectors that
#: look them up, so that install() registers before it patches when both are loaded.
PATCH_POINTS = {
    "accelerate.state": "accelerate",
    "transformers.training_args": "transformers",
    "transformers.modeling_utils": "transformers",
    "lightning.fabric.accelerators": "lightning",
    "lightning.fabric.connector": "lightning",
    "lightning.pytorch.accelerators": "lightning",
    "lightning.pytorch.trainer.connectors.accelerator_connector": "lightning",
    "lightning.fabric.strategies.ddp": "lightning",
    "lightning.pytorch.strategies.ddp": "lightning",
    # Lightning's standalone packages: the same code under other names
    "lightning_fabric.accelerators": "lightning",
    "lightning_fabric.connector": "lightning",
    "pytorch_lightning.accelerators": "lightning",
    "pytorch_lightning.trainer.connectors.accelerator_connector": "lightning",
    "lightning_fabric.strategies.ddp": "lightning",
    "pytorch_lightning.strategies.ddp": "lightning",
}

_installed: set[str] = set()  # patch points waited for
_applied: set[str] = set()  # patch points done (or tried) in this process
_lock = threading.RLock()  # an integration's own imports may reach the finder again


def install() -> None:
    """From now on, adapt each framework module of PATCH_POINTS once it has run; adapt
    those already imported at once. Idempotent."""
    with _lock:
        for name in PATCH_POINTS:
            if name not in _installed:
                _installed.add(name)
                after_import(name, _apply)


def _apply(module) -> None:
    name = module.__name__
    with _lock:
        if name in _applied:
            return
        _applied.add(name)
        try:
            integration = importlib.import_module(f"{__name__}.{PATCH_POINTS[name]}")
            integration.patch(module)
        except Exception as exc:  # never break the user's import: say why the device is not used there
            warnings.warn(f"remote_accel: {name} was not adapted to the remote_accel device: {exc}", RuntimeWarning,
                          stacklevel=2)
            log.debug("adapting %s failed", name, exc_info=True)
