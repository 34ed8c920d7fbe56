"""remote_accel: run PyTorch on accelerators that sit in another machine.

    import remote_accel
    remote_accel.init(transport="dpdk", port=0)     # or transport="tcp", server="host:port"
    x = torch.randn(64, 10, device="remote_accel")

Importing this package is cheap and does not import torch; once torch is imported too,
`device="remote_accel"` is known (and asks for `init()`), and `init()` connects.
"""

from . import _torch_hook
from ._version import __version__
from .errors import RemoteAccelError

_torch_hook.install()

__all__ = ["__version__", "RemoteAccelError", "init", "shutdown", "stats", "server_stats"]


def __getattr__(name):
    # The device (torch, the C++ extension) loads only when a client asks for it, so that
    # the server and the tools import remote_accel.* without it.
    if name in ("init", "shutdown", "is_initialized"):
        from . import pytorch_ext

        return getattr(pytorch_ext, name)
    if name in ("ray", "parallel"):  # remote_accel.ray imports Ray only when a pool is made
        import importlib

        return importlib.import_module("." + name, __name__)
    if name == "server_stats":
        from .pytorch_ext import device_module

        return device_module.server_stats
    if name == "stats":  # the session's counters: torch.remote_accel.stats
        from .pytorch_ext import device_module

        return device_module.stats
    raise AttributeError(f"module 'remote_accel' has no attribute {name!r}")
