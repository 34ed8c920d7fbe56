"""Load the C++ part of the remote_accel device (``remote_accel.pytorch_ext._C``).

Importing ``_C`` registers, for PrivateUse1: the allocator, the device guard, the hooks
(generators, pinned host memory), factory and view kernels, and an autocast fallthrough.
It does not rename the backend or register the op fallback: the package's ``__init__``
does that, after :func:`load`.
"""

from __future__ import annotations

import importlib
import types

from ..errors import UnavailableError

__all__ = ["load"]

_REBUILD = (
    "rebuild remote_accel with torch importable at configure time, against the torch you "
    "run: `pip install --no-build-isolation .` (or scripts/dev-build.sh in a checkout)"
)

_module: types.ModuleType | None = None


def load() -> types.ModuleType:
    """Import ``_C`` once and return it.

    Raises UnavailableError when the extension was not built (torch was missing at build
    time), was built against another torch than the one installed now (checked before
    loading it: such a _C may load and crash later), cannot be loaded, or was built for
    another version of the package.
    """
    global _module
    if _module is not None:
        return _module
    from .._version import __version__

    try:
        # torch first: _C links against its libraries and uses its Python types.
        import torch

        check_torch_version(torch.__version__)
        module = importlib.import_module("._C", __package__)
    except UnavailableError:  # an ImportError too: the torch check's own message says it all
        raise
    except ImportError as exc:
        raise UnavailableError(f"the remote_accel C++ device extension is not available ({exc}); {_REBUILD}") from exc
    if module.version() != __version__:
        raise UnavailableError(
            f"the remote_accel C++ device extension was built for version {module.version()}, "
            f"but the package is {__version__}; {_REBUILD}"
        )
    _module = module
    return module


def check_torch_version(installed: str) -> None:
    """Raise UnavailableError unless _C was compiled against torch `installed`.

    Installing another package can move torch under a built remote_accel (pip's
    torchvision upgrades torch to the release it was built for); the C++ API and the
    layout of torch's classes change between releases, so the only safe answer is a
    rebuild."""
    try:
        from ._build_info import TORCH_VERSION
    except ImportError:  # an install older than the version record: _C's own import decides
        return
    if TORCH_VERSION and TORCH_VERSION != installed:
        raise UnavailableError(
            f"remote_accel's C++ device extension was built against torch {TORCH_VERSION}, but torch "
            f"{installed} is installed now. Rebuild remote_accel for the torch now installed: "
            "`pip install --no-build-isolation .` in its source folder (`./quickstart.sh setup` in a checkout)"
        )
