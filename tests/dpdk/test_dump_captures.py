"""ra-dump on captures of real DPDK frames: DPDK's net_pcap vdev, and tcpdump watching
two DPDK processes talk over net_af_packet on a veth pair."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

# conftest.py marks these dpdk, and skips them only where DPDK is not installed at all


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # a process of its own: one EAL per process, and this one may already run one
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)


def ra_dump(*args):
    out = subprocess.run([sys.executable, "-m", "remote_accel.tools.dump", *map(str, args)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines(), out.stderr


def test_net_pcap_capture_of_shim_frames(tmp_path):
    pcap = tmp_path / "tx.pcap"
    out = run_python(f"""
        from remote_accel.dataplane import dpdk, messages, wire
        dpdk.eal_init(["--vdev=net_pcap0,tx_pcap={pcap}"])
        dpdk.setup_port(0, raw=True, max_frame=2048)
        good = wire.encode_prologue(wire.MsgType.ECHO, messages.encode(messages.Echo(seq=1)), [4], req_id=5)
        frame = dpdk.build_frame(1, 7, 0, good + b"abcd")
        dpdk.tx_raw(0, frame, 1)
        bad = bytearray(frame)
        bad[-1] ^= 1
        dpdk.tx_raw(0, bytes(bad), 1)
        ping = wire.encode_prologue(wire.MsgType.PING, messages.encode(messages.Ping(nonce=3)), [], req_id=6)
        corrupt = bytearray(ping)
        corrupt[-1] ^= 1  # a message whose own checksum fails inside an intact frame
        dpdk.tx_raw(0, dpdk.build_frame(1, 7, 1, bytes(corrupt)), 1)
        dpdk.lib.shim_shutdown()  # closes the port: net_pcap flushes its file
    """)
    assert out.returncode == 0, out.stderr
    lines, err = ra_dump(pcap)
    assert len(lines) == 3, "\n".join(lines)
    assert "dpdk [conn=7 seq=0 ack=0 msg=0 off=0 len=" in lines[0] and " ECHO req=5 " in lines[0]
    assert "Echo(seq=1)" in lines[0] and "CHECKSUM" not in lines[0]
    assert "BAD FRAME CHECKSUM" in lines[1]
    assert " PING req=6 " in lines[2] and "BAD CHECKSUM" in lines[2]
    assert "2 messages" in err and "2 bad checksums" in err


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("tcpdump") or not shutil.which("ip"),
                    reason="needs root, ip and tcpdump (apt-get install -y tcpdump)")
def test_tcpdump_capture_of_a_dpdk_session_over_af_packet(tmp_path):
    veth = f"rad{os.getpid() % 100000}"
    a, b = veth + "a", veth + "b"
    subprocess.run(["ip", "link", "add", a, "type", "veth", "peer", "name", b], check=True, timeout=30)
    procs = []
    try:
        for dev in (a, b):
            subprocess.run(["ip", "link", "set", dev, "up"], check=True, timeout=30)
        pcap = tmp_path / "veth.pcap"
        # on "any" each frame shows once, as it arrives at the other end of the pair
        dump = subprocess.Popen(["tcpdump", "-i", "any", "-U", "-w", str(pcap), "udp port 18516"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(dump)
        echo = subprocess.Popen([sys.executable, "-m", "remote_accel.dataplane.echo", f"--vdev=net_af_packet0,iface={a}",
                                 "--", "--transport", "dpdk"], stdout=subprocess.PIPE, text=True)
        procs.append(echo)
        assert echo.stdout.readline().startswith("READY")
        deadline = time.monotonic() + 20
        while not (pcap.exists() and pcap.stat().st_size) and time.monotonic() < deadline:
            time.sleep(0.05)
        out = run_python(f"""
            import numpy as np
            from remote_accel.dataplane.dpdk import DpdkTransport
            from remote_accel.dataplane import messages, wire
            t = DpdkTransport.connect(port=0, eal_args=["--vdev=net_af_packet0,iface={b}"], timeout=20)
            for i in range(3):
                t.send(wire.MsgType.ECHO, messages.encode(messages.Echo(seq=i)),
                       [np.full(3000 * (i + 1), i, np.uint8)], req_id=i + 1)
                t.recv(timeout=10)
            t.send(wire.MsgType.GOODBYE, messages.encode(messages.Goodbye()), req_id=9)
            t.close()
        """)
        assert out.returncode == 0, out.stderr
        size, deadline = -1, time.monotonic() + 20
        while pcap.stat().st_size != size and time.monotonic() < deadline:
            size = pcap.stat().st_size  # tcpdump stops without draining the kernel's buffer
            time.sleep(1.0)
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT if proc is procs[0] else signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        subprocess.run(["ip", "link", "del", a], timeout=30)
    lines, err = ra_dump(pcap)
    text = "\n".join(lines)
    assert "frame HELLO" in lines[0] and "frame ACCEPT" in lines[1], text
    kinds = [m.group(1) for m in (re.search(r"\]  (\w+) req=", line) for line in lines) if m]
    assert kinds == ["ECHO", "ECHO_REPLY"] * 3 + ["GOODBYE"], text
    assert "payloads=1/9000B" in text and "EchoReply(seq=2)" in text
    assert "CHECKSUM" not in text
    assert "7 messages" in err
