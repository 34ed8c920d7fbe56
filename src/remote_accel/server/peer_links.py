"""A source server's connections to the destinations of its copies, kept between copies.

A connection and its handshake cost 1.6-2.3 ms on loopback, more than the bytes of a
small copy, and a DataParallel step makes several copies between the same servers: so a
source keeps each connection it made (peer.py's `_connect`) for its next copies to the
same destination (by address and TLS CA), KEEP_LINK_S after its last copy, and a
janitor thread closes it then, so that the destination does not keep a copy session for
nothing. A kept connection is used again only while it is open and quiet.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

from ..dataplane import messages as m
from ..dataplane.wire import MsgType
from ..errors import TransportTimeout

#: A source keeps a connection to a destination this long after its last copy, for the
#: next (several per DataParallel step); at most LINKS_KEPT_PER_DESTINATION of them, one
#: per session copying there at the same time. A destination ends a copy connection idle
#: for peer.COPY_IDLE_S (or its heartbeat timeout), which a source that went away leaves
#: behind. A copy connection is no client of the destination: it takes no --max-clients
#: slot (Server.admit).
KEEP_LINK_S = 10.0
LINKS_KEPT_PER_DESTINATION = 4


class KeptLink:
    """A source's authenticated connection to a destination, between copies."""

    __slots__ = ("link", "binding", "idle_since")

    def __init__(self, link, binding: bytes):
        self.link = link
        self.binding = binding  # its WELCOME proof: later copies prove their keys over it
        self.idle_since = time.monotonic()


class KeptLinks:
    """A server's kept connections to destinations, by (address, TLS CA text)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._kept: dict[tuple, list[KeptLink]] = {}
        self._janitor: Optional[threading.Thread] = None  # closes kept connections once idle too long

    def count(self) -> int:
        with self._cond:
            return sum(len(links) for links in self._kept.values())

    def take(self, where: tuple) -> Optional[KeptLink]:
        """A kept connection to the destination `where`, still open and quiet, for this
        copy alone; None when there is none (the caller connects)."""
        stale = []
        try:
            with self._cond:
                self._expire(stale)
                links = self._kept.get(where, [])
                while links:
                    kept = links.pop()
                    if _quiet(kept.link):
                        return kept
                    stale.append(kept)
            return None
        finally:
            _close_all(stale)

    def keep(self, where: tuple, kept: KeptLink) -> None:
        """A copy to `where` over `kept` is done: keep the connection for the next copy to
        the same destination (or close it, past LINKS_KEPT_PER_DESTINATION)."""
        kept.idle_since = time.monotonic()
        stale = []
        with self._cond:
            self._expire(stale)
            links = self._kept.setdefault(where, [])
            if len(links) < LINKS_KEPT_PER_DESTINATION:
                links.append(kept)
                if self._janitor is None:
                    self._janitor = threading.Thread(target=self._close_idle_links, name="peer-links", daemon=True)
                    self._janitor.start()
            else:
                stale.append(kept)
        _close_all(stale)

    def close_all(self) -> None:
        """At shutdown: every kept connection, each with a GOODBYE."""
        with self._cond:
            stale = [k for links in self._kept.values() for k in links]
            self._kept.clear()
        _close_all(stale)

    def _close_idle_links(self) -> None:
        """The janitor: closes each kept connection KEEP_LINK_S after its last copy; ends
        once none is kept (the next kept connection starts another)."""
        while True:
            stale = []
            with self._cond:
                self._expire(stale)
                if not self._kept and not stale:
                    self._janitor = None
                    return
                if not stale:
                    oldest = min(k.idle_since for links in self._kept.values() for k in links)
                    self._cond.wait(max(0.01, oldest + KEEP_LINK_S - time.monotonic()))
            _close_all(stale)

    def _expire(self, stale: list) -> None:
        """Move connections idle for KEEP_LINK_S into `stale` (held: self._cond)."""
        oldest = time.monotonic() - KEEP_LINK_S
        for where in list(self._kept):
            links = self._kept[where]
            stale.extend(k for k in links if k.idle_since < oldest)
            links[:] = [k for k in links if k.idle_since >= oldest]
            if not links:
                del self._kept[where]


def _quiet(link) -> bool:
    """Whether a kept connection is still open with nothing to read but heartbeats (a
    busy destination's session beats while it waits for a copy's other half, and a
    last beat may follow its PeerDone): a destination that ended the connection (shut
    down, or found it idle too long) left an end of stream behind."""
    if link.closed:
        return False
    try:
        while link.recv(timeout=0).type == MsgType.PONG:
            pass
    except TransportTimeout:
        return True
    except Exception:  # noqa: BLE001 (an end of stream, a reset: the link is done)
        return False
    return False  # anything else out of turn: the connection is not trusted again


def _close_all(kept: list) -> None:
    for k in kept:
        try:
            k.link.send(MsgType.GOODBYE, m.encode(m.Goodbye()))
        except Exception:  # noqa: BLE001 (closing a connection that may be gone)
            pass
        k.link.close()
