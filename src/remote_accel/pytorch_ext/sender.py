"""A TCP session's sender thread and its outbox.

Over TCP, Batches leave from a thread of their own: a send on loopback also runs the
receiver's network stack, which cost the tracing thread about a third of its time
(py-spy); the socket call releases the GIL, so tracing goes on meanwhile. Each entry of
the outbox is a list of (type, meta, payloads, req_id) messages that leave in one
transport call. Every message a session sends itself waits until the entries posted
before it are gone (`drain`), so the order on the wire stays the order of the calls.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable

from ..errors import RemoteAccelError
from .heartbeat import HEARTBEAT_S


class Sender:
    """The sender thread of one session. `send(messages)` sends one entry in the thread
    (the session's own send, which marks the session dead when it fails); `stop` is the
    session's stop event."""

    def __init__(self, send: Callable[[list], None], stop: threading.Event):
        self._send = send
        self._stop = stop
        self._outbox: collections.deque = collections.deque()
        self._cv = threading.Condition(threading.Lock())
        self._sending = False
        self.thread = threading.Thread(target=self._loop, name="remote_accel-send", daemon=True)
        self.thread.start()

    def post(self, messages: list) -> bool:
        """Hand `messages` to the thread, to leave in one transport call after the entries
        posted before; False when the thread has stopped (the caller sends them)."""
        with self._cv:
            if self._stop.is_set():
                return False
            self._outbox.append(messages)
            self._cv.notify()
        return True

    def idle(self) -> bool:
        """Nothing posted is still on its way: a message sent from the caller's thread now
        leaves after everything posted before it."""
        with self._cv:
            return not self._outbox and not self._sending

    def drain(self) -> None:
        """Wait until every posted entry is sent (or failed: the session is then dead)."""
        with self._cv:
            while self._outbox or self._sending:
                self._cv.wait()

    def in_thread(self) -> bool:
        return threading.current_thread() is self.thread

    def wake(self) -> None:
        """End the thread now, not at its next wake-up (the session's stop event is set)."""
        with self._cv:
            self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._outbox and not self._stop.is_set():
                    self._cv.wait(HEARTBEAT_S / 2)  # close() wakes it at once
                if not self._outbox:
                    return  # stopped, and nothing left: post() answers False from now on
                messages = self._outbox.popleft()
                self._sending = True
            try:
                self._send(messages)
            except RemoteAccelError:
                pass  # the session is dead now: its next call raises
            finally:
                with self._cv:
                    self._sending = False
                    self._cv.notify_all()
