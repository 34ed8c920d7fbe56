"""How a client session survives its server: the recovery hooks of Session (a base class
of pytorch_ext/session.py's Session, which it works on: its transport, lock, request ids
and journal).

The session notices a lost server where a send fails, a receive fails (the connection
closed or reset: the server died), or a `device_lost` error arrives, and calls `_lost`.
`_recover` then reconnects (until `recovery_timeout`) to a server that answers at the
session's address again, and replays onto it what the journal kept (recovery.py: the
snapshot, the definitions, the requests since); `_drop_killer` handles the request that
kills the server each time it is replayed. Silence with the connection open is no death
(a frozen server would answer no reconnection either): Session._wait fails at once, and
so does `_lost` for a transport that gave a silent peer up itself (PeerSilent).
See docs/design/recovery.md.
"""

from __future__ import annotations

import itertools
import logging
import time

from ..dataplane import handshake
from ..dataplane import messages as m
from ..dataplane.wire import MsgType
from ..errors import AuthError, PeerSilent, RemoteAccelError, RemoteOpError, TransportError, TransportTimeout
from . import interrupts, recovery

log = logging.getLogger(__package__ + ".session")  # logged as the session: this is part of it


class SessionRecovery:
    """The recovery hooks of a Session; each is a no-op (False) without a journal."""

    def _lost(self, exc: Exception, messages: list) -> None:
        """The server went away while `messages` were sent or answered: recover, then send
        again those of them the journal does not replay (requests with a reply); or fail
        (raises RemoteAccelError as without recovery)."""
        if isinstance(exc, PeerSilent):
            # The transport's own silence limit (DPDK's channel) came before the session's
            # `timeout`: a frozen server, as Session._wait's silence, not a dead one.
            raise self._fail(exc) from exc
        if self.recovers and self._sender is not None and self._sender.in_thread():
            self.transport.close()  # what it sent is in the journal: the user's thread recovers
            return
        requests = [msg for msg in messages if msg[3]]
        while True:
            if not self._recover(exc):
                raise self._fail(exc) from exc
            try:
                if requests:
                    self._transport_send_many(requests)
                return
            except TransportError as again:
                exc = again

    def _recover(self, cause: Exception) -> bool:
        """Rebuild this session on a server that answers at its address again; False: it
        cannot be (no recovery, nothing answered within recovery_timeout, state not kept)."""
        journal = self._journal
        if journal is None or self._dead is not None:
            return False
        why = journal.unrecoverable()
        peer = self.transport.peer
        if why is not None:
            log.error("remote_accel: the server at %s is gone (%s); this session cannot be rebuilt: %s", peer, cause, why)
            return False
        with self._lock:
            self.transport.close()
            if self._sender is not None:
                self._sender.drain()  # what the sender thread still had goes into the journal first
            log.warning("remote_accel: the server at %s is gone (%s); recovering this session, waiting up to %g s "
                        "for a server", peer, cause, self.recovery_timeout)
            start = time.monotonic()
            deadline = start + self.recovery_timeout
            while True:
                self._deaths += 1
                if not self._connect_again(deadline):
                    log.error("remote_accel: no server answered at %s within %g s: this session's tensors are lost",
                              peer, self.recovery_timeout)
                    return False
                replay = recovery.Replay(self.transport, self.timeout, interrupts.pending, next(self._req_ids))
                careful = self._deaths >= 2  # the replayed work killed the server once already
                try:
                    replay.run(journal, careful)
                except recovery.ServerDied as died:
                    self.transport.close()
                    if died.at is None:
                        continue
                    self._drop_killer(died, deadline)  # raises the killer op's error
                except BaseException:
                    self.transport.close()  # a half-replayed server is of no use: the next call starts again
                    raise
                self._req_ids = itertools.count(replay.req_id + 1)
                if careful and self._deaths >= 3:
                    # the journal replays cleanly, one request at a time: what kills the
                    # server is the request the user waits on
                    raise RemoteOpError(f"the request the program waited on killed the server at {peer} each time it "
                                        "was sent; the session is as it was before it")
                ops = recovery.count_ops(journal.entries)
                journal.last_recovery_s = time.monotonic() - start
                journal.recoveries += 1
                journal.replayed_ops += ops
                self._settled = None
                log.warning("remote_accel: recovered the session on %s in %.2f s: restored %d bytes, replayed %d "
                            "requests (%d ops)", self.transport.peer, journal.last_recovery_s,
                            journal.snapshot.nbytes, len(journal.entries), ops)
                return True

    def _drop_killer(self, died: "recovery.ServerDied", deadline: float) -> None:
        """The careful replay found the request that kills the server: bring the session to
        the state just before it on the next server, drop it and what followed, and raise
        its error as CUDA reports a device-side assert."""
        journal = self._journal
        i, k = died.at
        msg_type, _, _, fields = recovery.single_requests(journal.entries[i])[k]
        op = journal.op_name(msg_type, fields)
        while True:
            if not self._connect_again(deadline):
                raise self._fail(RemoteAccelError(f"{op} killed the server, and no server came back"))
            replay = recovery.Replay(self.transport, self.timeout, interrupts.pending, next(self._req_ids))
            try:
                kept = replay.run_prefix(journal, died.at)
                break
            except recovery.ServerDied:
                self.transport.close()
        self._req_ids = itertools.count(replay.req_id + 1)
        journal.keep_only(kept)
        journal.recoveries += 1
        self._deaths = 0
        self._settled = None
        said = f": {died.text}" if died.text else ""
        raise RemoteOpError(f"{op} killed the server at {self.transport.peer}, again when it was replayed{said}. "
                            "The session is as it was before that op; the work queued after it was dropped")

    def _connect_again(self, deadline: float) -> bool:
        """A new transport to a server that completes the handshake, in use; False: none by the deadline."""
        while True:
            if interrupts.pending():
                raise KeyboardInterrupt
            try:
                transport, token, peer_address = self._reconnect()
            except (TransportError, TransportTimeout, OSError) as exc:
                log.debug("reconnecting: %s", exc)
            else:
                try:
                    welcome = handshake.client_handshake(transport, token, self._client, self.timeout,
                                                         server=self.server_name)
                except AuthError:
                    transport.close()
                    raise
                except RemoteAccelError as exc:  # not up yet, busy, or not speaking yet
                    transport.close()
                    log.debug("reconnecting: %s", exc)
                else:
                    if welcome.device.partition(":")[0] != self.device_type:
                        transport.close()
                        log.error("remote_accel: the server that came back computes on %s, not %s", welcome.device,
                                  self.device_type)
                        return False
                    self.transport, self._transport_send_many = transport, transport.send_many
                    self.token, self.welcome = token, welcome
                    if self.peer_address is not None:
                        self.peer_address = peer_address
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)  # in deferred() Ctrl-C only sets the flag looked at above

    def _take_snapshot(self) -> None:
        """Keep the server's state now (a sync point), so that the journal starts afresh."""
        self._snapshotting = True
        try:
            state = self._call(m.State(), m.StateReply)

            def read(sid: int, nbytes: int):
                return self._exchange(MsgType.READ, m.encode_read(sid, 0, nbytes), m.Data).payloads[0]

            self._journal.take_snapshot(state, read)
        finally:
            self._snapshotting = False

