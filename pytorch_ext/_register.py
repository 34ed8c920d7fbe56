"""Make `remote_accel` a torch device: once per process, on the first `init()`."""

from __future__ import annotations

import threading

import torch

_done = False
_lock = threading.Lock()


def register_device() -> None:
    global _done
    with _lock:
        if _done:
            return
        from . import device_module, fallback, printing
        from ._native import load

        load()
        torch.utils.rename_privateuse1_backend("remote_accel")
        torch._register_device_module("remote_accel", device_module)
        torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
        fallback.register()
        from .handles import install_generator_state_hooks

        install_generator_state_hooks()
        printing.install()
        from .compile import register_backend

        register_backend()
        _done = True


def set_device_count(n: int) -> None:
    from ._native import load

    load().set_device_count(max(n, 1))
