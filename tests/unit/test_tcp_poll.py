"""TcpTransport's receiver polls its socket for a short window after traffic before it
blocks (REMOTE_ACCEL_TCP_POLL_US; 0: block at once). Messages arrive the same either way,
an idle transport blocks (burns no CPU), and timeouts, closes and a peer's end give the
same errors as a receiver that blocked at once."""

from __future__ import annotations

import os
import random
import resource
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from remote_accel.dataplane import tcp_poll
from remote_accel.dataplane.tcp import TcpListener, TcpTransport
from remote_accel.dataplane.tcp_poll import ENV_POLL_US, PollWindow
from remote_accel.dataplane.tls import TlsListener, TlsTransport, client_context, server_context
from remote_accel.errors import PeerGone, TransportClosed, TransportTimeout

ECHO, REPLY, STOP = 64, 65, 66
LONG_US = tcp_poll.MAX_POLL_US  # 100 ms: a waiter certainly polls while the test acts


def _tcp_pair(cert: str | None = None, **kwargs) -> tuple[TcpTransport, TcpTransport]:
    if cert:
        listener = TlsListener("127.0.0.1", 0, tls=server_context(cert, cert + ".key"), **kwargs)
    else:
        listener = TcpListener("127.0.0.1", 0, **kwargs)
    accepted = []

    def accept():
        t = listener.accept(timeout=10)
        if cert:
            t._handshake(time.monotonic() + 10)  # a server's runs in its first recv; the client waits for it
        accepted.append(t)

    thread = threading.Thread(target=accept)
    thread.start()
    if cert:
        a = TlsTransport.connect("127.0.0.1", listener.port, tls=client_context(cert), **kwargs)
    else:
        a = TcpTransport.connect("127.0.0.1", listener.port, **kwargs)
    thread.join()
    listener.close()
    return a, accepted[0]


@pytest.fixture(scope="module")
def cert(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tls") / "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout",
                    path + ".key", "-out", path, "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=120)
    return path


@pytest.fixture(params=["tcp", "socketpair", "tls"])
def make_pair(request):
    made = []

    def make(**kwargs):
        if request.param == "socketpair":
            pair = TcpTransport.pair(**kwargs)
        else:
            pair = _tcp_pair(request.getfixturevalue("cert") if request.param == "tls" else None, **kwargs)
        made.extend(pair)
        return pair

    yield make
    for t in made:
        t.close()


def _echo(t: TcpTransport, delays: dict | None = None) -> threading.Thread:
    """Answer ECHO with the same meta and payloads (after delays[req_id] seconds), until STOP."""

    def serve():
        try:
            while True:
                msg = t.recv(timeout=30)
                if msg.type != ECHO:
                    return
                if delays and msg.req_id in delays:
                    time.sleep(delays[msg.req_id])
                t.send(REPLY, msg.meta, msg.payloads, req_id=msg.req_id)
        except (PeerGone, TransportClosed):
            pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def _round_trip(t: TcpTransport, i: int, size: int = 64, timeout: float = 10) -> None:
    payload = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)
    t.send(ECHO, b"rt-%d" % i, [payload], req_id=i)
    msg = t.recv(timeout=timeout)
    assert (msg.type, bytes(msg.meta), msg.req_id) == (REPLY, b"rt-%d" % i, i)
    np.testing.assert_array_equal(msg.payloads[0], payload)


def test_a_reply_after_a_silence_longer_than_the_window_arrives(make_pair):
    a, b = make_pair(poll_us=50)
    _echo(b, delays={2: 0.2, 4: 0.05})  # 4000 and 1000 windows of silence
    for i in range(1, 6):
        _round_trip(a, i)
    stats = a.stats()
    assert stats["rx_slept"] >= 2  # the long waits blocked in the kernel
    assert stats["rx_polled"] + stats["rx_slept"] == 5
    a.send(STOP)


