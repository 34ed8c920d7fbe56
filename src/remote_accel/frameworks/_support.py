"""What every framework integration asks: is the device in use, and is this framework's
version one whose code the integration knows."""

from __future__ import annotations

import sys
from typing import Optional

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

#: the device's name, as torch and the frameworks spell it
DEVICE = "remote_accel"


def device_in_use() -> bool:
    """remote_accel is torch's accelerator and can be used: init() connected, or the
    environment names a server the first use will connect to (autoload). The frameworks
    that follow torch.accelerator (accelerate >= 1.16) then pick it, as they pick CUDA."""
    current = torch.accelerator.current_accelerator()
    return current is not None and current.type == DEVICE and torch.accelerator.is_available()


def device_module():
    """torch.remote_accel (registered by the time any integration runs: init() and autoload
    register the device before they install the hook)."""
    return torch.get_device_module(DEVICE)


def unsupported(package: str, supported: str, tested: str) -> Optional[str]:
    """Why `package` (a top-level import name) at its installed version is not one the
    integration knows, or None when it is. Pre-releases of a supported range count as
    supported, so that a framework's main branch can be tried (docs/frameworks.md)."""
    found = getattr(sys.modules.get(package), "__version__", None)
    try:
        version = Version(str(found))
    except InvalidVersion:
        return f"{package} reports no usable version ({found!r}); remote_accel supports {package} {supported}"
    if SpecifierSet(supported).contains(version, prereleases=True):
        return None
    return (f"remote_accel supports {package} {supported} (tested with {tested}), not {package} {version}; "
            f"install a supported release to train on the remote_accel device with {package}")
