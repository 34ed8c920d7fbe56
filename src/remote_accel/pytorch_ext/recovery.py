"""Recovery: a session outlives its server, by snapshot and replay.

The client knows how every storage on the server came to be: it sent every upload and
every op. A session with recovery on keeps, in this process's memory, what a new server
needs to rebuild its state exactly:

- a *snapshot*: the bytes of every storage the session held at one sync point, and the
  state of every random stream (so that dropout draws the same masks again);
- the *definitions* still in use: the RunOp that defined each plan, each compiled graph's
  nodes (replayed work refers to them by id);
- the *journal*: every one-way request sent since the snapshot (batches, uploads, graph
  calls), in order, payloads copied, and the requests with a reply that change state
  (`run_with_reply`, setting a generator's state) once answered.

When the server goes away (killed, crashed, exit 3 after a device-side assert, the
connection lost), the session reconnects to the same address (a supervisor restarts the
server) or to a pool member's replacement, sends the definitions, restores the snapshot,
and replays the journal; the request the user waits on is then sent again. A CPU server
computes bit for bit what it would have: same kernels, same inputs, same random states.

Bounds: the snapshot, journal and definitions together stay within
REMOTE_ACCEL_RECOVERY_MEMORY (checked at sync points). A new snapshot is taken at a sync
point when the journal would pass that bound, or when a minute of work piled up; never
so often that taking snapshots costs more than about 2% of the time between them. A
session whose state cannot be kept within the bound says so in the log, and a later
failure is the plain error. So does a session that received a direct copy from another
server since its last snapshot (its bytes are on no client, and the source's storage may
have changed since): it can be rebuilt again from its next snapshot on.

Replaying work that killed the server kills it again: after a second death with no
progress between, the replay goes carefully (one request at a time, each followed by
a sync) to find the request that kills it; the user then gets that op's error
(RemoteOpError naming it) and the session is what it was just before it.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

from .. import config
from ..dataplane import codec
from ..dataplane import messages as m
from ..dataplane.transport import Transport
from ..dataplane.wire import MsgType
from ..errors import ProtocolError, RemoteAccelError, TransportError, TransportTimeout

log = logging.getLogger("remote_accel")

#: One-way requests that change the server's state: what the journal keeps. (EVENT: only
#: "record" is one-way; PEER_SEND is kept to know a copy left, and skipped by the replay.)
JOURNALED = frozenset(int(t) for t in (MsgType.ALLOC, MsgType.FREE, MsgType.WRITE, MsgType.RUN, MsgType.RUN_PLANNED,
                                        MsgType.BATCH, MsgType.RUN_GRAPH, MsgType.EVENT, MsgType.PEER_RECEIVE))
#: Requests with a reply that change state: kept once answered (queries are not).
JOURNALED_WITH_REPLY = frozenset((int(MsgType.RUN), int(MsgType.RNG)))
#: The server keeps at most this many plans per session, dropping the oldest
#: (server/plan_runs.py MAX_PLANS); the definitions kept here mirror it.
MAX_PLANS = 1 << 16
#: and this many graphs (server/graph_runs.py MAX_GRAPHS)
MAX_GRAPHS = 256
#: A snapshot is due at the next sync point once this much time has passed since the last...
SNAPSHOT_EVERY_S = 60.0
#: ...but snapshots take at most this share of the time between them.
SNAPSHOT_SHARE = 0.02
#: The journal may hold this many bytes before a snapshot is due on its size alone, however
#: small the session is (see Journal.snapshot_due).
JOURNAL_FLOOR = 64 << 20
#: Journal requests sent per transport call during a replay.
REPLAY_CHUNK = 64


def default_memory() -> int:
    """REMOTE_ACCEL_RECOVERY_MEMORY in bytes (default: a quarter of this host's memory)."""
    text = config.setting("REMOTE_ACCEL_RECOVERY_MEMORY")
    if text:
        return config.parse_size(text)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError):
        return 4 << 30


