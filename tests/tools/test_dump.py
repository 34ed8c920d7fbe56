"""ra-dump on captures: synthesised TCP streams, a real tcpdump capture, UDP datagrams."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.l2 import Ether
from scapy.utils import wrpcap

from remote_accel.dataplane import messages, wire

CLIENT, SERVER = ("10.0.0.1", 40000), ("10.0.0.2", 18515)


def message(msg, payloads=(), req_id=0) -> bytes:
    meta = messages.encode(msg)
    lengths = [len(p) for p in payloads]
    return wire.encode_prologue(msg.TYPE, meta, lengths, req_id=req_id) + b"".join(payloads)


def corrupt_meta(raw: bytes) -> bytes:
    """Flip one bit of the meta of a whole message (the prologue checksum then fails)."""
    header = wire.decode_header(raw)
    i = wire.HEADER_SIZE + 8 * header.n_payloads
    return raw[:i] + bytes([raw[i] ^ 0x40]) + raw[i + 1:]


class TcpSession:
    """Writes one TCP connection as Ethernet frames, the way tcpdump would see it."""

    def __init__(self):
        self.frames = []
        self.t = 1_700_000_000.0
        self.seq = {CLIENT: 1000, SERVER: 5000}

    def _frame(self, src, dst, flags, seq, data=b""):
        pkt = Ether() / IP(src=src[0], dst=dst[0]) / TCP(sport=src[1], dport=dst[1], flags=flags, seq=seq) / data
        pkt.time = self.t
        self.t += 0.001
        return pkt

    def handshake(self):
        self.frames.append(self._frame(CLIENT, SERVER, "S", self.seq[CLIENT] - 1))
        self.frames.append(self._frame(SERVER, CLIENT, "SA", self.seq[SERVER] - 1))

    def send(self, src, data: bytes, sizes=(1460,)):
        """Cut `data` into segments of the given sizes (cycled); returns the frames."""
        dst = SERVER if src == CLIENT else CLIENT
        out, pos, i = [], 0, 0
        while pos < len(data):
            n = sizes[i % len(sizes)]
            out.append(self._frame(src, dst, "PA", self.seq[src] + pos, data[pos : pos + n]))
            pos, i = pos + n, i + 1
        self.seq[src] += len(data)
        self.frames += out
        return out

    def write(self, path):
        wrpcap(str(path), self.frames)


def ra_dump(*args, timeout=120):
    out = subprocess.run([sys.executable, "-m", "remote_accel.tools.dump", *map(str, args)],
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines(), out.stderr


def test_tcp_stream_reassembled_and_split(tmp_path):
    s = TcpSession()
    s.handshake()
    hello = message(messages.Hello(client="host 1", wire_version=2, nonce=b"n" * 32), req_id=1)
    echo = message(messages.Echo(seq=7), [bytes(range(256)) * 12], req_id=2)
    write = message(messages.WriteStorage(sid=3, offset=0, nbytes=100_000), [b"\x5a" * 100_000], req_id=3)
    sync = message(messages.Sync(), req_id=4)
    s.send(CLIENT, hello + echo[:10], sizes=(len(hello) + 10,))  # two messages share a segment
    s.send(CLIENT, echo[10:])
    s.send(SERVER, message(messages.Welcome(session=1, device="cuda:0", memory_limit=0, server_version="0.1",
                                             proof=b"p" * 32), req_id=1)
           + message(messages.EchoReply(seq=7), [bytes(range(256)) * 12], req_id=2))
    frames = s.send(CLIENT, write + sync, sizes=(7, 1460, 65000, 3))  # a prologue cut in pieces
    # the network reorders two segments and retransmits one
    i = s.frames.index(frames[2])
    s.frames[i], s.frames[i + 1] = s.frames[i + 1], s.frames[i]
    s.frames.insert(i + 3, frames[1].copy())
    s.send(SERVER, message(messages.SyncOk(ops_done=1), req_id=4))
    s.send(CLIENT, corrupt_meta(message(messages.ReadStorage(sid=3, offset=0, nbytes=8), req_id=5)))
    s.send(CLIENT, message(messages.Goodbye(), req_id=6))
    s.write(tmp_path / "tcp.pcap")

    lines, err = ra_dump(tmp_path / "tcp.pcap")
    kinds = [line.split()[5] for line in lines]
    assert kinds == ["HELLO", "ECHO", "WELCOME", "ECHO_REPLY", "WRITE", "SYNC", "SYNC_OK", "READ", "GOODBYE"]
    assert lines[0].split()[1:4] == ["10.0.0.1:40000", ">", "10.0.0.2:18515"]
    assert lines[2].split()[1:4] == ["10.0.0.2:18515", ">", "10.0.0.1:40000"]
    assert "req=2" in lines[1] and "payloads=1/3072B" in lines[1] and "Echo(seq=7)" in lines[1]
    assert "WriteStorage(sid=3, offset=0, nbytes=100000)" in lines[4] and "payloads=1/100000B" in lines[4]
    assert "Hello(client='host 1', wire_version=2, nonce=b'nnnn" in lines[0]
    assert lines[0].split()[0] == "0.002000"  # after SYN and SYN-ACK, 1 ms apart
    bad = [line for line in lines if "BAD CHECKSUM" in line]
    assert len(bad) == 1 and " READ req=5 " in bad[0]
    assert "9 messages" in err and "1 bad checksums" in err

    lines, _ = ra_dump(tmp_path / "tcp.pcap", "--json")
    docs = [json.loads(line) for line in lines]
    assert [d["type_name"] for d in docs][:2] == ["HELLO", "ECHO"]
    assert docs[1] | {"time": 0} == {
        "time": 0, "src": "10.0.0.1:40000", "dst": "10.0.0.2:18515", "proto": "tcp", "frame": None,
        "note": None, "info": None, "type": 64, "type_name": "ECHO", "req_id": 2, "flags": 0, "meta_len": 7,
        "n_payloads": 1, "payload_total": 3072, "lengths": [3072], "crc_ok": True, "meta": "Echo(seq=7)"}
    assert [d["crc_ok"] for d in docs].count(False) == 1


def test_capture_starting_mid_stream_and_with_a_hole(tmp_path):
    s = TcpSession()  # no handshake: the capture starts in the middle of a payload
    first = message(messages.Echo(seq=1), [b"RA\x01" * 2000], req_id=1)  # payload that looks like a header
    s.send(CLIENT, first, sizes=(1000,))
    del s.frames[:2]
    s.send(CLIENT, message(messages.Ping(nonce=5), req_id=2))
    lost = s.send(CLIENT, message(messages.Ping(nonce=6), req_id=3) + message(messages.Ping(nonce=7), req_id=4),
                  sizes=(20,))
    s.frames.remove(lost[0])  # tcpdump dropped the first segment of a prologue
    s.send(CLIENT, message(messages.Ping(nonce=8), req_id=5))
    s.write(tmp_path / "mid.pcap")
    lines, _ = ra_dump(tmp_path / "mid.pcap")
    assert [line.split()[5] for line in lines if "!!" not in line] == ["PING", "PING", "PING"]
    assert "nonce=5" in lines[0]
    assert "20 bytes missing from the capture" in lines[1]
    assert "Ping(nonce=7)" in lines[2] and "Ping(nonce=8)" in lines[3]


def test_udp_datagram_and_count(tmp_path):
    raw = message(messages.Echo(seq=3), [b"x" * 100], req_id=9)
    pkts = [Ether() / IP(src="10.1.0.1", dst="10.1.0.2") / UDP(sport=1, dport=2) / raw,
            Ether() / IP() / UDP() / b"not ours",
            Ether() / IP(src="10.1.0.1", dst="10.1.0.2") / UDP(sport=1, dport=2) / corrupt_meta(raw)]
    wrpcap(str(tmp_path / "udp.pcap"), pkts)
    lines, _ = ra_dump(tmp_path / "udp.pcap")
    assert len(lines) == 2
    assert " udp  ECHO req=9 " in lines[0] and "BAD CHECKSUM" not in lines[0]
    assert "BAD CHECKSUM" in lines[1]
    lines, _ = ra_dump(tmp_path / "udp.pcap", "-c", "1")
    assert len(lines) == 1


def test_dpdk_frames_synthesised(tmp_path):
    from remote_accel.tools.wire_layers import FRAME_UDP_PORT, RAFrame, RAHello

    a, b = ("169.254.0.1", "02:00:00:00:00:01"), ("169.254.0.2", "02:00:00:00:00:02")
    frames, t = [], [1_700_000_000.0]

    def put(src, dst, frame, bad=False):
        pkt = (Ether(src=src[1], dst=dst[1]) / IP(src=src[0], dst=dst[0])
               / UDP(sport=FRAME_UDP_PORT, dport=FRAME_UDP_PORT) / frame)
        raw = bytearray(bytes(pkt))
        if bad:
            raw[-1] ^= 0x01
        pkt = Ether(bytes(raw))
        pkt.time = t[0]
        t[0] += 0.001
        frames.append(pkt)

    hello = dict(max_chunk=1416, window=256, peer_timeout_ns=8 * 10**9)
    put(a, b, RAFrame(type="HELLO", conn=9) / RAHello(**hello))
    put(b, a, RAFrame(type="ACCEPT", conn=9) / RAHello(**hello))
    # a RUN message whose meta (and so its prologue) spans two frames, then its payload
    run = messages.RunOp(op="aten::add.Tensor", args=("x" * 1500,), kwargs={}, outs=(1,))
    msg = message(run, [b"\x07" * 1000], req_id=21)
    chunks = [msg[i:i + 1416] for i in range(0, len(msg), 1416)]
    for i, chunk in enumerate(chunks):
        put(a, b, RAFrame(type="DATA", conn=9, seq=i, msg_id=0, offset=1416 * i, msg_len=len(msg)) / chunk)
    put(b, a, RAFrame(type="ACK", conn=9, seq=0, ack=len(chunks), limit=256 + len(chunks)))
    reply = message(messages.SyncOk(ops_done=1), req_id=22)
    put(b, a, RAFrame(type="DATA", conn=9, seq=0, msg_id=0, msg_len=len(reply)) / reply, bad=True)
    put(b, a, RAFrame(type="DATA", conn=9, seq=0, msg_id=0, msg_len=len(reply)) / reply)  # resent intact
    put(b, a, RAFrame(type="DATA", conn=9, seq=0, msg_id=0, msg_len=len(reply)) / reply)  # and once more
    put(a, b, RAFrame(type="GOODBYE", conn=9, seq=len(chunks)))
    wrpcap(str(tmp_path / "dpdk.pcap"), frames)

    lines, err = ra_dump(tmp_path / "dpdk.pcap")
    assert len(lines) == 7, "\n".join(lines)
    assert "frame HELLO" in lines[0] and "max_chunk=1416" in lines[0] and "conn=9" in lines[0]
    assert lines[0].split()[1:4] == ["169.254.0.1:18516", ">", "169.254.0.2:18516"]
    assert "frame ACCEPT" in lines[1]
    # the prologue ends in the second frame; the line shows the first
    assert " dpdk [conn=9 seq=0 ack=0 msg=0 off=0 len=1416]  RUN req=21 " in lines[2]
    assert lines[2].split()[0] == "0.002000"
    assert "RunOp(op='aten::add.Tensor'" in lines[2] and "payloads=1/1000B" in lines[2]
    assert "BAD FRAME CHECKSUM" in lines[3] and "seq=0" in lines[3]
    # a frame whose checksum failed tells nothing reliable: the next copy is the first one
    assert "SYNC_OK req=22" in lines[4] and "retransmit" not in lines[4]
    assert "SYNC_OK req=22" in lines[5] and "retransmit=1" in lines[5]
    assert "frame GOODBYE" in lines[6]
    assert "3 messages" in err and "1 bad checksums" in err
    every, _ = ra_dump(tmp_path / "dpdk.pcap", "--frames")
    assert any("frame ACK" in line for line in every)
    assert sum("frame DATA" in line for line in every) == len(chunks) - 1


def test_unreadable_file(tmp_path):
    (tmp_path / "junk.pcap").write_bytes(b"definitely not a capture")
    out = subprocess.run([sys.executable, "-m", "remote_accel.tools.dump", str(tmp_path / "junk.pcap")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "cannot read" in out.stderr and out.stdout == ""
    out = subprocess.run([sys.executable, "-m", "remote_accel.tools.dump", str(tmp_path / "none.pcap")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "no such file" in out.stderr


@pytest.mark.skipif(shutil.which("tcpdump") is None or os.geteuid() != 0,
                    reason="needs tcpdump and root (apt-get install -y tcpdump)")
def test_real_tcpdump_capture_of_a_tcp_session(tmp_path):
    from remote_accel.dataplane.tcp import TcpTransport

    echo = subprocess.Popen([sys.executable, "-m", "remote_accel.dataplane.echo", "--listen", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, text=True)
    dump = None
    try:
        port = int(echo.stdout.readline().split(":")[-1])
        pcap = tmp_path / "lo.pcap"
        dump = subprocess.Popen(["tcpdump", "-i", "lo", "-U", "-B", "65536", "-w", str(pcap), f"tcp port {port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 20
        while not (pcap.exists() and pcap.stat().st_size > 0) and time.monotonic() < deadline:
            time.sleep(0.05)  # tcpdump writes the file header once it listens
        with TcpTransport.connect("127.0.0.1", port) as t:
            for i in range(3):
                t.send(wire.MsgType.ECHO, messages.encode(messages.Echo(seq=i)),
                       [np.full(1000 * (i + 1), i, np.uint8)], req_id=i + 1)
                t.recv(timeout=10)
            t.send(wire.MsgType.SINK, messages.encode(messages.Sink(seq=9)), [np.zeros(1 << 20, np.uint8)], req_id=10)
            t.send(wire.MsgType.GOODBYE, messages.encode(messages.Goodbye()), req_id=11)
        # tcpdump stops without draining the kernel's buffer: wait until the file stops growing
        size, deadline = -1, time.monotonic() + 20
        while pcap.stat().st_size != size and time.monotonic() < deadline:
            size = pcap.stat().st_size
            time.sleep(1.0)
        dump.send_signal(signal.SIGINT)
        dump.wait(timeout=20)
    finally:
        for proc in (dump, echo):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    lines, err = ra_dump(pcap, "--port", port)
    kinds = [line.split()[5] for line in lines]
    assert kinds == ["ECHO", "ECHO_REPLY"] * 3 + ["SINK", "GOODBYE"], "\n".join(lines)
    assert all("BAD CHECKSUM" not in line for line in lines)
    assert "Sink(seq=9)" in lines[6] and "payloads=1/1048576B" in lines[6]
    assert [f"req={i}" in lines[2 * (i - 1)] for i in (1, 2, 3)] == [True] * 3
