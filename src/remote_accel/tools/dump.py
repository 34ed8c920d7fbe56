"""ra-dump: print the remote_accel messages in a packet capture, one line each.

Reads pcap and pcapng files: tcpdump on a loopback or veth (TCP transport) or DPDK's
net_pcap vdev (DPDK frames). Messages whose prologue checksum fails are flagged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..dataplane import messages, wire
from ..errors import ProtocolError
from .capture import CaptureReader
from .records import Record
from .extras import requires
from .wire_layers import FRAME_UDP_PORT

with requires("ra-dump"):
    from scapy.error import Scapy_Exception

BAD_CRC = "!! BAD CHECKSUM"


def meta_summary(rec: Record, width: int) -> str:
    """The message's fields, decoded the way a peer would (never trusting them)."""
    pkt = rec.prologue
    if pkt.type not in wire.KNOWN_TYPES:
        return f"<{len(pkt.meta)} bytes of meta>"
    try:
        text = repr(messages.decode(pkt.type, pkt.meta))
    except ProtocolError as exc:
        text = f"<undecodable meta: {exc}>"
    if width and len(text) > width:
        text = text[: width - 3] + "..."
    return text


def _frame_text(frame: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in frame.items())


def format_line(rec: Record, t0: float, width: int) -> str:
    when = f"{rec.time - t0:12.6f}"
    where = f"{rec.src} > {rec.dst}"
    head = f"{when}  {where}  {rec.proto}"
    if rec.frame:
        head += f" [{_frame_text(rec.frame)}]"
    if rec.note:
        return f"{head}  !! {rec.note}"
    if not rec.is_message:
        return f"{head}  {rec.info}"
    pkt = rec.prologue
    text = (f"{head}  {wire.type_name(pkt.type)} req={pkt.req_id} flags={pkt.flags:#x} "
            f"meta={pkt.meta_len}B payloads={pkt.n_payloads}/{pkt.payload_total}B  {meta_summary(rec, width)}")
    if not rec.crc_ok:
        text += f"  {BAD_CRC}"
    return text


def as_json(rec: Record, t0: float) -> dict:
    out = {"time": rec.time - t0, "src": rec.src, "dst": rec.dst, "proto": rec.proto,
           "frame": rec.frame or None, "note": rec.note or None, "info": rec.info or None}
    pkt = rec.prologue
    if pkt is not None:
        out.update(type=int(pkt.type), type_name=wire.type_name(pkt.type), req_id=pkt.req_id,
                   flags=pkt.flags, meta_len=pkt.meta_len, n_payloads=pkt.n_payloads,
                   payload_total=pkt.payload_total, lengths=list(pkt.lengths), crc_ok=rec.crc_ok,
                   meta=meta_summary(rec, 0))
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ra-dump",
        description="Print the remote_accel messages in a capture (pcap or pcapng), one line "
                    "each: time, source > destination, frame header (DPDK frames), message "
                    "type, request id, sizes and decoded fields. TCP streams are reassembled "
                    "per direction. A message whose checksum fails is marked "
                    f"'{BAD_CRC}'.",
    )
    p.add_argument("file", metavar="FILE.pcap", help="capture file (tcpdump -w, DPDK net_pcap tx_pcap=)")
    p.add_argument("--port", type=int, action="append", metavar="PORT",
                   help="only TCP connections on this port (1-65535, repeatable; default: every "
                        "connection, each checked for remote_accel messages)")
    p.add_argument("--frames", action="store_true",
                   help="DPDK captures: also print acks, keepalives and every chunk of a message, "
                        "not only each message's first frame and the session events")
    p.add_argument("--frame-port", type=int, default=FRAME_UDP_PORT, metavar="PORT",
                   help=f"UDP port of DPDK frames (1-65535; default {FRAME_UDP_PORT})")
    p.add_argument("-c", "--count", type=int, default=0, metavar="N",
                   help="stop after N lines (>= 0; default 0: all)")
    p.add_argument("--width", type=int, default=120, metavar="CHARS",
                   help="cut the decoded fields to this many characters (>= 0; 0: no limit; default 120)")
    p.add_argument("--absolute", action="store_true", help="print capture timestamps (Unix time), "
                   "not seconds since the first packet")
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of text")
    return p


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.count < 0 or args.width < 0:
        parser.error("--count and --width must be >= 0")
    if any(not 0 < p < 65536 for p in [args.frame_port, *(args.port or ())]):
        parser.error("--port and --frame-port must be in 1-65535")
    if not os.path.isfile(args.file):
        print(f"ra-dump: {args.file}: no such file", file=sys.stderr)
        return 1
    reader = CaptureReader(args.file, frozenset(args.port or ()), args.frame_port, args.frames)
    shown = found = bad = problems = 0
    t0 = None
    try:
        for rec in reader:
            if t0 is None:
                t0 = 0.0 if args.absolute else reader.first_time
            shown += 1
            found += rec.is_message
            if (rec.is_message and not rec.crc_ok) or "CHECKSUM" in rec.note:
                bad += 1
            elif rec.note:
                problems += 1
            line = json.dumps(as_json(rec, t0)) if args.json else format_line(rec, t0, args.width)
            print(line)
            if args.count and shown >= args.count:
                break
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (OSError, EOFError, ValueError, Scapy_Exception) as exc:  # unreadable or not a capture
        print(f"ra-dump: cannot read {args.file}: {exc}", file=sys.stderr)
        return 1
    print(f"ra-dump: {found} messages in {reader.packets} packets, {bad} bad checksums, "
          f"{problems} other problems", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
