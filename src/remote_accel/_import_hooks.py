"""Run a function right after a module has been imported: at once if it already is.

The device registers itself once torch has loaded (_torch_hook), torch.compile learns to
leave remote_accel's own frames alone once torch._dynamo has loaded (pytorch_ext/compile.py),
without importing either module early: a finder on sys.meta_path finds nothing itself,
it wraps the module's own loader so that the function runs once the module's code has.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable


def after_import(name: str, run: Callable[[], None]) -> None:
    """Call `run()` once module `name` is imported: now if it is (and done loading),
    else right after its import. A module still in the middle of its own import (it
    imported us) is left alone: its importer calls `run` itself when it is done."""
    module = sys.modules.get(name)
    if module is not None:
        if not getattr(getattr(module, "__spec__", None), "_initializing", False):
            run()
        return
    if not any(isinstance(f, _After) and (f.name, f.run) == (name, run) for f in sys.meta_path):
        sys.meta_path.insert(0, _After(name, run))


class _After(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, run: Callable[[], None]):
        self.name = name
        self.run = run

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)  # once; and find_spec below must not come back here
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        load, run = spec.loader.exec_module, self.run

        def exec_module(module):
            load(module)
            run()

        spec.loader.exec_module = exec_module
        return spec
