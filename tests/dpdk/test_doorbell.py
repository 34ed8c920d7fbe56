"""Doorbells (dpdk_shim/doorbell.c): a waiter on a shared-memory port sleeps until the
peer's next frame instead of napping. These tests check behaviour only: replies after
long idle and after the spin window arrive and match their requests, a close wakes a
sleeping recv, many idle/busy cycles lose nothing, the peer's frame (not a timer) ends
the sleep, `send_many` keeps order, and no shared-memory name is left behind.
"""

from __future__ import annotations

import os
import random
import threading
import time

import numpy as np
import pytest

from remote_accel.dataplane import dpdk
from remote_accel.errors import TransportClosed

ECHO, REPLY, STOP = 64, 65, 1


def _echo(t, delay: float = 0.0) -> threading.Thread:
    """Answer every ECHO with its payloads (after `delay` s) until STOP."""

    def serve():
        while True:
            msg = t.recv(timeout=30)
            if msg.type == STOP:
                return
            if delay:
                time.sleep(delay)
            t.send(REPLY, msg.meta, msg.payloads, req_id=msg.req_id)

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    return th


def _round_trip(t, i: int) -> None:
    data = np.frombuffer(i.to_bytes(8, "little") * 8, np.uint8)
    t.send(ECHO, f"m{i}".encode(), [data], req_id=i)
    reply = t.recv(timeout=30)
    assert (reply.type, reply.req_id, reply.meta) == (REPLY, i, f"m{i}".encode())
    assert bytes(reply.payloads[0]) == data.tobytes()


def _our_pages() -> list:
    prefix = f"remote_accel-db-{os.getpid()}-"
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


@pytest.fixture
def doorbell_pair(eal):
    a, b = dpdk.DpdkTransport.pair(options=dpdk.ChannelOptions(peer_timeout=20.0, doorbell=True))
    yield a, b
    a.close()
    b.close()


def test_both_ends_have_a_doorbell_over_a_ring_pair(doorbell_pair):
    a, b = doorbell_pair
    assert a.stats()["doorbell"] == 1 and b.stats()["doorbell"] == 1


def test_reply_after_long_idle_wakes_the_sleeping_server(doorbell_pair):
    a, b = doorbell_pair
    server = _echo(b)
    for i in range(6):
        time.sleep(0.25)  # far past the spin window: the server's recv sleeps on its doorbell
        _round_trip(a, i)
    a.send(STOP)
    server.join(10)
    st = b.stats()
    assert st["db_sleeps"] > 0
    # the client's frame ended the server's sleep (a nap lasts at most 16 ms, the idle 250)
    assert st["db_wakeups"] >= 1


def test_reply_after_the_spin_window_still_arrives(doorbell_pair):
    a, b = doorbell_pair
    server = _echo(b, delay=0.05)  # the client gives up spinning and sleeps before it
    for i in range(5):
        _round_trip(a, i)
    a.send(STOP)
    server.join(10)
    assert a.stats()["db_sleeps"] > 0


def test_many_idle_and_busy_cycles_lose_no_message(doorbell_pair):
    a, b = doorbell_pair
    server = _echo(b)
    rng = random.Random(7)
    n = 0
    for _ in range(40):
        for _ in range(rng.randrange(1, 30)):  # busy: back to back
            _round_trip(a, n)
            n += 1
        time.sleep(rng.choice([0.0, 0.0002, 0.001, 0.005, 0.02]))  # idle of every kind
    a.send(STOP)
    server.join(10)
    assert a.stats()["rx_messages"] == n


def test_close_wakes_a_recv_asleep_on_the_doorbell(doorbell_pair):
    a, _ = doorbell_pair
    failed = []

    def wait():
        try:
            a.recv()  # no timeout: only the close can end it
        except TransportClosed as exc:
            failed.append(exc)

    th = threading.Thread(target=wait, daemon=True)
    th.start()
    time.sleep(0.2)  # asleep by now
    a.close()
    th.join(10)
    assert not th.is_alive() and len(failed) == 1


def test_send_many_keeps_order_and_every_message(doorbell_pair):
    a, b = doorbell_pair
    msgs = [(ECHO + (i % 2), f"k{i}".encode(), [np.full(100 + i, i, np.uint8)], i) for i in range(5)]
    a.send_many(msgs)
    got = [b.recv(timeout=10) for _ in msgs]
    assert [(m.type, m.meta, m.req_id) for m in got] == [(t, meta, r) for t, meta, _, r in msgs]
    assert [bytes(m.payloads[0]) for m in got] == [p[0].tobytes() for _, _, p, _ in msgs]


def test_send_many_checks_every_message_before_sending_any(doorbell_pair):
    a, b = doorbell_pair
    with pytest.raises(ValueError):
        a.send_many([(ECHO, b"first", [], 1), (ECHO, b"bad", [], 1 << 40)])
    a.send(ECHO, b"after", req_id=2)
    assert b.recv(timeout=10).meta == b"after"  # "first" never left


def test_without_doorbells_waits_nap_and_still_deliver(eal):
    a, b = dpdk.DpdkTransport.pair(options=dpdk.ChannelOptions(peer_timeout=20.0, doorbell=False))
    try:
        assert a.stats()["doorbell"] == 0 and b.stats()["doorbell"] == 0
        server = _echo(b)
        for i in range(3):
            time.sleep(0.05)
            _round_trip(a, i)
        a.send(STOP)
        server.join(10)
        assert b.stats()["db_sleeps"] == 0
    finally:
        a.close()
        b.close()


def test_no_shared_memory_name_is_left_behind(eal):
    a, b = dpdk.DpdkTransport.pair(options=dpdk.ChannelOptions(peer_timeout=20.0))
    a.send(ECHO, b"x")
    b.recv(timeout=10)  # the client's first frame: the server's page was mapped, unnamed
    assert _our_pages() == []
    a.close()
    b.close()
    assert _our_pages() == []


def test_memif_peer_in_another_process_rings_us(eal, tmp_path):
    """Across processes over memif: both ends map each other's doorbell, and round trips
    after idle still get their own replies."""
    import dpdk_helpers as h

    proc = h.start_echo([], str(tmp_path))
    port = h.memif_client_port(str(tmp_path / "memif.sock"))
    try:
        t = dpdk.DpdkTransport.connect(port, timeout=20, options=dpdk.ChannelOptions(doorbell=True))
        try:
            assert t.stats()["doorbell"] == 1
            for i in range(5):
                time.sleep(0.1)  # the echo peer's recv sleeps on its doorbell meanwhile
                _round_trip(t, i)
        finally:
            t.close()
    finally:
        h.stop(proc)
        dpdk.remove_vdev(port)
