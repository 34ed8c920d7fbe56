"""The sessions of this process, one per remote_accel device index.

The bottom of the client: the device modules (fallback, handles, transfer, compile,
device_module) find their session here; `lifecycle.init()` fills it and `shutdown()`
empties it.
"""

from __future__ import annotations

import threading

from ..errors import RemoteAccelError
from .session import Session

#: held by init() and shutdown() while they change the sessions
lock = threading.Lock()
_sessions: list[Session] = []


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
