"""The sessions of this process, one per remote_accel device index.

The bottom of the client: the device modules (fallback, handles, transfer, compile,
device_module) find their session here; `lifecycle.init()` fills it and `shutdown()`
empties it.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

from ..errors import RemoteAccelError
from .session import Session

#: held by init() and shutdown() while they change the sessions
lock = threading.Lock()
_sessions: list[Session] = []
#: Set when the environment names a server and torch autoloaded remote_accel: the first
#: use of the device connects (lifecycle.connect_from_environment), as CUDA initialises
#: lazily. None: only init() connects.
_connect_on_first_use: Optional[Callable[[], None]] = None


def connect_on_first_use(connect: Optional[Callable[[], None]]) -> None:
    global _connect_on_first_use
    _connect_on_first_use = connect


def connects_on_first_use() -> bool:
    """Whether a session will be made from the environment at the first use of the device."""
    return _connect_on_first_use is not None and not _sessions


def add(made: list[Session]) -> None:
    _sessions.extend(made)


def take_all() -> list[Session]:
    """Forget every session and return them (for closing)."""
    taken = list(_sessions)
    _sessions.clear()
    return taken


def is_initialized() -> bool:
    return bool(_sessions)


def session(index: int) -> Session:
    if not _sessions and _connect_on_first_use is not None:
        _connect_on_first_use()
    try:
        return _sessions[index]
    except IndexError:
        if not _sessions:
            raise RemoteAccelError(
                "remote_accel is not initialised: call remote_accel.init(transport=..., ...) first"
            ) from None
        raise RemoteAccelError(f"remote_accel:{index} does not exist ({len(_sessions)} device(s))") from None


def sessions() -> list[Session]:
    return list(_sessions)