class Borrowed(NamedTuple):
    """A large upload's bytes, kept by reference instead of copied: the bytes (`view`, which
    keeps their memory alive), a weak reference to the caller's CPU tensor (`source`) and
    its version counter when it was sent. Copying every upload would cost as much as
    sending it; torch bumps a tensor's version at every in-place change, so a changed
    source is seen (and a snapshot taken at the next sync point, before which a replay
    would refuse it). Weak: Module.to() hands the parameter objects the remote copies,
    which the journal must not keep alive (their server memory would never be freed)."""

    view: memoryview
    source: Any  # weakref.ref to the tensor
    version: int
    address: int  # where the source's bytes were

    def unchanged(self) -> bool:
        tensor = self.source()
        # gone, or now holding other memory (a parameter after Module.to(), whose optimizer
        # steps then bump its version): it no longer writes the bytes kept here
        return tensor is None or tensor._version == self.version or tensor.data_ptr() != self.address


class ServerDied(Exception):
    """The server went away during a replay (internal: the recovery loop tries again)."""

    def __init__(self, cause: BaseException, at: Optional[tuple] = None, text: str = ""):
        super().__init__(str(cause))
        self.cause = cause
        self.at = at  # careful replay: (entry index, item index) of the request it died on
        self.text = text  # what the server said before it died (a device_lost error), if anything


@dataclass
class Snapshot:
    storages: list = field(default_factory=list)  # (sid, nbytes, data bytes)
    generators: bytes = b""  # Define("generators") meta: every random stream's state
    nbytes: int = 0