def test_many_round_trips_with_idle_gaps_between_them(make_pair):
    a, b = make_pair(poll_us=200)
    rng = random.Random(7)
    gaps = [rng.choice((0, 0, 0, 1e-4, 1e-3, 5e-3)) for _ in range(300)]
    _echo(b, delays={i: g for i, g in enumerate(gaps) if i % 3 == 0})  # the peer is slow now and then
    for i, gap in enumerate(gaps):
        if i % 3 == 1:
            time.sleep(gap)  # and now and then the user's code is
        _round_trip(a, i, size=rng.choice((0, 1, 64, 70_000)) or 1)
    # messages sent back to back while the receiver polls come out whole and in order
    a.send_many([(ECHO, b"rt-%d" % i, [np.full(16, i % 256, np.uint8)], i) for i in range(1000, 1050)])
    for i in range(1000, 1050):
        msg = a.recv(timeout=10)
        assert (msg.req_id, bytes(msg.meta), msg.payloads[0].tolist()) == (i, b"rt-%d" % i, [i % 256] * 16)
    a.send(STOP)


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_the_knob_off_blocks_at_once(make_pair, monkeypatch, how):
    if how == "environment":
        monkeypatch.setenv(ENV_POLL_US, "0")
        a, b = make_pair()
    else:
        monkeypatch.setenv(ENV_POLL_US, "100000")  # the argument wins over the environment
        a, b = make_pair(poll_us=0)
    _echo(b)
    for i in range(50):
        _round_trip(a, i)
    stats = a.stats()
    assert (stats["rx_polled"], stats["rx_slept"]) == (0, 50)
    a.send(STOP)


def test_polling_catches_quick_replies(make_pair):
    a, b = make_pair(poll_us=LONG_US)
    _echo(b)
    for i in range(20):
        _round_trip(a, i)
    assert a.stats()["rx_polled"] >= 15  # a 100 ms window outlasts the echoes (bar a stray stall)
    a.send(STOP)


@pytest.mark.parametrize("text", ["-1", "abc", "1.5", str(tcp_poll.MAX_POLL_US + 1)])
def test_a_bad_knob_is_a_clear_error(monkeypatch, text):
    monkeypatch.setenv(ENV_POLL_US, text)
    with pytest.raises(ValueError, match=ENV_POLL_US):
        TcpTransport.pair()
    with pytest.raises(ValueError, match="outside"):
        TcpTransport.pair(poll_us=-5)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


@pytest.mark.parametrize("waiting", ["one long recv", "recv in slices"])
def test_an_idle_transport_burns_no_cpu(make_pair, waiting):
    a, b = make_pair(poll_us=20_000)  # a waiter that kept polling past its window would show
    _echo(b)
    _round_trip(a, 0)  # traffic: the next wait starts by polling
    before, started = _cpu_seconds(), time.monotonic()
    if waiting == "one long recv":
        with pytest.raises(TransportTimeout):
            a.recv(timeout=1.0)
    else:  # as a client's sync waits: 0.1 s at a time, until it hears from the server
        for _ in range(10):
            with pytest.raises(TransportTimeout):
                a.recv(timeout=0.1)
    used = (_cpu_seconds() - before) / (time.monotonic() - started)
    assert used < 0.2, f"an idle receiver used {used:.0%} of a core"
    _round_trip(a, 1)  # still usable
    a.send(STOP)


def test_a_timeout_shorter_than_the_window_is_kept(make_pair):
    a, b = make_pair(poll_us=LONG_US)
    _echo(b, delays={1: 0.5})
    a.send(ECHO, b"late", [], req_id=1)
    with pytest.raises(TransportTimeout, match="within 0.01 s"):
        a.recv(timeout=0.01)
    msg = a.recv(timeout=10)  # the transport stays usable; the reply comes whole
    assert (msg.type, msg.req_id, bytes(msg.meta)) == (REPLY, 1, b"late")
    a.send(STOP)


def _error_while_waiting(make_pair, poll_us: int, act: str) -> tuple:
    a, b = make_pair(poll_us=poll_us)
    _round_trip_once = _echo(b)
    _round_trip(a, 0)  # traffic: the next wait polls (when poll_us > 0)
    a.send(STOP)
    _round_trip_once.join(10)
    target = a if act == "close here" else b
    timer = threading.Timer(0.03, target.close)
    timer.start()
    try:
        with pytest.raises((PeerGone, TransportClosed)) as info:
            a.recv(timeout=10)
    finally:
        timer.join()
    return type(info.value), str(info.value).replace(a.peer, "PEER")


@pytest.mark.parametrize("act", ["close here", "peer closes"])
def test_a_close_while_polling_gives_the_same_error_as_while_blocked(make_pair, act):
    polled = _error_while_waiting(make_pair, LONG_US, act)
    blocked = _error_while_waiting(make_pair, 0, act)
    assert polled == blocked
    assert issubclass(polled[0], TransportClosed if act == "close here" else PeerGone)


