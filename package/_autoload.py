"""torch's device-backend autoload: `import torch` alone makes remote_accel the accelerator.

torch (>= 2.5) calls `autoload()` for every entry point of group `torch.backends` at the
end of `import torch` (pyproject.toml; TORCH_DEVICE_BACKEND_AUTOLOAD=0 turns all of them
off). A process configured for a server, by REMOTE_ACCEL_SERVER and/or
REMOTE_ACCEL_TRANSPORT (the variables init() reads), gets the device at once:
`torch.accelerator.current_accelerator()` is remote_accel and `is_available()` True, and
the first use of the device connects (as CUDA initialises lazily), so an unchanged script
that picks its device with torch.accelerator trains on the server. Any other process pays
for an import of this small module and nothing else: no C++ extension, no thread. A server
process (remote_accel.server imported first) never becomes a client of itself.
"""

from __future__ import annotations

import warnings

from . import _torch_hook, config


def configured() -> bool:
    """Whether the environment names a server: either variable set (the transport's
    default, auto, counts only when said)."""
    return config.is_set(config.ENV_SERVER) or config.is_set(config.ENV_TRANSPORT)


def autoload() -> None:
    if _torch_hook.skipped() or not configured():
        return
    try:
        from .pytorch_ext import lifecycle

        lifecycle.connect_on_first_use()
    except Exception as exc:  # never break the user's `import torch`: say why, run without us
        warnings.warn(f"remote_accel: {config.ENV_SERVER}/{config.ENV_TRANSPORT} name a server, but the "
                      f"remote_accel device could not be set up: {exc}", RuntimeWarning, stacklevel=2)