class Journal:
    """What a new server needs to rebuild one session: snapshot, definitions, journal."""

    def __init__(self, limit: int):
        self.limit = limit
        self.snapshot = Snapshot()
        self.entries: list = []  # (type, meta, payloads): requests since the snapshot
        self.entry_bytes = 0
        self.synced = 0  # entries[:synced] were followed by a sync: their errors were told
        self.plans: dict[int, bytes] = {}  # plan id -> the encoded RunOp that defined it
        self.graphs: dict[int, bytes] = {}  # graph id -> the encoded RunGraph with its nodes
        self.definition_bytes = 0
        self.copies_in = False  # a direct copy from another server came in since the snapshot
        self.in_group = False  # the session is a rank of a torch.distributed process group
        self.broken: Optional[str] = None  # why the state is not kept now (recovery off till a snapshot)
        self.last_snapshot = time.monotonic()
        self.snapshot_cost = 0.0
        self.recoveries = 0
        self.replayed_ops = 0
        self.snapshots = 0
        self._lent: dict[int, tuple] = {}  # id(view) -> (source tensor, its version, address): see lend()
        self._borrowed: list[Borrowed] = []  # the journal's borrowed payloads
        self.last_recovery_s = 0.0  # the last recovery: from reconnecting to the replay sent

    # -- keeping ------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self.snapshot.nbytes + self.entry_bytes + self.definition_bytes

    def lend(self, view: memoryview, source) -> None:
        """`view`, about to be sent, holds the bytes of CPU tensor `source`: keep it by
        reference (Borrowed) rather than copy it."""
        self._lent[id(view)] = (weakref.ref(source), source._version, source.data_ptr())

    def record(self, messages) -> None:
        """The session's one-way requests, as they leave (Session._transmit)."""
        if self.broken is not None or self.in_group:
            return
        entries = self.entries
        for msg_type, meta, payloads, req_id in messages:
            if req_id or msg_type not in JOURNALED:
                continue
            if payloads:
                payloads = tuple(self._keep(p) for p in payloads)
            if msg_type == MsgType.PEER_RECEIVE:
                self.copies_in = True
            entries.append((msg_type, meta, payloads))
            self.entry_bytes += _entry_bytes(meta, payloads)
        if self.nbytes > self.limit:
            self._break(f"more than REMOTE_ACCEL_RECOVERY_MEMORY ({self.limit} bytes) was sent without a sync point")

    def _keep(self, payload):
        if type(payload) is bytes:
            return payload
        lent = self._lent.pop(id(payload), None)
        if lent is None:
            return bytes(payload)  # the caller's buffer, which may change later: a copy
        kept = Borrowed(payload, *lent)
        self._borrowed.append(kept)
        return kept

    def changed_uploads(self) -> bool:
        """Whether a tensor whose upload the journal borrowed changed in place since. Asked
        at every sync point: the uploads whose tensor is gone (a data loader's last batches)
        can no longer change and are looked at once."""
        self._borrowed = [b for b in self._borrowed if b.source() is not None]
        return any(not b.unchanged() for b in self._borrowed)

    def record_answered(self, msg_type: int, meta: bytes) -> None:
        """A request with a reply that changed the server's state, once answered."""
        if self.broken is None and msg_type in JOURNALED_WITH_REPLY:
            self.entries.append((msg_type, meta, ()))
            self.entry_bytes += len(meta)
        self.synced = len(self.entries)

    def define_plan(self, plan: int, meta: bytes) -> None:
        old = self.plans.get(plan)
        if old is None and len(self.plans) >= MAX_PLANS:  # as the server drops its oldest
            self.definition_bytes -= len(self.plans.pop(next(iter(self.plans))))
        self.plans[plan] = meta
        self.definition_bytes += len(meta) - (len(old) if old is not None else 0)

    def define_graph(self, graph_id: int, meta: bytes) -> None:
        old = self.graphs.pop(graph_id, None)
        if old is not None:
            self.definition_bytes -= len(old)
        while len(self.graphs) >= MAX_GRAPHS:
            self.definition_bytes -= len(self.graphs.pop(next(iter(self.graphs))))
        self.graphs[graph_id] = meta
        self.definition_bytes += len(meta)

    def _break(self, why: str) -> None:
        if self.broken is None:
            log.warning("remote_accel: recovery is off until the next snapshot: %s; if the server dies now, "
                        "this session's tensors are lost", why)
        self.broken = why
        self._forget_entries()

    def joined_group(self) -> None:
        """The session became a rank of a process group: nothing is kept from now on."""
        self.in_group = True
        self.snapshot = Snapshot()
        self._forget_entries()

    def _forget_entries(self) -> None:
        self.entries, self.entry_bytes, self.synced = [], 0, 0
        self._borrowed, self._lent = [], {}

    def keep_only(self, entries: list) -> None:
        """The journal becomes `entries` (a prefix of its requests, Replay.run_prefix's), all
        of them told to the user: what is left after the op that killed the server is dropped."""
        self.entries, self.synced = entries, len(entries)
        self.entry_bytes = sum(_entry_bytes(meta, payloads) for _, meta, payloads in entries)
        kept = {id(p) for _, _, payloads in entries for p in payloads}
        self._borrowed = [b for b in self._borrowed if id(b) in kept]

    def stats(self) -> dict:
        """Session.local_stats' recovery figures."""
        return {"recovery_bytes": self.nbytes, "recoveries": self.recoveries, "replayed_ops": self.replayed_ops,
                "recovery_snapshots": self.snapshots, "recovery_seconds": self.last_recovery_s}

    # -- snapshots ------------------------------------------------------------------------------
    def snapshot_due(self, now: float, live_bytes: int) -> bool:
        """Whether to take a snapshot at this sync point; `live_bytes`: what the session
        holds on the server now (the next snapshot's size)."""
        if self.in_group:
            return False  # nothing to rebuild a group's rank from
        if self._borrowed and self.changed_uploads():
            return True  # the journal no longer holds what was uploaded: keep the server's state now
        afforded = now - self.last_snapshot >= self.snapshot_cost / SNAPSHOT_SHARE
        if self.broken is None and (now - self.last_snapshot < SNAPSHOT_EVERY_S or not self.entries):
            # the next snapshot is read while the old one and the journal are still kept
            if self.entry_bytes > self.limit - self.definition_bytes - self.snapshot.nbytes - live_bytes:
                return True
            # A journal larger than the session's state costs more memory than the snapshot
            # that replaces it: a data loader's fresh batches, each uploaded by reference,
            # stayed alive in it until the limit (a quarter of the host's memory: 4 GB in
            # 12 s of a 3 MiB batch per step). Within the snapshots' share of the time.
            return afforded and self.entry_bytes > max(live_bytes, JOURNAL_FLOOR)
        return afforded

    def take_snapshot(self, state: m.StateReply, read: Callable[[int, int], bytes]) -> None:
        """Keep the server's state now: `state` lists the storages, `read(sid, nbytes)` reads one."""
        start = time.monotonic()
        total = sum(nbytes for _, nbytes in state.storages)
        if total + self.definition_bytes > self.limit:
            self._break(f"the session holds {total} bytes, more than REMOTE_ACCEL_RECOVERY_MEMORY "
                        f"({self.limit} bytes) can keep")
            self.last_snapshot = start
            return
        storages = [(sid, nbytes, read(sid, nbytes)) for sid, nbytes in state.storages]
        self.snapshot = Snapshot(storages, codec.encode(state.generators), total)
        self._forget_entries()
        self.copies_in = False
        if self.broken is not None:
            log.info("remote_accel: recovery is on again (a snapshot of %d bytes fits)", total)
        self.broken = None
        self.last_snapshot = time.monotonic()
        self.snapshot_cost = self.last_snapshot - start
        self.snapshots += 1

    def unrecoverable(self) -> Optional[str]:
        if self.in_group:
            return ("the session is a rank of a torch.distributed process group, whose state lives on every rank's "
                    "server: the group cannot be rebuilt, so every rank fails (torchrun --max-restarts restarts the "
                    "job from its checkpoint)")
        if self.broken is not None:
            return self.broken
        if self.copies_in:
            return "a direct copy from another server came in since the last snapshot (its bytes are on no client)"
        if self.changed_uploads():
            return "a CPU tensor was changed in place after its upload, before a snapshot kept the server's copy"
        return None

    # -- replaying ----------------------------------------------------------------------------------
    def restore_messages(self) -> list:
        """Definitions, then the snapshot: (type, meta, payloads, req_id) to send first."""
        out = [(m.Define.TYPE, m.encode(m.Define("plan", meta)), (), 0) for meta in self.plans.values()]
        out += [(m.Define.TYPE, m.encode(m.Define("graph", meta)), (), 0) for meta in self.graphs.values()]
        for sid, nbytes, data in self.snapshot.storages:
            out.append((m.AllocStorage.TYPE, m.encode(m.AllocStorage(sid, nbytes)), (), 0))
            if nbytes:
                out.append((m.WriteStorage.TYPE, m.encode(m.WriteStorage(sid, 0, nbytes)), (data,), 0))
        if self.snapshot.generators:
            out.append((m.Define.TYPE, m.encode(m.Define("generators", self.snapshot.generators)), (), 0))
        return out

    def op_name(self, msg_type: int, fields: tuple) -> str:
        """The op a journal request runs, for the error of one that kills the server."""
        try:
            if msg_type == MsgType.RUN:
                return str(fields[0])
            if msg_type == MsgType.RUN_PLANNED:
                meta = self.plans.get(fields[0])
                return str(codec.decode(meta)[0]) if meta is not None else f"plan {fields[0]}"
            if msg_type == MsgType.RUN_GRAPH:
                return f"compiled graph {fields[0]}"
        except (ProtocolError, IndexError, TypeError):
            pass
        return MsgType(msg_type).name


