"""ra-testpmd run for real over TCP: against the echo peer, an in-process peer, a server."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
import threading

import pytest

PROG = [sys.executable, "-m", "remote_accel.tools.testpmd"]


def run_testpmd(*args, timeout=120, check=True):
    out = subprocess.run([*PROG, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    if check:
        assert out.returncode == 0, out.stderr
    return out


def report(*args) -> dict:
    return json.loads(run_testpmd(*args, "--json").stdout)


@pytest.fixture(scope="module")
def echo_peer():
    proc = subprocess.Popen([sys.executable, "-m", "remote_accel.dataplane.echo", "--listen", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, text=True)
    line: list = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(60)
    try:
        assert line and line[0].startswith("READY tcp:"), line
        yield line[0].split("tcp:", 1)[1].strip()
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def check_counts(doc: dict, unit="msgs"):
    assert doc["unit"] == unit
    port, total = doc["ports"][0], doc["total"]
    assert port["rx_packets"] > 0 and port["tx_packets"] >= port["rx_packets"]
    assert port["rx_dropped"] == port["tx_dropped"] == 0
    assert port["rx_total"] == port["rx_packets"]
    assert total["rx_packets"] == sum(p["rx_packets"] for p in doc["ports"])
    assert port["rx_pps"] > 0 and port["tx_gbit_s"] > 0


def test_echo_over_tcp_against_the_echo_peer(echo_peer):
    doc = report("--", "--forward-mode", "echo", "--transport", "tcp", "--server", echo_peer,
                 "--duration", "1.5", "--stats-period", "0.5", "--size", "1000", "--verify")
    check_counts(doc)
    assert doc["mode"] == "echo" and doc["transport"] == "tcp" and doc["size"] == 1000
    assert 1.4 < doc["duration_s"] < 5
    port = doc["ports"][0]
    assert port["rx_packets"] == port["tx_packets"]  # every request answered (the tail is drained)
    assert port["rx_payload"] == 1000 * port["rx_packets"]
    assert port["rx_bytes"] > port["rx_payload"]  # prologues on top
    lat = doc["latency_us"]
    assert lat["samples"] == port["rx_packets"]
    assert 0 < lat["min"] <= lat["p50"] <= lat["p99"] <= lat["p99.9"] <= lat["max"]
    assert len(doc["samples"]) >= 2 and doc["samples"][0]["latency_us"]["samples"] > 0
    assert doc["verify_mismatches"] == 0 and doc["unanswered"] == 0
    assert doc["transport_stats"]["rx_messages"] == port["rx_packets"]


def test_pipelined_echo_with_a_local_peer_and_text_output():
    out = run_testpmd("--", "--forward-mode", "echo", "--transport", "tcp", "--peer", "local", "--burst", "8",
                  "--duration", "1", "--stats-period", "0.4", "--size", "64K").stdout
    assert "\033[" not in out  # not a terminal: plain periodic blocks, no redraw
    assert len(re.findall(r"#+ Port 0 \(tcp:127\.0\.0\.1:\d+\) at \d+\.\d s #+", out)) >= 2
    assert re.search(r"-+ Forward statistics for port 0 \(tcp:", out)
    assert "Accumulated forward statistics for all ports" in out
    for label in ("RX-msgs:", "RX-dropped:", "RX-total:", "TX-msgs:", "TX-dropped:", "Rx-pps:", "Tx-pps:",
                  "Rx-Gbit/s:", "Tx-payload:", "GB/s"):
        assert label in out
    p50, p99, p999 = map(float, re.findall(r"Round trip \(us\): p50 ([\d.]+)  p99 ([\d.]+)  p99\.9 ([\d.]+)",
                                           out)[-1])
    assert 0 < p50 <= p99 <= p999


def test_live_redraw_on_a_terminal():
    leader, follower = pty.openpty()
    proc = subprocess.Popen([*PROG, "--", "--forward-mode", "echo", "--transport", "tcp", "--peer", "local",
                             "--duration", "1", "--stats-period", "0.3"], stdout=follower, stderr=subprocess.PIPE)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(60) == 0
    os.close(leader)
    text = b"".join(chunks).decode()
    assert text.count("\033[H\033[2J") >= 2  # each block redraws the screen
    assert "Accumulated forward statistics" in text


def test_tensor_mode_against_a_real_server():
    from remote_accel.server.testing import ServerProcess

    with ServerProcess() as server:
        host, port = server.tcp
        doc = report("--", "--forward-mode", "tensor", "--transport", "tcp", "--server", f"{host}:{port}",
                     "--token-file", server.token_file, "--size", "256K", "--burst", "2", "--duration", "1.5",
                     "--stats-period", "0", "--verify")
        bad = run_testpmd("--", "--forward-mode", "tensor", "--transport", "tcp", "--server", f"{host}:{port}",
                      "--token-file", os.devnull, "--duration", "1", check=False)
    check_counts(doc)
    port_doc = doc["ports"][0]
    # WRITE and READ per round trip, plus one ALLOC per request in flight
    assert port_doc["tx_packets"] == 2 * port_doc["rx_packets"] + 2
    assert port_doc["rx_payload"] == port_doc["tx_payload"] == 256 * 1024 * port_doc["rx_packets"]
    assert doc["peer"] == "server" and doc["verify_mismatches"] == 0
    assert "-> cpu" in port_doc["driver"]
    assert bad.returncode == 1 and "no token" in bad.stderr  # an empty token file: said before connecting


def test_help_lists_every_option_with_its_range():
    out = run_testpmd("--help").stdout
    squeezed = re.sub(r"\s+", "", out)
    for option, text in [("--forward-mode", "txonly,rxonly,io,echo,tensor"), ("--txpkts", "99..16384"),
                         ("--burst", "1..1024"), ("--size", "0..2G"), ("--duration", "0.1..86400"),
                         ("--stats-period", "0.1..3600"), ("--transport", "dpdk,tcp"), ("--server", "1..65535"),
                         ("--port", "0..1023"), ("--portlist", "0..1023"), ("--peer", "echo,server,local"),
                         ("--tx-first", ""), ("--busy-poll", ""), ("--verify", ""), ("--json", ""),
                         ("--token-file", "")]:
        assert option in out and text in squeezed, option
    assert "[EAL options] -- [options]" in out


@pytest.mark.parametrize("args, message", [
    (["--duration", "0"], "outside 0.1..86400"),
    (["--burst", "5000"], "outside 1..1024"),
    (["--size", "3G"], "outside 0..2G"),
    (["--forward-mode", "txonly", "--transport", "tcp"], "no --transport tcp"),
])
def test_out_of_range_options_are_refused(args, message):
    out = run_testpmd("--", *args, check=False)
    assert out.returncode == 2 and message in out.stderr


def test_no_peer_is_a_clear_error():
    out = run_testpmd("--", "--forward-mode", "echo", "--transport", "tcp", "--server", "127.0.0.1:1",
                  "--duration", "1", check=False)
    assert out.returncode == 1 and "cannot connect" in out.stderr and "Traceback" not in out.stderr
