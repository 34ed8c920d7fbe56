"""Beats that tell a client its server is alive while a session works on a request.

A client waiting for a long op hears nothing else for as long as the op runs; its
`timeout` is a limit on silence, so the beats let it wait for work of any length while
a dead or frozen (SIGSTOP) server is still detected within that timeout. A beat is an
unsolicited PONG with request id 0, which every client skips. It runs in a thread of its
own, so it does not depend on how the session's executor runs ops: it needs the GIL
only for a moment per beat, and ops release the GIL while their kernels run.
"""

from __future__ import annotations

import threading
import time

from ..dataplane import messages as m
from ..dataplane.transport import Transport
from ..errors import TransportError

#: How often a busy session beats. Clients wait `timeout` (10 s by default, a few seconds
#: in tests) of silence before they give up: several beats fit in it.
HEARTBEAT_S = 0.5
_PONG = m.encode(m.Pong(0))


def _never() -> bool:
    return False


class Heartbeat:
    def __init__(self, transport: Transport, name: str, interval: float = HEARTBEAT_S):
        self.transport = transport
        self.interval = interval
        self.busy = False  # set by the session while it handles a request
        #: also busy while this returns True (the session's C++ loop running a batch)
        self.native_busy = _never
        #: sends one PONG; a session whose C++ loop also sends replaces it (serialised with it)
        self.send_pong = lambda: transport.send(m.Pong.TYPE, _PONG)
        self.last_send = time.monotonic()  # updated by the session after each reply
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._ended.set()

    def _loop(self) -> None:
        # Beats only while busy: an idle client reads nothing, and beats would pile up in
        # its receive buffer. The transport serialises sends: a beat never splits a reply.
        while not self._ended.wait(self.interval / 2):
            if (self.busy or self.native_busy()) and time.monotonic() - self.last_send >= self.interval:
                try:
                    self.send_pong()
                except TransportError:  # the client is gone (transport.peer_gone) or stopped reading
                    return
                self.last_send = time.monotonic()
