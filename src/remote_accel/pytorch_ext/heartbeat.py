"""A client session's heartbeat: a PING whenever the session has sent nothing for a while.

A server frees the memory of a client it has not heard from for its heartbeat timeout
(`--heartbeat-timeout`), so an idle session (a user at a breakpoint, a data loader
that stalls) says it is alive. The server's own heartbeats, which show the client that
a busy server is alive, are server/heartbeat.py's.
"""

from __future__ import annotations

import threading
import time

from ..dataplane import messages as m
from ..dataplane.wire import MsgType
from ..errors import PeerGone, TransportError

#: A session that has sent nothing for this long sends a PING.
HEARTBEAT_S = 2.0


class Heartbeat:
    """The heartbeat thread of one session (pytorch_ext/session.py). It reads the
    session's current transport (recovery replaces it) and `last_send`, and ends when
    `stop` is set, or when a send fails and the session will not recover."""

    def __init__(self, session, stop: threading.Event):
        self._session = session
        self._stop = stop
        self.thread = threading.Thread(target=self._loop, name="remote_accel-heartbeat", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        session, nonce = self._session, 0
        while not self._stop.wait(HEARTBEAT_S / 2):
            if time.monotonic() - session.last_send < HEARTBEAT_S:
                continue
            nonce += 1
            try:
                session.transport.send(MsgType.PING, m.encode(m.Ping(nonce)))
                session.last_send = time.monotonic()
            except (TransportError, PeerGone):
                if not session.recovers:
                    return
                # the session recovers at its next request; heartbeats go on after that
