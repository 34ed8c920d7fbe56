"""UDP datagrams of a capture -> Records.

A datagram whose data starts with a message prologue is dissected as one message.
"""

from __future__ import annotations

from typing import Optional

from ..dataplane import wire
from .capture import Record, endpoint
from .wire_layers import RAPrologue


def records(ip, udp, time: float, frame_port: Optional[int] = None) -> list[Record]:
    src, dst = endpoint(ip.src, udp.sport), endpoint(ip.dst, udp.dport)
    data = bytes(udp.payload)[: max(0, udp.len - 8)] if udp.len else bytes(udp.payload)
    if data[:2] != wire.MAGIC:
        return []
    return [_message(data, time, src, dst, "udp")]


def _message(data: bytes, time: float, src: str, dst: str, proto: str, frame: dict | None = None) -> Record:
    if len(data) < wire.HEADER_SIZE:
        return Record(time, src, dst, proto, frame=frame or {}, note=f"truncated prologue ({len(data)} bytes)")
    pkt = RAPrologue(data)
    return Record(time, src, dst, proto, pkt, pkt.crc_ok(), frame=frame or {})