def test_other_threads_run_while_a_receiver_polls(make_pair):
    """The poll releases the GIL between turns: a thread of this process that must send
    the very message the receiver polls for gets to run within the window."""
    a, b = make_pair(poll_us=LONG_US)
    _echo(b)
    _round_trip(a, 0)
    polled = a.stats()["rx_polled"]
    sender = threading.Timer(0.01, lambda: b.send(REPLY, b"from a thread", [], req_id=9))
    sender.start()
    msg = a.recv(timeout=10)
    sender.join()
    assert (msg.req_id, bytes(msg.meta)) == (9, b"from a thread")
    assert a.stats()["rx_polled"] == polled + 1  # caught while polling, not after blocking
    a.send(STOP)


def test_the_window_adapts_to_how_long_messages_take():
    w = PollWindow(160)
    assert w.ns == 160_000
    for _ in range(10):
        w.waited(10_000_000)  # 10 ms waits: polling was wasted
    assert w.ns == w.floor_ns == 10_000
    w.waited(200_000)  # a near miss: double
    assert w.ns == 20_000
    w.waited(500_000)  # neither near nor long: unchanged
    assert w.ns == 20_000
    for _ in range(100):
        w.caught()  # replies caught while polling: regrow, never past the maximum
    assert w.ns == 160_000
    assert PollWindow(0).ns == 0


def test_a_yield_that_loses_the_core_pauses_polling():
    w = PollWindow(200)
    assert not w.yielded(150_000, now_ns=1_000_000_000)  # within the window: the core is ours
    assert w.window_at(1_000_000_000) == 200_000
    pauses = []
    now = 1_000_000_000
    for _ in range(14):  # others' work takes the core at every yield
        assert w.yielded(4_000_000, now_ns=now)
        pauses.append(w.paused_until_ns - now)
        assert w.window_at(now) == 0 and w.window_at(w.paused_until_ns - 1) == 0
        now = w.paused_until_ns
        assert w.window_at(now) == w.ns  # after the pause, polling is tried again
    assert pauses[:3] == [1_000_000, 2_000_000, 4_000_000] and max(pauses) == 1_000_000_000
    w.caught()  # a poll caught its message: the core is ours again, the next pause is short
    assert w.yielded(4_000_000, now_ns=now) and w.paused_until_ns - now == 1_000_000


_ECHO_PROCESS = """
import os, sys
from remote_accel.dataplane.tcp import TcpListener
from remote_accel.dataplane.tls import TlsListener, server_context
os.sched_setaffinity(0, {int(sys.argv[1])})
cert = sys.argv[2] if len(sys.argv) > 2 else None
listener = TlsListener("127.0.0.1", 0, tls=server_context(cert, cert + ".key")) if cert else TcpListener("127.0.0.1", 0)
print(listener.port, flush=True)
t = listener.accept(timeout=30)
while True:
    msg = t.recv(timeout=30)
    if msg.type != %d:
        break
    t.send(%d, msg.meta, msg.payloads, req_id=msg.req_id)
""" % (ECHO, REPLY)


@pytest.mark.parametrize("kind", ["tcp", "tls"])
def test_a_receiver_sharing_its_core_with_busy_work_blocks_instead_of_polling(request, kind):
    """On a core that a busy process shares, a yield hands that process a whole scheduler
    slice, and a thread that yielded is not woken when its message lands: the receiver
    must see that and block (to be woken at once), not poll. Every message still arrives."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs: the peer on one, this receiver and a busy process on the other")
    before = os.sched_getaffinity(0)
    busy = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpus[0]}}})\nwhile True: pass"])
    cert = request.getfixturevalue("cert") if kind == "tls" else None
    peer = subprocess.Popen([sys.executable, "-c", _ECHO_PROCESS, str(cpus[1])] + ([cert] if cert else []),
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(peer.stdout.readline())
        os.sched_setaffinity(0, {cpus[0]})  # this thread only
        if cert:
            a = TlsTransport.connect("127.0.0.1", port, tls=client_context(cert), poll_us=200)
        else:
            a = TcpTransport.connect("127.0.0.1", port, poll_us=200)
        for i in range(60):
            _round_trip(a, i)
        stats = a.stats()
        assert stats["rx_yield_lost"] >= 1, stats
        assert stats["rx_slept"] > stats["rx_polled"], stats  # polling paused: the waits blocked
        a.send(STOP)
        a.close()
    finally:
        os.sched_setaffinity(0, before)
        for p in (busy, peer):
            p.kill()
            p.wait()
