"""A session's receiving side: decode each message as soon as its prologue is in, and
choose where its payloads land (straight into the destination storage where that is
safe, else staging, else nowhere: bytes only thrown away).

`Receiving` is a base of Session (session.py), kept apart because this half runs inside
the transport's recv, as its payload sink, before the message is dispatched. It uses the
session's table, device, `_stash` and `_scan`.

A client cannot make the server hold memory beyond its limit with payloads that land
outside its storages: bytes nobody keeps (a SINK, a write to a storage that failed to
allocate) are read through the transport's small buffer (transport.Discard), and an
echo's payload is charged to the session's memory limit as storages are
(StorageTable.hold) until the echo has been sent back (Session._on_echo). Staged writes
are bounded by the limit (_place says why they are not charged): past it they are thrown
away and reported as out of memory at the next sync, as an allocation past it is; an
echo past it is answered with that error.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Optional


from ..dataplane import messages as m
from ..dataplane.transport import Discard, default_sink
from ..dataplane.wire import MsgType, type_name
from ..errors import ProtocolError
from . import groups, native, peer
from .failure import Failure, oom
from .placement import Desync, WriteTarget, batch_writes, scanned_writes
from .storage import host_bytes

# Logged as the session: placement is part of serving one client.
log = logging.getLogger(__package__ + ".session")

MAX_ECHO_BYTES = 2 << 30


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
        if self.group_grant is not None:  # a peer server's process-group connection
            try:
                msg, plan, buffers = groups.place_link_message(self, header, meta, lengths)
            except ProtocolError as exc:
                raise Desync(f"group connection: {exc}") from None
            self._stash = (header.type, msg, plan)
            return buffers
        if self.copy_grant is not None and header.type != MsgType.PEER_WRITE:
            if lengths:  # a source server's session writes its one copy and nothing else
                raise Desync(f"a copy connection sent a {type_name(header.type)} with payloads")
            self._stash = (header.type, None, None)
            try:
                self._stash = (header.type, m.decode(header.type, meta), None)
            except ProtocolError as exc:
                self._stash = (header.type, exc, None)
            return []
        if header.type == MsgType.BATCH and lengths and self.executor is not None:
            placed = self._place_scanned_batch(header, bytes(meta), lengths)
            if placed is not None:
                return placed
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
            try:
                self.table.hold(header.payload_total)  # released by Session._on_echo
            except Failure as exc:  # read through, and answered with the error
                self._stash = (header.type, oom(f"an ECHO of {header.payload_total} bytes: {exc}"), None)
                return self._discard(lengths)
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
        except ProtocolError as exc:
            self._stash = (header.type, exc, None)
            return self._discard(lengths)
        return self._place_writes(header.type, request, writes, direct, lengths)

    def _place_scanned_batch(self, header, meta: bytes, lengths: list) -> Optional[list]:
        """A Batch with uploads that the C++ scan takes whole: only its WRITE, ALLOC and
        FREE items are decoded here (placement.scanned_writes), and C++ runs the rest
        later (Session._run_native, with these placements for the WRITEs). None: Python
        decodes it as any message, and says what is wrong with it."""
        if not self._scan(meta):
            return None
        writes, direct = scanned_writes(meta, self.executor.native.scanned_items())
        return self._place_writes(header.type, self._stash[1], writes, direct, lengths)

    def _place_writes(self, msg_type: int, request, writes: list, direct: list, lengths: list) -> list:
        """Where each WRITE's payload lands; the stash keeps the request and those places."""
        if len(writes) != len(lengths) or any(w.nbytes != n for w, n in zip(writes, lengths)):
            self._stash = (msg_type, ProtocolError("payload lengths do not match the WRITE sizes"), None)
            return self._discard(lengths)
        staged = sum(n for n, d in zip(lengths, direct) if not d or self.device.accelerator)
        if staged > self.table.limit:
            # Staging (host memory beside a device's, or a CPU server's until the batch's
            # ALLOC has run) lasts until the message is done and is bounded by the limit,
            # not charged to it: an upload is then charged once, as its storage. Past the
            # limit the writes are thrown away and reported as out of memory.
            exc = oom(f"{staged} bytes of WRITE payload to stage at once exceed this session's memory "
                      f"limit ({self.table.limit} bytes)")
            self._stash = (msg_type, request, [WriteTarget(Discard(w.nbytes), error=exc) for w in writes])
            return [Discard(n) for n in lengths]
        plan = [self._write_target(w, ok) for w, ok in zip(writes, direct)]
        self._stash = (msg_type, request, plan)
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
        return [Discard(n) for n in lengths]
