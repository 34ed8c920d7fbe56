"""torch's device-backend autoload: `import torch` alone makes remote_accel the accelerator.

torch (>= 2.5) calls `autoload()` for every entry point of group `torch.backends` at the
end of `import torch` (pyproject.toml; TORCH_DEVICE_BACKEND_AUTOLOAD=0 turns all of them
off). A process configured for a server, by REMOTE_ACCEL_SERVER and/or
REMOTE_ACCEL_TRANSPORT (the variables init() reads), gets the device at once:
`torch.accelerator.current_accelerator()` is remote_accel and `is_available()` True, and
the first use of the device connects (as CUDA initialises lazily), so an unchanged script
that picks its device with torch.accelerator trains on the server.

A module of its own, outside the remote_accel package: a process that names no server
imports this file and nothing else (no package, no C++ extension, no thread), so that a
later `import remote_accel` of its own runs as it always does, with torch loaded. A
server process (remote_accel.server imported first) never becomes a client of itself.
"""

from __future__ import annotations

import os
import sys
import warnings

#: the variables that name a server (remote_accel.config's ENV_SERVER and ENV_TRANSPORT;
#: read here without importing the package)
SERVER_VARIABLES = ("REMOTE_ACCEL_SERVER", "REMOTE_ACCEL_TRANSPORT")


def configured() -> bool:
    return any(os.environ.get(name, "").strip() for name in SERVER_VARIABLES)


def autoload() -> None:
    hook = sys.modules.get("remote_accel._torch_hook")
    if hook is not None and hook.skipped() or not configured():
        return
    try:
        from remote_accel.pytorch_ext import lifecycle

        lifecycle.connect_on_first_use()
    except Exception as exc:  # never break the user's `import torch`: say why, run without us
        warnings.warn(f"remote_accel: {' or '.join(SERVER_VARIABLES)} name a server, but the remote_accel "
                      f"device could not be set up: {exc}", RuntimeWarning, stacklevel=2)
