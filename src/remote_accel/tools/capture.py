"""Messages out of a packet capture: the library half of `ra-dump`.

TCP carries messages as a byte stream, so each direction of each connection is put
back in order (retransmits dropped, reordered segments held) and then cut into messages
with the lengths in their prologues; payload bytes are skipped, never buffered whole.
UDP datagrams that start with a prologue are dissected one by one; DPDK frames go
through `frames` (their own header first).
"""

from __future__ import annotations

import bisect
from typing import Iterator, Optional

from ..dataplane import wire
from ..errors import ProtocolError
from .frames import FRAME_UDP_PORT, FrameTracker
from .records import Record, endpoint
from .wire_layers import RAPrologue

#: A TCP direction holding this many out-of-order bytes has lost segments for good
#: (tcpdump dropped them): give up on the hole and resynchronise after it.
MAX_HELD_BYTES = 16 << 20
_SEQ_MOD = 1 << 32


def _seq_diff(a: int, b: int) -> int:
    """a - b in sequence space (RFC 1982): negative when a is before b."""
    d = (a - b) % _SEQ_MOD
    return d - _SEQ_MOD if d >= _SEQ_MOD // 2 else d


class MessageSplitter:
    """One ordered byte stream -> Records, one per message prologue."""

    def __init__(self, src: str, dst: str, synced: bool):
        self.src, self.dst = src, dst
        # without the SYN the capture may start mid-message: hunt for a prologue first
        self.synced = synced
        self.buf = bytearray()
        self.offset = 0  # stream offset of buf[0]
        self.skip = 0  # payload bytes still to pass over
        self.starts: list[tuple[int, float]] = []  # (stream offset, time) of each segment
        self.messages = 0

    def feed(self, data: bytes, time: float) -> list[Record]:
        pos = 0
        if self.skip:
            pos = min(self.skip, len(data))
            self.skip -= pos
            self.offset += pos
        if pos < len(data):
            self.starts.append((self.offset + len(self.buf), time))
            self.buf += data[pos:]
        return self._split()

    def gap(self, nbytes: int, time: float, why: str = "missing from the capture") -> list[Record]:
        """`nbytes` of the stream are not in the capture. Inside a payload that costs
        nothing (payload bytes are skipped anyway); otherwise the message being read is
        lost and the next prologue must be found."""
        if nbytes <= self.skip:
            self.skip -= nbytes
            self.offset += nbytes
            return []
        self.offset += len(self.buf) + nbytes
        self.buf.clear()
        self.starts.clear()
        self.skip = 0
        self.synced = False
        if not self.messages:
            return []
        return [Record(time, self.src, self.dst, "tcp", note=f"{nbytes} bytes {why}")]

    def _time_at(self, offset: int) -> float:
        i = bisect.bisect_right(self.starts, (offset, float("inf"))) - 1
        return self.starts[max(i, 0)][1]

    def _consume(self, n: int) -> None:
        del self.buf[:n]
        self.offset += n
        # segment starts before the current offset still time the bytes left in buf
        i = bisect.bisect_right(self.starts, (self.offset, float("inf"))) - 1
        if i > 0:
            del self.starts[:i]

    def _split(self) -> list[Record]:
        out: list[Record] = []
        while True:
            if not self.synced and not self._hunt():
                return out
            if len(self.buf) < wire.HEADER_SIZE:
                return out
            try:
                header = wire.decode_header(self.buf)
            except ProtocolError as exc:
                # a stream that never carried a message is some other protocol: not ours to report
                if self.messages:
                    out.append(Record(self._time_at(self.offset), self.src, self.dst, "tcp",
                                      note=f"not a message at stream offset {self.offset}: {exc}"))
                self.synced = False
                self._consume(1)
                continue
            end = wire.HEADER_SIZE + header.rest_len
            if len(self.buf) < end:
                return out
            pkt = RAPrologue(bytes(self.buf[:end]))
            out.append(Record(self._time_at(self.offset), self.src, self.dst, "tcp", pkt, pkt.crc_ok()))
            self.messages += 1
            self._consume(end)
            n = min(header.payload_total, len(self.buf))
            self._consume(n)
            self.skip = header.payload_total - n

    def _hunt(self) -> bool:
        """Drop bytes up to the next prologue whose checksum holds; True once found."""
        while True:
            i = self.buf.find(wire.MAGIC)
            if i < 0:
                self._consume(max(0, len(self.buf) - 1))
                return False
            self._consume(i)
            if len(self.buf) < wire.HEADER_SIZE:
                return False
            try:
                header = wire.decode_header(self.buf)
            except ProtocolError:
                self._consume(1)
                continue
            end = wire.HEADER_SIZE + header.rest_len
            if len(self.buf) < end:
                return False  # wait for more to check the crc
            if RAPrologue(bytes(self.buf[:end])).crc_ok():
                self.synced = True
                return True
            self._consume(1)