#: local_stats' recovery figures of a session without recovery
NO_STATS = {"recovery_bytes": 0, "recoveries": 0, "replayed_ops": 0, "recovery_snapshots": 0,
            "recovery_seconds": 0.0}


def _entry_bytes(meta: bytes, payloads: tuple) -> int:
    """What a journal entry holds: its meta and payloads (a borrowed one's bytes too)."""
    return len(meta) + sum(len(p) if type(p) is bytes else p.view.nbytes for p in payloads)


def single_requests(entry: tuple) -> list:
    """A journal entry as requests of one op each: a Batch's items, each with its payload."""
    msg_type, meta, payloads = entry
    if msg_type != MsgType.BATCH:
        return [(msg_type, meta, payloads, codec.decode(meta))]
    out = []
    writes = iter(payloads)
    for item_type, fields in codec.decode(meta)[0]:
        item_payloads = (next(writes),) if item_type == MsgType.WRITE else ()
        out.append((item_type, codec.encode(fields), item_payloads, fields))
    return out


def count_ops(entries: list) -> int:
    n = 0
    for msg_type, meta, _ in entries:
        if msg_type == MsgType.BATCH:
            n += sum(1 for item_type, _ in codec.decode(meta)[0] if item_type in (MsgType.RUN, MsgType.RUN_PLANNED))
        elif msg_type in (MsgType.RUN, MsgType.RUN_PLANNED, MsgType.RUN_GRAPH):
            n += 1
    return n


