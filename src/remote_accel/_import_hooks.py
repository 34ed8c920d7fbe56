"""Run a function right after a module has been imported: at once if it already is.

The device registers itself once torch has loaded (_torch_hook), torch.compile learns to
leave the device's own frames alone once torch._dynamo has loaded (pytorch_ext/compile.py),
and each training framework is adapted once its module has loaded (frameworks/), without
importing any of them early. A finder on sys.meta_path finds nothing itself: it wraps the
loader the other finders give, so that the function runs once the module's code has.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Callable

_waiting: dict[str, list[Callable[[ModuleType], None]]] = {}  # module name -> what runs after it
_lock = threading.RLock()  # a function's own imports may reach the finder again


def after_import(name: str, run: Callable[[ModuleType], None]) -> None:
    """Call `run(module)` once module `name` is imported: now if it is, else right after
    its import. A module still running its own code (it imported the caller: torch's
    autoload, or transformers.training_args importing torch) gets `run` the moment
    importlib marks it loaded."""
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _waiting.setdefault(name, []).append(run)
            if not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
                sys.meta_path.insert(0, _AfterImport())
            return
        spec = getattr(module, "__spec__", None)
        if getattr(spec, "_initializing", False) and type(spec) in (importlib.machinery.ModuleSpec, _InitialisingSpec):
            spec.__class__ = _InitialisingSpec
            spec.__dict__.setdefault("_remote_accel_runs", []).append(run)
            return
    run(module)


def _run_all(module: ModuleType, runs: list) -> None:
    for run in runs:
        run(module)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module someone waits for, wraps the loader that the
    other finders give so that the waiting functions run once the module has run."""

    def find_spec(self, name, path=None, target=None):
        if name not in _waiting:
            return None
        spec = None
        for finder in sys.meta_path:
            if not isinstance(finder, _AfterImport) and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        with _lock:
            runs = _waiting.pop(name, [])
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _run_all(module, runs)

        spec.loader.exec_module = exec_module
        return spec


class _InitialisingSpec(importlib.machinery.ModuleSpec):
    """A spec whose module is still running: importlib marks the module done by setting
    `_initializing` to False once it has run and sits in sys.modules; that moment runs
    the waiting functions, and the spec becomes a plain one again."""

    @property
    def _initializing(self):
        return self.__dict__.get("_initializing", False)

    @_initializing.setter
    def _initializing(self, value):
        self.__dict__["_initializing"] = value
        if value:
            return
        self.__class__ = importlib.machinery.ModuleSpec
        runs = self.__dict__.pop("_remote_accel_runs", [])
        module = sys.modules.get(self.name)  # absent when the module raised
        if module is not None:
            _run_all(module, runs)