class TcpDirection:
    """One direction of a TCP connection: segments in capture order -> stream bytes in order.

    A segment is (data, cut): `cut` bytes followed `data` on the wire but the capture did
    not keep them (snap length); they count in sequence space as a gap of known size.
    """

    def __init__(self, src: str, dst: str):
        self.src, self.dst = src, dst
        self.next_seq: Optional[int] = None
        self.held: dict[int, tuple[bytes, int, float]] = {}
        self.held_bytes = 0
        self.splitter: Optional[MessageSplitter] = None

    def segment(self, seq: int, syn: bool, data: bytes, time: float, cut: int = 0) -> list[Record]:
        if syn:
            self.next_seq = (seq + 1) % _SEQ_MOD
            self.splitter = MessageSplitter(self.src, self.dst, synced=True)
            seq = self.next_seq
        if not data and not cut:
            return []
        if self.next_seq is None:
            self.next_seq = seq
            self.splitter = MessageSplitter(self.src, self.dst, synced=False)
        ahead = _seq_diff(seq, self.next_seq)
        if ahead > 0:
            self.held[seq] = (data, cut, time)
            self.held_bytes += len(data)
            if self.held_bytes > MAX_HELD_BYTES:
                return self._skip_hole(time)
            return []
        out = self._deliver(-ahead, data, cut, time)
        return out + self._drain()

    def _deliver(self, behind: int, data: bytes, cut: int, time: float) -> list[Record]:
        """Feed a segment that starts `behind` bytes before next_seq (a retransmit or an
        overlap repeats bytes we already have; only what is new goes on)."""
        if behind >= len(data) + cut:
            return []
        out: list[Record] = []
        if behind < len(data):
            new = data[behind:]
            out += self.splitter.feed(new, time)
            self.next_seq = (self.next_seq + len(new)) % _SEQ_MOD
            behind = 0
        else:
            behind -= len(data)
        if cut - behind > 0:
            out += self.splitter.gap(cut - behind, time, why="cut by the capture's snap length")
            self.next_seq = (self.next_seq + cut - behind) % _SEQ_MOD
        return out

    def _drain(self) -> list[Record]:
        out: list[Record] = []
        while True:
            ready = [s for s in self.held if _seq_diff(s, self.next_seq) <= 0]
            if not ready:
                return out
            for s in ready:
                data, cut, t = self.held.pop(s)
                self.held_bytes -= len(data)
                out += self._deliver(-_seq_diff(s, self.next_seq), data, cut, t)

    def _skip_hole(self, time: float) -> list[Record]:
        first = min(self.held, key=lambda s: _seq_diff(s, self.next_seq))
        out = self.splitter.gap(_seq_diff(first, self.next_seq), time, why="missing from the capture")
        self.next_seq = first
        return out + self._drain()

    def finish(self) -> list[Record]:
        out: list[Record] = []
        while self.held:
            out += self._skip_hole(max(t for _, _, t in self.held.values()))
        return out


def tcp_data(ip, tcp) -> tuple[bytes, int]:
    """(the segment's data as captured, how many bytes of it the capture cut off).
    The IP length tells both: Ethernet pads short frames, snap lengths cut long ones."""
    data = bytes(tcp.payload)
    if getattr(ip, "version", 4) == 4:
        size = ip.len - ip.ihl * 4 - tcp.dataofs * 4
    else:  # IPv6 without extension headers; with them, trust the frame
        size = ip.plen - tcp.dataofs * 4 if ip.nh == 6 else len(data)
    size = max(0, size)
    return data[:size], max(0, size - len(data))


class CaptureReader:
    """Packets of a capture file -> Records, in capture order."""

    def __init__(self, path: str, tcp_ports: frozenset = frozenset(), frame_port: Optional[int] = None,
                 all_frames: bool = False):
        self.path = path
        self.tcp_ports = tcp_ports  # only these TCP ports when not empty
        self.frames = FrameTracker(frame_port or FRAME_UDP_PORT, all_frames)
        self.flows: dict[tuple, TcpDirection] = {}
        self.packets = 0
        self.first_time = 0.0

    def __iter__(self) -> Iterator[Record]:
        from scapy.layers.inet import IP, TCP, UDP
        from scapy.layers.inet6 import IPv6
        from scapy.utils import PcapReader

        with PcapReader(self.path) as reader:
            for pkt in reader:
                time = float(pkt.time)
                if not self.packets:
                    self.first_time = time
                self.packets += 1
                ip = pkt.getlayer(IP) or pkt.getlayer(IPv6)
                if ip is None:
                    continue
                if TCP in ip:
                    yield from self._tcp(ip, ip[TCP], time)
                elif UDP in ip:
                    yield from self.frames.records(ip, ip[UDP], time)
        for direction in self.flows.values():
            yield from direction.finish()

    def _tcp(self, ip, tcp, time: float) -> list[Record]:
        if self.tcp_ports and tcp.sport not in self.tcp_ports and tcp.dport not in self.tcp_ports:
            return []
        src, dst = endpoint(ip.src, tcp.sport), endpoint(ip.dst, tcp.dport)
        direction = self.flows.get((src, dst))
        if direction is None or (tcp.flags.S and direction.next_seq is not None):
            direction = self.flows[(src, dst)] = TcpDirection(src, dst)  # a new connection
        data, cut = tcp_data(ip, tcp)
        return direction.segment(tcp.seq, bool(tcp.flags.S), data, time, cut)
