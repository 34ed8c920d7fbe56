"""UDP datagrams of a capture -> Records: DPDK frames, or bare prologues.

A DPDK frame carries one chunk of one message; the chunk at offset 0 starts with the
message's prologue, which may go on in the next chunks when the meta is large. One line
per message (its first frame), plus one per session event (HELLO, ACCEPT, GOODBYE,
RESET); acks, keepalives and continuation chunks only with `all_frames`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from ..dataplane import wire
from ..errors import ProtocolError
from .records import Record, endpoint
from .wire_layers import FRAME_DATA, FRAME_TYPES, FRAME_UDP_PORT, RAFrame, RAHello, RAPrologue

#: prologues still waiting for their next chunks; older ones are forgotten past this
MAX_PENDING = 1024
_EVENTS = {"HELLO", "ACCEPT", "GOODBYE", "RESET"}


class FrameTracker:
    def __init__(self, frame_port: int = FRAME_UDP_PORT, all_frames: bool = False):
        self.frame_port = frame_port
        self.all_frames = all_frames
        # (src, conn, msg_id) -> ({offset: chunk}, (time, header) of the first frame)
        self.pending: OrderedDict[tuple, tuple[dict, Optional[tuple]]] = OrderedDict()
        self.seen: set = set()  # (src, conn, seq) of DATA frames: retransmits show as such

    def records(self, ip, udp, time: float) -> list[Record]:
        src, dst = endpoint(ip.src, udp.sport), endpoint(ip.dst, udp.dport)
        data = bytes(udp.payload)
        size = udp.len - 8 if udp.len else len(data)
        data = data[: max(0, size)]  # without Ethernet padding
        if udp.dport == self.frame_port and data[:2] == RAFrame().magic:
            return self._frame(RAFrame(data), time, src, dst, cut=max(0, size - len(data)))
        if data[:2] == wire.MAGIC:  # a prologue straight in a datagram
            return [_message(data, time, src, dst, "udp")]
        return []

    def _frame(self, f: RAFrame, time: float, src: str, dst: str, cut: int = 0) -> list[Record]:
        kind = FRAME_TYPES.get(f.type, f"type{f.type}")
        info = {"conn": f.conn, "seq": f.seq, "ack": f.ack}
        if cut:
            # the snap length cut the frame: its checksum cannot be checked, but the
            # prologue at its start usually survives
            info["cut"] = cut
        elif not f.crc_ok():
            info.update(type=kind)
            return [Record(time, src, dst, "dpdk", frame=info, note="BAD FRAME CHECKSUM (the receiver drops it)")]
        if f.type != FRAME_DATA:
            if kind in _EVENTS or self.all_frames:
                info["limit"] = f.limit
                if RAHello in f:
                    h = f[RAHello]
                    info.update(max_chunk=h.max_chunk, window=h.window, peer_timeout_ns=h.peer_timeout_ns)
                return [Record(time, src, dst, "dpdk", frame=info, info=f"frame {kind}")]
            return []
        info.update(msg=f.msg_id, off=f.offset, len=f.len)
        retransmit = (src, f.conn, f.seq) in self.seen
        self.seen.add((src, f.conn, f.seq))
        key = (src, f.conn, f.msg_id)
        chunk = f.chunk()
        out: list[Record] = []
        if f.offset == 0 or key in self.pending:
            if retransmit and f.offset == 0:
                info["retransmit"] = 1
            rec = self._prologue(key, f.offset, chunk, time, src, dst, info)
            if rec is not None:
                out.append(rec)
                return out
        if self.all_frames:
            out.append(Record(time, src, dst, "dpdk", frame=info, info="frame DATA"))
        return out

    def _prologue(self, key, offset: int, chunk: bytes, time, src, dst, info) -> Optional[Record]:
        """The message's prologue once its chunks hold all of it (usually the first does).
        The line shows the message's first frame: its time and header."""
        parts, first = self.pending.pop(key, ({}, None))
        parts[offset] = chunk
        if offset == 0:
            first = (time, info)
        data = bytearray()
        while len(data) in parts and parts[len(data)]:
            data += parts[len(data)]
        need = wire.HEADER_SIZE
        if first is not None and len(data) >= need:
            time, info = first
            try:
                need += wire.decode_header(data).rest_len
            except ProtocolError as exc:
                return Record(time, src, dst, "dpdk", frame=info, note=f"not a message: {exc}")
            if len(data) >= need:
                return _message(bytes(data), time, src, dst, "dpdk", info)
        self.pending[key] = (parts, first)
        while len(self.pending) > MAX_PENDING:
            self.pending.popitem(last=False)
        return None


def _message(data: bytes, time: float, src: str, dst: str, proto: str, frame: Optional[dict] = None) -> Record:
    if len(data) < wire.HEADER_SIZE:
        return Record(time, src, dst, proto, frame=frame or {}, note=f"truncated prologue ({len(data)} bytes)")
    pkt = RAPrologue(data)
    return Record(time, src, dst, proto, pkt, pkt.crc_ok(), frame=frame or {})
