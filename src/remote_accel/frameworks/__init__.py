"""Training frameworks (transformers, accelerate, Lightning) on the remote_accel device, unchanged.

A framework picks its device from fixed lists in a few places. Each framework's changes
live in one module of this package (`transformers.py`, `accelerate.py`, `lightning.py`),
each checked against the framework's version, and each loaded only once the framework's
module that it changes has been imported by a process that uses the device: `init()` and
autoload (remote_accel.pytorch_ext.lifecycle) call install(), which puts a finder on
sys.meta_path, as _torch_hook does for torch. A process that never uses the device (no
server in its environment, no init()) imports nothing of this package, and its frameworks
run as shipped; the patches themselves change a framework's choice only where the device
is in use (frameworks/_support.py).

This module imports no framework and no torch: install() costs a look at sys.modules.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
import warnings

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
    # Lightning's standalone packages: the same code under other names
    "lightning_fabric.accelerators": "lightning",
    "lightning_fabric.connector": "lightning",
    "pytorch_lightning.accelerators": "lightning",
    "pytorch_lightning.trainer.connectors.accelerator_connector": "lightning",
}

_applied: set[str] = set()  # patch points done (or tried) in this process
_lock = threading.RLock()  # an integration's own imports may reach the finder again


def install() -> None:
    """From now on, adapt each framework module of PATCH_POINTS once it has run; adapt
    those already imported at once. Idempotent."""
    with _lock:
        if not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport())
        for name in PATCH_POINTS:
            module = sys.modules.get(name)
            if module is None or name in _applied:
                continue
            spec = getattr(module, "__spec__", None)
            if getattr(spec, "_initializing", False):
                _when_initialised(module)
            else:
                _apply(module)


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


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module of PATCH_POINTS, wraps the loader that the other
    finders give so that the integration runs once the module has run."""

    def find_spec(self, name, path=None, target=None):
        if name not in PATCH_POINTS or name in _applied:
            return None
        spec = self._spec_of_the_others(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _apply(module)

        spec.loader.exec_module = exec_module
        return spec

    def _spec_of_the_others(self, name, path, target):
        for finder in sys.meta_path:
            if isinstance(finder, _AfterImport) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                return spec
        return None


def _when_initialised(module) -> None:
    """A module that is still running when install() comes: a framework's module whose own
    imports imported torch, whose autoload installs the hook (`from transformers import
    TrainingArguments` does). importlib marks the module done by setting its spec's
    `_initializing` to False once the module has run and sits in sys.modules: a spec whose
    class turns that moment into the integration's turn, then becomes a plain spec again."""
    spec = module.__spec__
    if type(spec) is importlib.machinery.ModuleSpec:
        spec.__class__ = _InitialisingSpec
    else:  # not importlib's own spec: nothing to hang the moment on
        warnings.warn(f"remote_accel: {module.__name__} was imported in a way remote_accel cannot follow; it is "
                      "not adapted to the remote_accel device (import remote_accel before it)", RuntimeWarning,
                      stacklevel=3)


class _InitialisingSpec(importlib.machinery.ModuleSpec):
    @property
    def _initializing(self):
        return self.__dict__.get("_initializing", False)

    @_initializing.setter
    def _initializing(self, value):
        self.__dict__["_initializing"] = value
        if value:
            return
        self.__class__ = importlib.machinery.ModuleSpec
        module = sys.modules.get(self.name)  # absent when the module raised
        if module is not None:
            _apply(module)
