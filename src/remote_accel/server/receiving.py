"""A session's receiving side: decode each message as soon as its prologue is in, and
choose where its payloads land (straight into the destination storage where that is
safe, else staging, else a scratch buffer for bytes only thrown away).

`Receiving` is a base of Session (session.py), kept apart because this half runs inside
the transport's recv, as its payload sink, before the message is dispatched. It uses the
session's table, device, `_stash`, `_scratch`, `_held` and `_scan`.

What a message makes the server hold outside the storages (the scratch buffer, an echo's
payload, a CPU server's staging) is charged to the session's memory limit, as storages
are (StorageTable.hold): a client cannot make the server hold more than its limit by
sending payloads that land anywhere else. Past the limit the session ends with an out of
memory error, since the payload bytes in flight cannot be left unread.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np

from ..dataplane import messages as m
from ..dataplane.transport import default_sink
from ..dataplane.wire import MsgType, type_name
from ..errors import ProtocolError
from . import native, peer
from .failure import Failure
from .placement import Desync, WriteTarget, batch_writes
from .storage import host_bytes

# Logged as the session: placement is part of serving one client.
log = logging.getLogger(__package__ + ".session")

#: Payloads the server only throws away (SINK, a WRITE to a bad handle) land in one
#: reused scratch buffer; one larger than this cannot be taken, and the session ends.
MAX_DISCARD_BYTES = 2 << 30
MAX_ECHO_BYTES = 2 << 30
#: A scratch buffer larger than this is given back after its message instead of kept.
KEEP_SCRATCH_BYTES = 1 << 20


class FastRead(NamedTuple):
    """A READ whose fields C++ read (native.parse_read): three int64s, no decoder run."""

    sid: int
    offset: int
    nbytes: int


class Receiving:
    """The payload sink of a Session (transport.recv(sink=session._sink))."""


    def _sink(self, header, meta: bytes, lengths: list) -> list:
        """Decode the message as soon as its prologue is in, and choose where its payloads
        land: straight into the destination storage where that is safe, else staging.
        Raises only Desync: anything else would leave the payload bytes unread."""
        try:
            return self._place(header, meta, lengths)
        except Desync:
            raise
        except Exception as exc:  # a server bug: report it, keep the stream in step
            log.exception("session %d: placing the payloads of a %s failed", self.number, type_name(header.type))
            self._stash = (header.type, ProtocolError(f"the server could not place this message's payloads: {exc}"),
                           None)
            return self._discard(lengths)

    def _place(self, header, meta: bytes, lengths: list) -> list:
        if self.copy_grant is not None and header.type != MsgType.PEER_WRITE:
            if lengths:  # a source server's session writes its one copy and nothing else
                raise Desync(f"a copy connection sent a {type_name(header.type)} with payloads")
            self._stash = (header.type, None, None)
            try:
                self._stash = (header.type, m.decode(header.type, meta), None)
            except ProtocolError as exc:
                self._stash = (header.type, exc, None)
            return []
        if not lengths:
            if header.type == MsgType.BATCH and self._scan(meta):
                return []
            if header.type == MsgType.READ and type(meta) is bytes:
                fields = native.parse_read(meta)  # None: the decoder below says what is wrong
                if fields is not None:
                    self._stash = (MsgType.READ, FastRead(*fields), None)
                    return []
        try:
            msg = m.decode(header.type, meta)
        except ProtocolError as exc:
            self._stash = (header.type, exc, None)
            return self._discard(lengths)
        self._stash = (header.type, msg, None)
        if header.type == MsgType.ECHO:
            if header.payload_total > MAX_ECHO_BYTES:
                raise Desync(f"ECHO of {header.payload_total} bytes exceeds {MAX_ECHO_BYTES}")
            self._hold(header.payload_total, "an ECHO's payload")
            return default_sink(header, meta, lengths)
        if header.type == MsgType.SINK:
            return self._discard(lengths)
        if header.type == MsgType.PEER_WRITE:
            try:
                buffers, slot = peer.place_write(self, msg, lengths)
            except ProtocolError as exc:
                self._stash = (header.type, exc, None)
                return self._discard(lengths)
            self._stash = (header.type, msg, slot)
            return buffers
        try:
            if header.type == MsgType.WRITE:
                request, writes, direct = msg, [msg], [True]
            elif header.type == MsgType.BATCH:
                request = m.batch_items(msg)
                writes, direct = batch_writes(request)
            elif lengths:
                raise ProtocolError(f"{type_name(header.type)} carries no payloads")
            else:
                return []
            if len(writes) != len(lengths) or any(w.nbytes != n for w, n in zip(writes, lengths)):
                raise ProtocolError("payload lengths do not match the WRITE sizes")
        except ProtocolError as exc:
            self._stash = (header.type, exc, None)
            return self._discard(lengths)
        staged = sum(n for n, d in zip(lengths, direct) if not d or self.device.accelerator)
        if self.device.accelerator:
            # host memory beside a device's: its own limit is the device's, so one
            # message's staging is bounded by it but not charged to it
            if staged > self.table.limit:
                raise Desync(f"{staged} bytes of WRITE payload exceed this session's memory limit", "oom")
        elif staged:
            self._hold(staged, "WRITE payload staged before its storage exists")
        plan = [self._write_target(w, ok) for w, ok in zip(writes, direct)]
        self._stash = (header.type, request, plan)
        return [t.buffer for t in plan]

    def _write_target(self, w: m.WriteStorage, direct: bool) -> "WriteTarget":
        view = None
        if direct:
            try:
                view = self.table.byte_range(w.sid, w.offset, w.nbytes)
            except (Failure, ProtocolError) as exc:
                return WriteTarget(self._discard([w.nbytes])[0], error=exc)
            if not self.device.accelerator:
                # CPU: the storage's own memory; earlier ops of this client have all run.
                return WriteTarget(host_bytes(view))
        staging = self.device.staging(w.nbytes)
        return WriteTarget(host_bytes(staging), view, staging)

    def _discard(self, lengths: list) -> list:
        need = max(lengths, default=0)
        if need > MAX_DISCARD_BYTES:
            raise Desync(f"a payload of {need} bytes cannot be received here")
        if need > self._scratch.nbytes:
            self._hold(need - self._scratch.nbytes, "a payload to throw away")
            self._held -= need - self._scratch.nbytes  # the scratch buffer's, until _received
            self._scratch = np.empty(need, dtype=np.uint8)
        return [self._scratch[:n] for n in lengths]

    def _hold(self, nbytes: int, what: str) -> None:
        """Charge `nbytes` this message makes the server hold until _received()."""
        try:
            self.table.hold(nbytes)
        except Failure:
            raise Desync(f"{what} of {nbytes} bytes would exceed this session's memory limit "
                         f"({self.table.charged()} of {self.table.limit} bytes in use)", "oom") from None
        self._held += nbytes

    def _received(self) -> None:
        """After each message: give back what it held, and a large scratch buffer."""
        if self._held:
            self.table.release(self._held)
            self._held = 0
        if self._scratch.nbytes > KEEP_SCRATCH_BYTES:
            self.table.release(self._scratch.nbytes)
            self._scratch = np.empty(0, dtype=np.uint8)
