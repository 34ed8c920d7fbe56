"""The protocol's requests and replies: small frozen dataclasses named by verb.

Each class has a wire type (`wire.MsgType`); its fields travel in the meta as a tuple,
in declaration order, encoded by `codec`. `decode` checks the field count and each
field's type, so a server can hand the result to its handlers without trusting the peer.
Tensors travel as `codec.Ext` values defined in `torch_wire.values` (the data plane stays
torch-free). Payload buffers (WRITE data, READ replies, ECHO) travel beside the meta.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from ..errors import ProtocolError
from . import codec
from .wire import MsgType

_REGISTRY: dict[int, type] = {}


def _message(msg_type: MsgType):
    def register(cls):
        cls = dataclass(frozen=True)(cls)
        cls.TYPE = msg_type
        hints = typing.get_type_hints(cls)
        cls._CHECKS = tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))
        _REGISTRY[int(msg_type)] = cls
        return cls

    return register


# -- session control ------------------------------------------------------------------
# The handshake (see `handshake`): HELLO -> CHALLENGE -> AUTH -> WELCOME. The token
# itself never travels, only HMACs of both sides' fresh nonces under it.
@_message(MsgType.HELLO)
class Hello:
    client: str  # free text for the server's log: "host pid"
    wire_version: int
    nonce: bytes  # the client's fresh random nonce
    # A source server that writes one copy into this server: (ticket, nbytes, expires),
    # and the handshake runs under that copy's key instead of the token (handshake.copy_key)
    copy: Any = None
    # "HOST:PORT" the client was told to reach, or "": a DPDK port reaches whichever server
    # is behind it, and one that listens elsewhere refuses (kind "wrong_server")
    server: str = ""
    # A server that carries a process group's data to this one: (group, its rank, the
    # rank here), and the handshake runs under the group key of the rank here instead of
    # the token (handshake.group_key): the connection may deliver that rank's data, and
    # nothing else (server/collectives.py)
    group: Any = None


@_message(MsgType.CHALLENGE)
class Challenge:
    nonce: bytes  # the server's fresh random nonce


@_message(MsgType.AUTH)
class Auth:
    proof: bytes  # the client's HMAC of both nonces under the token


@_message(MsgType.WELCOME)
class Welcome:
    session: int
    device: str  # the torch device the server executes on, e.g. "cuda:0"
    memory_limit: int  # bytes this session may hold; 0: no limit but the device's
    server_version: str
    proof: bytes  # the server's HMAC of both nonces under the token (another label)
    # its TCP listeners, "tcp:HOST:PORT" or "tls:HOST:PORT": where other servers reach it
    # for a copy when this client came over DPDK
    listens: tuple = ()


@_message(MsgType.GOODBYE)
class Goodbye:
    pass


@_message(MsgType.PING)
class Ping:
    nonce: int


@_message(MsgType.PONG)
class Pong:
    nonce: int


@_message(MsgType.ERROR)
class ErrorReply:
    kind: str  # "op", "oom", "auth", "protocol", "unknown_op", "bad_handle", "busy", "device_lost"
    message: str
    trace: str  # the server's traceback, "" when there is none


# -- storage --------------------------------------------------------------------------
@_message(MsgType.ALLOC)
class AllocStorage:
    sid: int
    nbytes: int


@_message(MsgType.FREE)
class FreeStorage:
    sids: tuple


@_message(MsgType.WRITE)
class WriteStorage:
    """Followed by one payload of `nbytes` bytes, written at byte `offset` of storage `sid`."""

    sid: int
    offset: int
    nbytes: int


@_message(MsgType.READ)
class ReadStorage:
    """Answered by Data with one payload, or by ErrorReply (also for deferred errors)."""

    sid: int
    offset: int
    nbytes: int


@_message(MsgType.DATA)
class Data:
    nbytes: int


# -- compute ----------------------------------------------------------------------------
@_message(MsgType.RUN)
class RunOp:
    """Run aten op `op` ("aten::add.Tensor"); bind tensor result i to `outs[i]`.

    `outs[i]` is a tensor reference with the layout the client promised (the server
    copies when the kernel's layout differs), or None for results that alias an input
    or are not tensors. With `reply` set the server answers RunReply with the results'
    metadata instead (data-dependent shapes); the results then wait under the storage
    ids of `outs` (plain ints; a tuple of ids where the result may be sparse, one per
    component, see torch_wire.sparse) until freed. Results are numbered in the op's return
    order with `Tensor[]` returns expanded in place (`split` gives one per piece).
    `stream` names the random stream (a generator reference) of a seeded op that takes
    no generator argument (native_dropout), so a manual_seed on the client reaches it.
    `plan`, an int, also keeps this op under that id for RunPlanned (not with `reply`).
    """

    op: str
    args: tuple
    kwargs: dict
    outs: tuple
    reply: bool = False
    stream: Any = None
    plan: Any = None


@_message(MsgType.RUN_PLANNED)
class RunPlanned:
    """Run again the RunOp that defined `plan`, with `values` in its holes: in wire order,
    every tensor reference in its args, kwargs and outs takes a storage id (int), every
    inline CPU tensor its data (bytes). A repeated op then costs the client and the
    server a few ids instead of its whole description."""

    plan: int
    values: tuple


@_message(MsgType.RUN_REPLY)
class RunReply:
    #: per result: (nbytes, dtype, shape, stride, storage_offset), or a plain value
    results: tuple


@_message(MsgType.BATCH)
class Batch:
    """Several one-way requests in one message: items are (MsgType, fields tuple).

    Only ALLOC, FREE, WRITE, RUN (without reply), RUN_PLANNED and RUN_GRAPH (a rerun by id) may
    appear; WRITE items take the
    batch's payloads in order.
    """

    items: tuple


@_message(MsgType.SYNC)
class Sync:
    pass


@_message(MsgType.SYNC_OK)
class SyncOk:
    ops_done: int


@_message(MsgType.RUN_GRAPH)
class RunGraph:
    """Run a captured aten graph: `nodes` are (op, args, kwargs) with Ext(GRAPH_VALUE, i)
    naming earlier node results; `outs` bind the graph outputs like RunOp.outs.

    Values are numbered `inputs` first, then one per node: Ext(GRAPH_VALUE, i) is value
    i, Ext(GRAPH_VALUE, (i, j)) element j of a multi-result value i. `outputs` name the
    values that `outs` bind. A graph sent once may run again with `nodes` empty (and
    `outputs` empty to reuse the first call's): the server keeps graphs by id per session.
    """

    graph_id: int
    nodes: tuple
    inputs: tuple
    outputs: tuple
    outs: tuple
    stream: Any = None  # the default random stream's reference, as RunOp.stream


# -- device state -------------------------------------------------------------------------
@_message(MsgType.STATS)
class Stats:
    pass


@_message(MsgType.STATS_REPLY)
class StatsReply:
    values: dict


@_message(MsgType.RNG)
class Rng:
    action: str  # "get" | "set"
    generator: Any  # the generator reference, see torch_wire.values
    state: bytes = b""


@_message(MsgType.RNG_REPLY)
class RngReply:
    state: bytes


@_message(MsgType.EMPTY_CACHE)
class EmptyCache:
    pass


@_message(MsgType.EVENT)
class Event:
    """torch.Event on the server device's timeline. "record" is one-way, in order with the
    ops: the server notes when its device reaches it. "query", "synchronize" and
    "elapsed" (milliseconds from `event_id` to `end`) are answered with an EventReply."""

    action: str  # "record" | "query" | "synchronize" | "elapsed"
    event_id: int
    end: int = 0


@_message(MsgType.EVENT_REPLY)
class EventReply:
    value: Any  # query: bool; elapsed: float milliseconds; synchronize: None


# -- recovery: a client rebuilds its session on a new server (pytorch_ext/recovery.py) --------
@_message(MsgType.STATE)
class State:
    """Answered by StateReply: what a snapshot of the session must keep."""


@_message(MsgType.STATE_REPLY)
class StateReply:
    storages: tuple  # (sid, nbytes) of every storage the session holds, in sid order
    generators: tuple  # (gen_id, (seed, epoch) or None, state bytes): every random stream


@_message(MsgType.DEFINE)
class Define:
    """One-way: keep what `meta` describes without running anything: "plan" (the encoded
    RunOp that defined a plan), "graph" (an encoded RunGraph with its nodes), or
    "generators" (StateReply.generators, encoded). A recovering client sends these to a
    new server before it replays the work since its snapshot."""

    kind: str
    meta: bytes


@_message(MsgType.PROFILE)
class Profile:
    """torch.profiler on the client: "start" the server's window, or "stop" it; both
    answered by a ProfileReply (events only for "stop")."""

    action: str


@_message(MsgType.PROFILE_REPLY)
class ProfileReply:
    received: int  # the server's Unix ns when it took the request, and when it answered:
    answered: int  # with the client's send and receive times, its clock's offset (as NTP)
    events: tuple  # (name, start ns, end ns, "op" | "kernel") in the server's Unix time


# -- benchmarking -------------------------------------------------------------------------
@_message(MsgType.ECHO)
class Echo:
    seq: int


@_message(MsgType.ECHO_REPLY)
class EchoReply:
    seq: int


@_message(MsgType.SINK)
class Sink:
    seq: int


# -- server-to-server copies --------------------------------------------------------------
# A copy from server A to server B: the client sends PeerReceive to B and PeerSend to A;
# A connects to B as an ordinary client (the handshake under B's token), sends PeerWrite
# with the bytes, and B answers PeerDone. The bytes never pass through the client. The
# ticket, fresh random bytes from the client, pairs B's PeerWrite with its PeerReceive.
PEER_TICKET_BYTES = 16


@_message(MsgType.PEER_RECEIVE)
class PeerReceive:
    """To the destination: `nbytes` bytes for storage `sid` at byte `offset` will come
    from another server under `ticket`; later requests wait until they are in. `source`:
    that server's "host:port", where the client knows it, so that a wait for a source
    that died ends soon (server/peer.py) instead of at the copy's timeout."""

    ticket: bytes
    sid: int
    offset: int
    nbytes: int
    source: Any = None


@_message(MsgType.PEER_SEND)
class PeerSend:
    """To the source: send `nbytes` bytes of storage `sid` from byte `offset` to the
    server at `address` ("host:port", TCP), under `ticket`, authenticating with `key`:
    handshake.copy_key(the destination's token, ticket, nbytes, expires), good for this
    one copy until `expires` (Unix seconds). The destination's token never leaves the client.
    `tls_ca`: for a destination that speaks TLS, the PEM text of the CA the client checks
    its certificate with (public; the source checks the destination by it too)."""

    ticket: bytes
    sid: int
    offset: int
    nbytes: int
    address: str
    key: str
    expires: int
    tls_ca: Any = None


@_message(MsgType.PEER_WRITE)
class PeerWrite:
    """From the source to the destination, followed by one payload of `nbytes` bytes.

    The first write of a copy connection is the copy its handshake named. A source keeps
    the connection for its next copies to the same server (server/peer.py); each later
    write proves its own key: `proof` = handshake.write_proof(its key, the WELCOME proof
    of this connection), good until `expires`, so that it cannot be replayed on another
    connection and the key never crosses the wire."""

    ticket: bytes
    nbytes: int
    expires: int = 0
    proof: bytes = b""


@_message(MsgType.PEER_DONE)
class PeerDone:
    nbytes: int


# -- collectives of a torch.distributed process group (server/collectives.py) ----------------------
# Each rank's client joins its server to the group (CollJoin) and queues collectives like
# ops (Collective); the servers move the data among themselves, each over a connection of
# its own to each peer, authenticated under the destination rank's group key.
GROUP_ID_BYTES = 16
#: lanes of a group's data: its collectives (every rank in the same order) and its
#: point-to-point messages (numbered per pair of ranks)
LANE_COLLECTIVE = 0
LANE_P2P = 1


@_message(MsgType.COLL_JOIN)
class CollJoin:
    """One-way, in order with the ops: this session is rank `rank` of `size` in process
    group `group` (fresh random bytes from the group's rank 0, shared through torch's
    store). `peers[r]` = (address, key, tls_ca) of rank r's server: its "host:port" TCP
    listener, the group key that server derives from its token for (group, r)
    (handshake.group_key), and the PEM text of the CA its TLS certificate is checked by
    (None: plain TCP). `timeout`: seconds a collective may wait for the other ranks (the
    group's timeout); `silence`: seconds a peer server may stay silent before it counts
    as dead or frozen."""

    group: bytes
    rank: int
    size: int
    peers: tuple
    timeout: float
    silence: float


@_message(MsgType.COLLECTIVE)
class Collective:
    """One-way, in order with the ops: collective `kind` ("all_reduce", "broadcast",
    "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter",
    "barrier", "send", "recv") number `seq` of the group, over tensor references:
    `tensors` are the inputs (and the results of the in-place kinds), `outputs` the
    results of the others. `op` names the reduction ("sum", "avg", "product", "min",
    "max", "band", "bor", "bxor"; "" where none), `root` the root rank, or the peer of
    send and recv. `params`: what a kind needs besides (all_to_all's split sizes)."""

    group: bytes
    seq: int
    kind: str
    op: str
    tensors: tuple
    outputs: tuple
    root: int = 0
    params: Any = None


@_message(MsgType.COLL_DATA)
class CollData:
    """Server to server, on a group connection, followed by one payload of `nbytes`
    bytes: part `step` of the sender's collective `seq` in `lane` (LANE_COLLECTIVE or
    LANE_P2P). `signature` = (kind, op, dtype, elements) of the sender's collective: the
    receiver compares it with its own, so that ranks that disagree fail saying how,
    instead of reducing mismatched bytes."""

    lane: int
    seq: int
    step: int
    nbytes: int
    signature: tuple


@_message(MsgType.COLL_ABORT)
class CollAbort:
    """Server to server: the sender's rank cannot go on with the group (`reason`); every
    collective of the group, now and later, fails with it."""

    reason: str


# -- encoding -------------------------------------------------------------------------------
ONE_WAY_IN_BATCH = frozenset({MsgType.ALLOC, MsgType.FREE, MsgType.WRITE, MsgType.RUN, MsgType.RUN_PLANNED,
                              MsgType.RUN_GRAPH})


def fields_of(msg) -> tuple:
    return tuple(getattr(msg, name) for name, _ in msg._CHECKS)


def encode(msg) -> bytes:
    return codec.encode(fields_of(msg))


def decode(msg_type: int, meta) -> Any:
    """Meta bytes of a message of `msg_type` -> its dataclass; ProtocolError if invalid."""
    try:
        cls = _REGISTRY[msg_type]
    except KeyError:
        raise ProtocolError(f"unknown message type {msg_type}") from None
    return from_fields(cls, codec.decode(meta))


def from_fields(cls, values) -> Any:
    if type(values) is not tuple:
        raise ProtocolError(f"{cls.__name__}: meta is not a tuple of fields")
    checks = cls._CHECKS
    required = sum(1 for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING)
    if not required <= len(values) <= len(checks):
        raise ProtocolError(f"{cls.__name__}: expected {len(checks)} fields, got {len(values)}")
    for (name, kind), value in zip(checks, values):
        if kind is Any:
            continue
        if kind is int and type(value) is not int or kind is not int and not isinstance(value, kind):
            raise ProtocolError(f"{cls.__name__}.{name}: expected {kind.__name__}, got {type(value).__name__}")
    return cls(*values)


def encode_read(sid: int, offset: int, nbytes: int) -> bytes:
    """encode(ReadStorage(sid, offset, nbytes)) without the generic walk: every `.item()`
    and small `.cpu()` sends one."""
    return _READ_HEADER + codec.encode_int(sid) + codec.encode_int(offset) + codec.encode_int(nbytes)


_READ_HEADER = codec.tuple_header(3)


def batch_items(batch: Batch) -> list:
    """Decode a Batch's items into request dataclasses, rejecting types not allowed there."""
    out = []
    for item in batch.items:
        if type(item) is not tuple or len(item) != 2 or type(item[0]) is not int:
            raise ProtocolError("Batch item is not a (type, fields) pair")
        msg_type, values = item
        if msg_type not in ONE_WAY_IN_BATCH:
            raise ProtocolError(f"message type {msg_type} is not allowed inside a Batch")
        out.append(from_fields(_REGISTRY[msg_type], values))
    return out


def batch_item(msg) -> tuple:
    return (int(msg.TYPE), fields_of(msg))


def encoded_batch(n_items: int, items: bytes) -> bytes:
    """encode(Batch(...)) from its items' encodings back to back (a client queues requests
    encoded, some of them in C++)."""
    return codec.tuple_header(1) + codec.tuple_header(n_items) + items