class Replay:
    """Sends a journal to a new server and reads what it answers, on one transport.

    `wait_slice` bounds each receive (Ctrl-C is looked at between them); `silence` is how
    long the server may stay silent before it counts as dead."""

    def __init__(self, transport: Transport, silence: float, interrupted: Callable[[], bool], first_req_id: int):
        self.transport = transport
        self.silence = silence
        self.interrupted = interrupted
        self.req_id = first_req_id

    def send(self, messages: list) -> None:
        messages = [(t, meta, [p.view if type(p) is Borrowed else p for p in payloads], req_id)
                    if any(type(p) is Borrowed for p in payloads) else (t, meta, payloads, req_id)
                    for t, meta, payloads, req_id in messages]
        try:
            for i in range(0, len(messages), REPLAY_CHUNK):
                self.transport.send_many(messages[i:i + REPLAY_CHUNK])
        except TransportError as exc:
            raise ServerDied(exc) from exc

    def request(self, msg_type: int, meta: bytes, payloads=()) -> object:
        """Send one request with a reply and wait for it; the decoded reply (errors included)."""
        self.req_id = (self.req_id + 1) & 0xFFFFFFFF or 1
        req_id = self.req_id
        self.send([(msg_type, meta, payloads, req_id)])
        heard = time.monotonic()
        while True:
            if self.interrupted():
                raise KeyboardInterrupt
            if time.monotonic() - heard > self.silence:
                raise ServerDied(TransportTimeout(f"no message for {self.silence:g} s during the replay"))
            try:
                reply = self.transport.recv(timeout=0.1)
            except TransportTimeout:
                continue
            except (TransportError, ProtocolError) as exc:
                raise ServerDied(exc) from exc
            heard = time.monotonic()
            if reply.req_id != req_id:
                continue  # heartbeats; the replies to requests the replay does not wait on
            decoded = m.decode(reply.type, reply.meta) if reply.type != MsgType.DATA else None
            if isinstance(decoded, m.ErrorReply) and decoded.kind == "device_lost":
                raise ServerDied(RemoteAccelError(decoded.message), text=decoded.message)
            return decoded

    def sync(self) -> object:
        return self.request(MsgType.SYNC, m.encode(m.Sync()))

    def run(self, journal: Journal, careful: bool) -> Optional[tuple]:
        """Replay everything; careful: one request at a time, each followed by a sync,
        returning nothing but raising ServerDied with `at` set where the server died."""
        self.send(journal.restore_messages())
        entries = journal.entries
        if not careful:
            pending: list = []  # one-way requests, sent REPLAY_CHUNK to a transport call
            for i, entry in enumerate(entries):
                if _answered(entry):
                    self.send(pending)
                    pending = []
                    self.request(*entry)
                else:
                    pending.append((*entry, 0))
                if i + 1 == journal.synced:
                    # the user was told the errors of the work so far: the server's report of
                    # them again is taken here, not given to the user's next sync
                    self.send(pending)
                    pending = []
                    self.sync()
            self.send(pending)
            return None
        self.sync()
        for i, entry in enumerate(entries):
            for k, (msg_type, meta, payloads, _fields) in enumerate(single_requests(entry)):
                try:
                    self._replay_entry((msg_type, meta, payloads))
                    self.sync()
                except ServerDied as died:
                    died.at = (i, k)
                    raise
        return None

    def run_prefix(self, journal: Journal, at: tuple) -> list:
        """Replay the journal up to request `at` (entry, item), not including it; returns
        the journal entries that make that state (to keep as the new journal)."""
        self.send(journal.restore_messages())
        i, k = at
        for entry in journal.entries[:i]:
            self._replay_entry(entry)
        kept = list(journal.entries[:i])
        for msg_type, meta, payloads, _fields in single_requests(journal.entries[i])[:k]:
            self._replay_entry((msg_type, meta, payloads))
            kept.append((msg_type, meta, payloads))
        self.sync()
        return kept

    def _replay_entry(self, entry: tuple) -> None:
        if _answered(entry):
            self.request(*entry)
        else:
            self.send([(*entry, 0)])


def _answered(entry: tuple) -> bool:
    """Whether a journal entry is a request the server answers (its reply is read and dropped)."""
    msg_type, meta, _ = entry
    if msg_type == MsgType.RNG:
        return True
    return msg_type == MsgType.RUN and bool(codec.decode(meta)[4])  # RunOp.reply
