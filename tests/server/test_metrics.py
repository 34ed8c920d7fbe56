"""`remote-accel-server --metrics`: a real server process scraped over HTTP while protocol
clients use it; counters move by exactly what the clients did, gauges return to 0."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time

import pytest
import torch

from remote_accel.dataplane import messages as m
from remote_accel.errors import RemoteOpError
from remote_accel.server.__main__ import build_parser, parse_metrics
from remote_accel.server.testing import Client, ServerProcess, encode_arg, scrape

pytestmark = pytest.mark.any_torch

OPS_PER_BATCH = 4
BATCHES = 3
N = 256  # floats per tensor


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--metrics", "127.0.0.1:0", "--log-level", "debug") as proc:
        yield proc
        assert proc.alive(), f"the server died:\n{proc.log()}"
        assert "Traceback" not in proc.log(), f"the server hit a bug:\n{proc.log()}"


def settled(server, predicate, what: str, timeout: float = 30.0):
    """The first scrape that satisfies `predicate` (a client's goodbye is handled a moment
    after it was sent); fails with the last scrape after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        s = scrape(server.metrics_url)
        if predicate(s):
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"never saw {what}: {dict(s)}")
        time.sleep(0.05)


def idle(server):
    return settled(server, lambda s: s.value("remote_accel_clients") == 0, "no clients")


def test_off_by_default_and_local_unless_told():
    assert build_parser().parse_args([]).metrics is None
    assert build_parser().parse_args(["--metrics"]).metrics == ("127.0.0.1", 18516)
    assert parse_metrics("9100") == ("127.0.0.1", 9100)
    assert parse_metrics("0.0.0.0:9100") == ("0.0.0.0", 9100)
    assert parse_metrics("[::1]:0") == ("::1", 0)
    for bad in ("host:port", ":9100", "1.2.3.4:70000"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_metrics(bad)


def test_metrics_address_in_use_is_a_clear_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "remote_accel.server", "--device", "cpu", "--listen",
                              "127.0.0.1:0", "--token-file", str(tmp_path / "t"), "--metrics", f"127.0.0.1:{port}"],
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"cannot serve metrics on 127.0.0.1:{port}" in out.stderr, out.stderr
    assert "listening on" not in out.stdout


def test_counters_move_by_what_a_client_did(server):
    before = idle(server)
    client = Client.tcp(*server.tcp, token=server.token)
    try:
        x = client.upload(torch.ones(N))
        outs = []
        for _ in range(BATCHES):
            items = []
            for _ in range(OPS_PER_BATCH):
                outs.append(client.empty((N,)))
                items.append(m.RunOp("aten::add.Tensor", encode_arg((x, x)), {}, encode_arg((outs[-1],)), False))
            client.batch(*items)
        assert client.sync() == BATCHES * OPS_PER_BATCH
        wire = client.transport.stats()
        # the server counts a reply's bytes once its send returned, which may be a moment
        # after the client has the reply: wait for that moment
        during = settled(server, lambda s: s.value("remote_accel_client_bytes_sent_total") == wire["rx_bytes"],
                         "the SYNC_OK counted")
        slot = next(iter(during.labels("remote_accel_client_info", "client")))
        expected_memory = (1 + len(outs)) * N * 4
        assert client.stats()["memory_allocated"] == expected_memory
    finally:
        client.close()

    def delta(name, **labels):
        return during.value(name, **labels) - before.value(name, **labels)

    assert during.value("remote_accel_clients") == 1
    assert delta("remote_accel_ops_total") == BATCHES * OPS_PER_BATCH
    assert delta("remote_accel_batches_total") == BATCHES
    assert delta("remote_accel_batch_seconds_count") == BATCHES
    assert delta("remote_accel_batch_seconds_bucket", le="+Inf") == BATCHES
    assert delta("remote_accel_batch_seconds_sum") > 0
    assert delta("remote_accel_sessions_total") == 1
    assert delta("remote_accel_op_errors_total") == 0
    # the server's byte counters agree with the client's own, to the byte: HELLO, ALLOC,
    # the WRITE of N floats, the batches and the SYNC in; WELCOME and SYNC_OK out
    assert wire["tx_bytes"] > N * 4
    assert delta("remote_accel_bytes_received_total", transport="tcp") == wire["tx_bytes"]
    assert delta("remote_accel_bytes_sent_total", transport="tcp") == wire["rx_bytes"]
    assert during.value("remote_accel_client_bytes_received_total", client=slot) == wire["tx_bytes"]
    assert during.value("remote_accel_client_bytes_sent_total", client=slot) == wire["rx_bytes"]
    assert during.value("remote_accel_client_ops_total", client=slot) == BATCHES * OPS_PER_BATCH
    assert during.value("remote_accel_memory_bytes", client=slot) == expected_memory
    assert during.value("remote_accel_client_info", client=slot, transport="tcp") == 1
    assert 0 < time.time() - during.value("remote_accel_client_start_time_seconds", client=slot) < 3600

    after = idle(server)  # the client left: gauges back to 0, counters keep what it did
    assert after.value("remote_accel_memory_bytes") == 0
    assert after.value("remote_accel_memory_bytes", client=slot) == 0
    assert "remote_accel_client_ops_total" not in after  # no series for clients that left
    assert after.value("remote_accel_ops_total") == during.value("remote_accel_ops_total")
    assert after.value("remote_accel_batches_total") == during.value("remote_accel_batches_total")
    assert after.value("remote_accel_bytes_received_total") >= during.value("remote_accel_bytes_received_total")


