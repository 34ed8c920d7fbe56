"""The remote_accel wire format: one message layout for every transport.

A message is a *prologue* followed by its payloads, back to back:

    header   28 bytes, network byte order (HEADER below)
    lengths  n_payloads x u64, network byte order: the length of each payload
    meta     meta_len bytes: the message's fields, encoded by `codec`
    payloads the raw payload bytes (tensor data is little-endian, as in memory)

The header's CRC32C covers the header (with its crc field zero), the length table and
the meta. Payload bytes are protected by the link: TCP's own checksum, or the CRC32C
that the DPDK transport puts on every frame. Every length is checked against `Limits`
before anything is allocated for it.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import crc32c as _crc32c

from ..errors import MessageTooLarge, ProtocolError
from .._version import WIRE_VERSION

MAGIC = b"RA"
#: magic, version, type, flags, n_payloads, req_id, meta_len, payload_total, crc32c
HEADER = struct.Struct("!2sBBHHIIQI")
HEADER_SIZE = HEADER.size
_CRC_OFFSET = HEADER_SIZE - 4
_LENGTH = struct.Struct("!Q")


class MsgType(enum.IntEnum):
    """Every message type on the wire. Numbers are part of the format: never reuse one."""

    # session control
    HELLO = 1
    WELCOME = 2
    GOODBYE = 3
    PING = 4
    PONG = 5
    ERROR = 6
    CHALLENGE = 7
    AUTH = 8
    # storage
    ALLOC = 16
    FREE = 17
    WRITE = 18
    READ = 19
    DATA = 20
    # compute
    RUN = 32
    BATCH = 33
    SYNC = 34
    SYNC_OK = 35
    RUN_REPLY = 36
    RUN_GRAPH = 37
    RUN_PLANNED = 38
    # device state
    STATS = 48
    STATS_REPLY = 49
    RNG = 50
    RNG_REPLY = 51
    EMPTY_CACHE = 52
    EVENT = 53
    EVENT_REPLY = 54
    # a client's recovery (pytorch_ext/recovery.py): read a session's state, rebuild it
    STATE = 55
    STATE_REPLY = 56
    DEFINE = 57
    # torch.profiler's window on the server (server/profiling.py)
    PROFILE = 58
    PROFILE_REPLY = 59
    # benchmarking: the peer answers ECHO with ECHO_REPLY carrying the same payloads
    ECHO = 64
    ECHO_REPLY = 65
    # one-way bulk traffic for benchmarks; the receiver only counts it
    SINK = 66
    # server-to-server copies (`peer`): the client tells the destination to expect bytes
    # and the source to send them; the source connects to the destination as a client
    PEER_RECEIVE = 80
    PEER_SEND = 81
    PEER_WRITE = 82
    PEER_DONE = 83
    # collectives of a torch.distributed process group (server/collectives.py): a client
    # joins its rank's server to a group and queues collectives like ops; servers move
    # the data among themselves (COLL_DATA, COLL_ABORT on their own connections)
    COLL_JOIN = 96
    COLLECTIVE = 97
    COLL_DATA = 98
    COLL_ABORT = 99


KNOWN_TYPES = frozenset(int(t) for t in MsgType)


@dataclass(frozen=True)
class Limits:
    """Upper bounds checked before allocation. Both peers must agree on them."""

    max_meta: int = 16 << 20
    max_payloads: int = 4096
    max_payload_total: int = 64 << 30

    def check(self, meta_len: int, n_payloads: int, payload_total: int) -> None:
        if meta_len > self.max_meta:
            raise MessageTooLarge(f"meta of {meta_len} bytes exceeds the limit of {self.max_meta}")
        if n_payloads > self.max_payloads:
            raise MessageTooLarge(f"{n_payloads} payloads exceed the limit of {self.max_payloads}")
        if payload_total > self.max_payload_total:
            raise MessageTooLarge(
                f"payload of {payload_total} bytes exceeds the limit of {self.max_payload_total}"
            )


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class Header:
    type: int
    flags: int
    n_payloads: int
    req_id: int
    meta_len: int
    payload_total: int
    crc: int

    @property
    def rest_len(self) -> int:
        """Bytes of the prologue after the fixed header: length table and meta."""
        return 8 * self.n_payloads + self.meta_len


def crc32c(data, value: int = 0) -> int:
    return _crc32c.crc32c(data, value)


def encode_prologue(
    msg_type: int,
    meta: bytes,
    lengths: list[int],
    *,
    req_id: int = 0,
    flags: int = 0,
    limits: Limits = DEFAULT_LIMITS,
) -> bytes:
    """Header + length table + meta, with the CRC filled in."""
    total = sum(lengths)
    limits.check(len(meta), len(lengths), total)
    if not 0 <= req_id < 1 << 32:
        raise ValueError(f"req_id {req_id} does not fit in 32 bits")
    table = b"".join(_LENGTH.pack(n) for n in lengths)
    head = HEADER.pack(MAGIC, WIRE_VERSION, msg_type, flags, len(lengths), req_id, len(meta), total, 0)
    crc = crc32c(meta, crc32c(table, crc32c(head)))
    return head[:_CRC_OFFSET] + crc.to_bytes(4, "big") + table + meta


def decode_header(data, limits: Limits = DEFAULT_LIMITS) -> Header:
    """Parse and sanity-check the fixed header; raises ProtocolError / MessageTooLarge."""
    if len(data) < HEADER_SIZE:
        raise ProtocolError(f"truncated header: {len(data)} of {HEADER_SIZE} bytes")
    magic, version, msg_type, flags, n_payloads, req_id, meta_len, total, crc = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}: not a remote_accel message")
    if version != WIRE_VERSION:
        raise ProtocolError(f"wire version {version} is not supported (this side speaks {WIRE_VERSION})")
    limits.check(meta_len, n_payloads, total)
    return Header(msg_type, flags, n_payloads, req_id, meta_len, total, crc)


def decode_rest(header: Header, head_bytes, rest) -> tuple[list[int], bytes]:
    """Check the CRC over header+rest and split rest into (payload lengths, meta)."""
    if len(rest) != header.rest_len:
        raise ProtocolError(f"prologue is {len(rest)} bytes, header says {header.rest_len}")
    zeroed = bytes(head_bytes[:_CRC_OFFSET]) + b"\0\0\0\0"
    if crc32c(rest, crc32c(zeroed)) != header.crc:
        raise ProtocolError("header checksum mismatch (corrupted message)")
    n = header.n_payloads
    lengths = [v for (v,) in _LENGTH.iter_unpack(bytes(rest[: 8 * n]))] if n else []
    if sum(lengths) != header.payload_total:
        raise ProtocolError("payload lengths do not add up to the header's total")
    return lengths, bytes(rest[8 * n :])


def decode_prologue(data, limits: Limits = DEFAULT_LIMITS) -> tuple[Header, list[int], bytes, int]:
    """Parse a whole prologue held in one buffer; returns (header, lengths, meta, bytes used)."""
    header = decode_header(data, limits)
    end = HEADER_SIZE + header.rest_len
    if len(data) < end:
        raise ProtocolError(f"truncated prologue: {len(data)} of {end} bytes")
    lengths, meta = decode_rest(header, data[:HEADER_SIZE], data[HEADER_SIZE:end])
    return header, lengths, meta, end


def type_name(msg_type: int) -> str:
    try:
        return MsgType(msg_type).name
    except ValueError:
        return f"UNKNOWN({msg_type})"
