"""The timer flush: a batch that is not full leaves at the latest FLUSH_AFTER_S after the
session's last send, so that the server starts on it while the client keeps tracing:
tracing, the wire and the server's execution overlap instead of taking turns at the
next sync point.
"""

from __future__ import annotations

import threading
import time

from ..errors import RemoteAccelError
from .heartbeat import HEARTBEAT_S

#: A batch that is not full leaves at the latest this long after the last send.
FLUSH_AFTER_S = 0.002


class TimerFlush:
    """The timer flush thread of one session (pytorch_ext/session.py). It reads the
    session's `flush_after` (None stops it: tests that look at the queue), `native_queue`,
    `queued` and `last_send`, and flushes under the session's `lock` without ever waiting
    for it: a thread that holds it (queueing, flushing, waiting at a sync) sends soon anyway.

    While nothing is queued it sleeps in C++ without the GIL (NativeQueue.wait) rather
    than waking every `flush_after`: 500 wake-ups a second, each taking the GIL, cost an
    idle client 86-96 ms of CPU per 5 s (5-9 ms asleep), CPU that a server sharing the
    host wants (docs/performance.md)."""

    def __init__(self, session, lock: threading.RLock, stop: threading.Event):
        self._session = session
        self._lock = lock
        self._stop = stop
        self.thread = threading.Thread(target=self._loop, name="remote_accel-flush", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        session, stop = self._session, self._stop
        while True:
            after = session.flush_after
            queue = session.native_queue
            if after and queue is not None and not session.queued:
                if not queue.wait(HEARTBEAT_S / 2):
                    if stop.is_set():
                        return
                    continue
            if stop.wait(after or HEARTBEAT_S / 2):
                return
            if not session.alive:
                return
            after = session.flush_after
            if not after or time.monotonic() - session.last_send < after or not self._lock.acquire(blocking=False):
                continue
            try:
                session.flush()
            except RemoteAccelError:
                return  # the session is dead: its next call says so
            finally:
                self._lock.release()
