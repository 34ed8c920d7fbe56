"""Ctrl-C during a request-reply exchange: deferred to a point where the stream is in step.

A KeyboardInterrupt raised half-way through sending or receiving a message would leave
the byte stream out of step with the server for good. Inside `deferred()`, SIGINT only
sets a flag; the waiting loop looks at it between bounded waits (so it still answers
within a fraction of a second) and raises KeyboardInterrupt there, with whole messages
on both sides. The late reply to the interrupted request is skipped by its request id.
"""

from __future__ import annotations

import _signal
import signal
import threading


class Flag:
    """Set when SIGINT arrived while deferred."""

    __slots__ = ("is_set",)

    def __init__(self) -> None:
        self.is_set = False

    def __call__(self, signum, frame) -> None:  # the deferring SIGINT handler
        self.is_set = True


_NEVER = Flag()  # outside the main thread, or a user's own handler: nothing is deferred


#: The flag of the outermost deferred() of the main thread, while one is active.
_active: "Flag | None" = None


class deferred:
    """Defer Python's default Ctrl-C handling; raise KeyboardInterrupt at the end if one
    came and the body did not raise it itself (checking `flag.is_set`).

    A class, not a generator-based context manager: it runs twice per sync point, and
    contextlib's machinery cost more than the rest of its bookkeeping."""

    __slots__ = ("_flag",)

    def __enter__(self) -> Flag:
        global _active
        main = threading.get_ident() == threading.main_thread().ident  # (a forked child's main too)
        if _active is not None and main:
            self._flag = None  # nested (a sync point's send inside its request): the outer one raises
            return _active
        # Python runs signal handlers in the main thread only, and a handler the user set
        # may do anything: leave both alone. The C-level _signal functions: signal.signal's
        # enum conversions cost more than the rest of a sync point's bookkeeping.
        if not main or _signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            self._flag = None
            return _NEVER
        flag = self._flag = _active = Flag()
        _signal.signal(signal.SIGINT, flag)
        return flag

    def __exit__(self, exc_type, exc, tb) -> None:
        global _active
        flag = self._flag
        if flag is None:
            return
        _active = None
        _signal.signal(signal.SIGINT, signal.default_int_handler)
        if flag.is_set and exc_type is None:
            raise KeyboardInterrupt


def pending() -> bool:
    """Whether Ctrl-C came during the active deferred() (a long wait inside one, such as a
    recovery's reconnecting, looks here between its slices)."""
    flag = _active
    return flag is not None and flag.is_set
