"""Make `remote_accel` a torch device as soon as both are imported, in either order.

After `import remote_accel`, `torch.remote_accel.is_available()` is False and using the
device says to call `remote_accel.init()`, as torch.cuda behaves on a machine without a
GPU. Registering early also gives PyTorch's autograd engine its remote_accel queues
before a first backward() can run. Importing remote_accel alone still does not import
torch (the tools and the data plane do without it): when torch is not loaded yet, a
finder on sys.meta_path registers the device right after torch has loaded.

A server process (which imports remote_accel.server first) does not register it: its
own torch device might be another PrivateUse1 backend. init() registers in any case.

When torch itself imports remote_accel (its device-backend autoload in a process whose
environment names a server, see remote_accel_autoload), torch is still initialising:
the autoload sets the device up itself.
"""

from __future__ import annotations

import logging

from ._import_hooks import after_import

log = logging.getLogger("remote_accel")

_skip = False


def skip() -> None:
    """This process serves: do not make it a remote_accel client when torch loads."""
    global _skip
    _skip = True


def skipped() -> bool:
    return _skip


def install() -> None:
    after_import("torch", _register)


def _register(torch=None) -> None:
    if _skip:
        return
    try:
        from .pytorch_ext import _register as device
    except ImportError as exc:  # built without the C++ device: init() says how to rebuild
        log.debug("remote_accel device not registered at import: %s", exc)
        return
    try:
        device.register_device()
    except Exception as exc:  # never break the user's `import torch`; init() tries again and raises
        log.debug("remote_accel device not registered at import: %s", exc, exc_info=True)