def test_failed_ops_are_counted_by_kind(server):
    before = idle(server)
    with Client.tcp(*server.tcp, token=server.token) as client:
        a, b = client.upload(torch.ones(3)), client.upload(torch.ones(4))
        client.batch(m.RunOp("aten::add.Tensor", encode_arg((a, b)), {}, encode_arg((client.empty((4,)),)), False))
        with pytest.raises(RemoteOpError):
            client.sync()
        with pytest.raises(Exception):
            client.run_reply("aten::no_such_op", a, outs=(client.new_sid(),))
    after = idle(server)
    assert after.value("remote_accel_op_errors_total", kind="op") - before.value(
        "remote_accel_op_errors_total", kind="op") == 1
    assert after.value("remote_accel_op_errors_total", kind="unknown_op") - before.value(
        "remote_accel_op_errors_total", kind="unknown_op") == 1


def test_client_slots_are_recycled(server):
    """Label values stay below max_clients however many clients come and go."""
    idle(server)
    for _ in range(5):
        with Client.tcp(*server.tcp, token=server.token) as a, Client.tcp(*server.tcp, token=server.token) as b:
            a.sync()
            b.sync()
            s = scrape(server.metrics_url)
            assert set(s.labels("remote_accel_client_info", "client")) == {"0", "1"}
        idle(server)
    s = scrape(server.metrics_url)
    assert set(s.labels("remote_accel_memory_bytes", "client")) == {"0", "1"}
    assert s.value("remote_accel_sessions_total") >= 10


def test_cpu_server_reports_no_device_figures(server):
    s = scrape(server.metrics_url)
    [(device, one)] = s.labels("remote_accel_server_info", "device").items()
    assert device.startswith(server.device.split(":")[0]) and one == 1
    if server.device == "cpu":
        assert not [name for name in s if name.startswith("remote_accel_device_")]
    else:  # REMOTE_ACCEL_TEST_DEVICE=cuda: what the GPU reports
        assert s.value("remote_accel_device_memory_total_bytes") > 0


def test_limits_and_swapped_bytes_are_gauges_and_every_error_kind_has_a_series():
    """--max-clients and --memory-limit as gauges; a client's bytes swapped out to host
    memory (--swap-space) as its own gauge; every ErrorReply kind a series from the
    start (device_lost included: a server whose device failed exits at once, status 3,
    so a scrape sees that series at 0 and the supervisor's restarts tell the rest)."""
    mb = 1 << 20
    with ServerProcess("--metrics", "127.0.0.1:0", "--max-clients", "3", "--memory-limit", "32M",
                       "--device-memory", "8M", "--swap-space", "64M") as server:
        fresh = scrape(server.metrics_url)
        assert fresh.value("remote_accel_max_clients") == 3
        assert fresh.value("remote_accel_memory_limit_bytes") == 32 * mb
        assert set(fresh.labels("remote_accel_op_errors_total", "kind")) == {
            "op", "oom", "bad_handle", "unknown_op", "protocol", "device_lost"}
        assert fresh.value("remote_accel_op_errors_total", kind="device_lost") == 0
        with Client.tcp(*server.tcp, token=server.token) as client:
            for i in range(3):  # 9 MiB on a device of 8: the first storage goes out
                client.upload(torch.full((3 * mb // 4,), float(i)))
            client.sync()
            assert client.stats()["swapped_out_bytes"] == 3 * mb  # the scenario: one storage swapped out
            during = scrape(server.metrics_url)
            slot = next(iter(during.labels("remote_accel_client_info", "client")))
            assert during.value("remote_accel_swapped_bytes", client=slot) == 3 * mb
            assert during.value("remote_accel_memory_bytes", client=slot) == 9 * mb
        after = idle(server)
        assert after.value("remote_accel_swapped_bytes", client=slot) == 0  # freed with the client
