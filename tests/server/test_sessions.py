"""Sessions: authentication, isolation, errors at sync points, memory, liveness, shutdown."""

from __future__ import annotations

import select
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from remote_accel.dataplane import codec
from remote_accel.dataplane import messages as m
from remote_accel.dataplane.codec import Ext
from remote_accel.torch_wire import values as torch_values
from remote_accel.errors import (AuthError, ProtocolError, RemoteAccelError, RemoteOpError, RemoteOutOfMemoryError,
                                 TransportError)
from remote_accel.server.testing import Client, ServerProcess, encode_arg

pytestmark = pytest.mark.any_torch


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def only_ours(observer: Client) -> bool:
    """True once the server holds no memory but the observer's own (others have been freed)."""
    stats = observer.stats()
    return stats["server_memory_allocated"] == stats["memory_allocated"]


# -- authentication -------------------------------------------------------------------------------
def test_wrong_token_is_refused(server):
    with pytest.raises(AuthError, match="wrong token"):
        Client.tcp(*server.tcp, token="not-the-token")
    assert "wrong token" in wait_for(lambda: server.log() if "wrong token" in server.log() else "")


def test_first_message_must_be_hello(server):
    with Client.tcp(*server.tcp) as c:
        with pytest.raises(AuthError):
            c.request(m.Ping(1))
        with pytest.raises(TransportError):  # the server closed the connection
            c.request(m.Ping(2), timeout=5)


def test_welcome_names_device_and_session(client, connect):
    other = connect()
    assert client.welcome.device in ("cpu", "cuda:0", "xpu:0", "mps:0")
    assert other.welcome.session != client.welcome.session


# -- isolation ------------------------------------------------------------------------------------
def test_two_clients_are_isolated(connect):
    one, two = connect(), connect()
    a, b = one.upload(torch.ones(4)), two.upload(torch.full((4,), 2.0))
    assert a.sid == b.sid  # both clients number their storages from 1
    one.run("aten::add_.Scalar", a, 10)
    assert torch.equal(one.download(a), torch.full((4,), 11.0))
    assert torch.equal(two.download(b), torch.full((4,), 2.0))
    private = one.alloc(64, sid=4242)
    one.sync()
    with pytest.raises(RemoteOpError) as info:
        two.read(private, 64)
    assert info.value.kind == "bad_handle"


# -- deferred errors ---------------------------------------------------------------------------------
def test_op_errors_are_reported_at_the_next_sync(client):
    a, b = client.upload(torch.ones(3)), client.upload(torch.ones(4))
    bad, dependent = client.empty((3,)), client.empty((3,))
    client.run("aten::add.Tensor", a, b, outs=(bad,))  # shape mismatch
    client.run("aten::neg", bad, outs=(dependent,))  # fails quietly: its input never existed
    with pytest.raises(RemoteOpError) as info:
        client.sync()
    assert info.value.kind == "op" and "size of tensor" in str(info.value)
    assert any("Traceback" in note for note in info.value.__notes__)
    assert client.sync() >= 0  # reported once; the session goes on
    assert torch.equal(client.download(a), torch.ones(3))


def test_pending_errors_answer_read_and_reply(client):
    a = client.upload(torch.ones(3))
    client.run("aten::nope", a)
    with pytest.raises(RemoteOpError, match="unknown_op"):
        client.read(a.sid, 12)
    client.run("aten::mm", a, a, outs=(client.empty((3, 3)),))
    with pytest.raises(RemoteOpError, match="op"):
        client.run_reply("aten::_local_scalar_dense", a.view((), ()))
    assert client.run_reply("aten::_local_scalar_dense", a.view((), ())) == (1.0,)


def test_protocol_errors_are_answered_at_once(client):
    t = client.transport
    t.send(200, b"", req_id=11)  # unknown type
    t.send(int(m.MsgType.RUN), b"\xff\xfe", req_id=12)  # undecodable meta
    t.send(int(m.MsgType.RUN), codec.encode(("aten::add", 1)), req_id=13)  # missing fields
    t.send(int(m.MsgType.BATCH), m.encode(m.Batch(((int(m.MsgType.SYNC), ()),))), req_id=14)
    t.send(int(m.MsgType.WELCOME), m.encode(m.Welcome(1, "x", 0, "y", b"")), req_id=15)  # server-to-client type
    t.send(int(m.MsgType.PING), m.encode(m.Ping(1)), [b"unexpected"], req_id=16)
    for req_id in (11, 12, 13, 14, 15, 16):
        msg = t.recv(timeout=10)
        reply = m.decode(msg.type, msg.meta)
        assert (msg.req_id, type(reply), reply.kind) == (req_id, m.ErrorReply, "protocol")
    assert client.ping(5) == 5


# -- memory ----------------------------------------------------------------------------------------------
def test_a_terabyte_allocation_is_refused(client):
    client.alloc(1 << 40)
    with pytest.raises(RemoteOutOfMemoryError) as info:
        client.sync()
    assert info.value.kind == "oom"
    assert client.stats()["memory_allocated"] == 0
    assert client.ping() == 7


@pytest.fixture(scope="module")
def limited():
    with ServerProcess("--memory-limit", "1M", "--heartbeat-timeout", "1.5", "--max-clients", "3") as proc:
        yield proc
        assert proc.alive(), proc.log()


def test_memory_limit_gives_oom_and_the_session_goes_on(limited):
    with Client.tcp(*limited.tcp, token=limited.token) as c:
        assert c.welcome.memory_limit == 1 << 20
        x = c.upload(torch.ones(256, 256))  # 256 KiB
        c.alloc(1 << 20)
        with pytest.raises(RemoteOutOfMemoryError):
            c.sync()
        big = c.empty((512, 512))  # 1 MiB of output: refused before the op runs
        c.run("aten::mm", x, x, outs=(big,))
        with pytest.raises(RemoteOutOfMemoryError):
            c.sync()
        small = c.empty((256, 256))
        c.run("aten::add.Tensor", x, x, outs=(small,))
        assert torch.equal(c.download(small), torch.full((256, 256), 2.0))
        stats = c.stats()
        assert stats["memory_allocated"] == 2 * 256 * 256 * 4 and stats["storages"] == 2


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def test_a_client_pushing_uploads_and_reads_stays_within_its_limit(limited):
    """Issue #39 item 5: a client cannot make the server hold more than its limit, with
    storages or with payloads that land elsewhere (a SINK's, a write to no storage, an
    over-large staged write, an ECHO's), and a client over its limit never costs another
    client anything."""
    with Client.tcp(*limited.tcp, token=limited.token) as good, \
            Client.tcp(*limited.tcp, token=limited.token) as greedy:
        mine = good.upload(torch.arange(64 * 1024, dtype=torch.float32))  # 256 KiB
        kept = []
        for step in range(12):  # uploads kept alive in a loop: refused once past 1 MiB
            data = torch.full((64 * 1024,), float(step))
            kept.append(greedy.upload(data))
            try:
                greedy.sync()
            except RemoteOutOfMemoryError:
                kept.pop()
                break
            assert torch.equal(greedy.download(kept[-1]), data)  # large reads in the loop
        else:
            pytest.fail("12 uploads of 256 KiB fitted in a 1 MiB limit")
        assert len(kept) == 4 and greedy.stats()["memory_allocated"] == 1 << 20
        assert torch.equal(good.download(mine), torch.arange(64 * 1024, dtype=torch.float32))

        # 512 MiB of payloads nobody keeps, far past the limit: read through a small buffer
        # (the server's resident memory does not grow by them), and the session goes on
        rss_before = _rss(limited.proc.pid)
        greedy.send(m.Sink(1), payloads=(np.zeros(512 << 20, np.uint8),))
        assert greedy.ping() == 7 and _rss(limited.proc.pid) - rss_before < 64 << 20
        with pytest.raises(RemoteAccelError, match="bad_handle|no storage|does not exist"):
            greedy.write(1 << 40, np.zeros(4 << 20, np.uint8))  # to a storage that does not exist
            greedy.sync()
        sid = greedy.new_sid()  # allocated and written in one batch: staged, past the limit
        greedy.batch(m.AllocStorage(sid, 2 << 20), m.WriteStorage(sid, 0, 2 << 20),
                     payloads=(np.zeros(2 << 20, np.uint8),))
        with pytest.raises(RemoteOutOfMemoryError):
            greedy.sync()
        stats = greedy.stats()
        assert stats["memory_allocated"] == 1 << 20 and stats["storages"] == 4
        assert all(torch.equal(greedy.download(ref), torch.full((64 * 1024,), float(i))) for i, ref in enumerate(kept))

        greedy.free(*(ref.sid for ref in kept))  # room again
        greedy.sync()
        greedy.request(m.Echo(2), payloads=(np.zeros(512 << 10, np.uint8),))  # fits: answered
        # an echo's payload must be held to be sent back: past the limit, refused, read through
        with pytest.raises(RemoteOutOfMemoryError, match="ECHO of 2097152 bytes.*memory limit"):
            greedy.request(m.Echo(3), payloads=(np.zeros(2 << 20, np.uint8),))
        assert greedy.ping() == 7  # and the session goes on
        assert good.ping() == 7 and torch.equal(good.download(mine), torch.arange(64 * 1024, dtype=torch.float32))
    assert limited.alive()


def test_kept_plans_count_against_the_limit(limited):
    """A plan (RunOp.plan) the server keeps for later calls holds memory too: past the
    limit, defining one more is refused as out of memory (and the op does not run), and
    defining a kept plan's id again gives its room back first."""
    with Client.tcp(*limited.tcp, token=limited.token) as c:
        x = c.upload(torch.zeros(4))
        args = encode_arg(([x] * 10_000, 1.0))  # about 200 KB as the wire encodes it

        def define(plan):
            c.send(m.RunOp("aten::_foreach_add_.Scalar", args, {}, (), False, None, plan))
            c.sync()

        kept = 0
        with pytest.raises(RemoteOutOfMemoryError, match="memory limit"):
            for plan in range(1, 20):
                define(plan)
                kept += 1
        assert 1 <= kept < 10
        assert torch.equal(c.download(x), torch.full((4,), 10_000.0 * kept))
        define(1)  # plan 1 again: its old definition's room comes back first
        assert torch.equal(c.download(x), torch.full((4,), 10_000.0 * (kept + 1)))


def test_silent_client_is_dropped_and_freed(limited):
    with Client.tcp(*limited.tcp, token=limited.token) as idle, \
            Client.tcp(*limited.tcp, token=limited.token) as observer:
        idle.upload(torch.ones(1000))
        idle.sync()
        assert observer.stats()["server_memory_allocated"] >= 4000
        wait_for(lambda: only_ours(observer), timeout=10, what="the idle client's memory to be freed")
        with pytest.raises(TransportError):
            idle.ping()
    assert "heartbeat timeout" in limited.log()


def test_goodbye_frees_everything(limited):
    with Client.tcp(*limited.tcp, token=limited.token) as leaving, \
            Client.tcp(*limited.tcp, token=limited.token) as observer:
        leaving.upload(torch.ones(1000))
        leaving.sync()
        leaving.goodbye()
        wait_for(lambda: only_ours(observer), what="memory freed after GOODBYE")
        with pytest.raises(TransportError):
            leaving.recv(timeout=5)


def test_a_client_that_leaves_while_its_work_runs_is_read_to_its_goodbye(server):
    """A script that ends without waiting for its last work: its queued ops and GOODBYE are
    sent, then its socket closes with one of the server's busy beats unread, so its kernel
    answers the next beat with a reset. That failed beat must not end the session before
    the session has read what the client sent (the heartbeat thread used to close the
    transport: the work was dropped and the log said "connection lost")."""
    a = torch.randn(1024, 1024)
    with torch.inference_mode():
        start = time.perf_counter()
        for _ in range(5):
            a @ a
    # about 3 s of work on one core here: the server is still busy a beat after the client left
    n = max(20, int(3.0 / ((time.perf_counter() - start) / 5)))
    with Client.tcp(*server.tcp, token=server.token) as c:
        ref = c.upload(a)
        c.sync()
        out = c.empty((1024, 1024))
        c.batch(*[m.RunOp("aten::mm", encode_arg((ref, ref)), encode_arg({}), encode_arg((out,)), False)] * n)
        ready, _, _ = select.select([c.transport.fileno()], [], [], 10)
        assert ready, "no busy beat came"
        c.goodbye()
        session = c.welcome.session
    wait_for(lambda: f"client disconnected: session {session}," in server.log(), timeout=120,
             what="the session's end")
    ended = next(line for line in server.log().splitlines() if f"client disconnected: session {session}," in line)
    assert ": goodbye; freed" in ended and int(ended.rsplit("after ", 1)[1].split()[0]) >= n, ended


def test_max_clients(limited):
    clients = [Client.tcp(*limited.tcp, token=limited.token) for _ in range(3)]
    try:
        with pytest.raises(RemoteOpError, match="busy"):
            Client.tcp(*limited.tcp, token=limited.token)
    finally:
        for c in clients:
            c.close()
    # a slot frees up once a client leaves
    def admitted():
        try:
            Client.tcp(*limited.tcp, token=limited.token).close()
            return True
        except RemoteOpError:
            return False

    wait_for(admitted, what="a free client slot")


KILLED_CLIENT = textwrap.dedent("""
    import sys, time, torch
    from remote_accel.server.testing import Client
    c = Client.tcp(sys.argv[1], int(sys.argv[2]), token=sys.argv[3])
    c.upload(torch.ones(1 << 20))
    c.sync()
    print(c.welcome.session, flush=True)
    time.sleep(60)
""")


def test_killed_client_memory_is_freed(server, client):
    host, port = server.tcp
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, host, str(port), server.token],
                            stdout=subprocess.PIPE, text=True)
    try:
        session = int(proc.stdout.readline())
        assert client.stats()["server_memory_allocated"] >= 4 << 20
        proc.kill()
        proc.wait(10)
        wait_for(lambda: only_ours(client), what="the killed client's memory to be freed")
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
    wait_for(lambda: f"client disconnected: session {session}," in server.log(), what="the disconnect log line")


# -- everything else --------------------------------------------------------------------------------------
def test_echo_sink_ping_stats(client):
    payloads = [np.arange(100, dtype=np.uint8), b"", b"hello"]
    client.send(m.Echo(3), payloads)
    reply, data = client.recv()
    assert reply == m.EchoReply(3) and [bytes(d) for d in data] == [bytes(p) for p in payloads]
    client.send(m.Sink(1), [bytes(1000), bytes(24)])
    client.send(m.EmptyCache())
    stats = client.stats()
    assert (stats["sink_messages"], stats["sink_bytes"]) == (1, 1024)
    assert {"memory_allocated", "max_memory_allocated", "memory_limit", "storages", "device",
            "ops_done", "server_sessions"} <= set(stats)


def test_run_graph_runs_and_reruns_by_id(client):
    g = lambda i: Ext(torch_values.GRAPH_VALUE, i)  # noqa: E731
    a, b = torch.randn(5), torch.randn(5)
    ra, rb = client.upload(a), client.upload(b)
    nodes = (("aten::mul.Tensor", (g(0), g(0)), {}), ("aten::add.Tensor", (g(2), g(1)), {}),
             ("aten::max.dim", (g(3), 0), {}))
    out, top = client.empty((5,)), client.empty((), torch.int64)
    client.send(m.RunGraph(7, nodes, encode_arg((ra, rb)), (g(3), g((4, 1))), encode_arg((out, top))))
    torch.testing.assert_close(client.download(out), a * a + b)
    assert int(client.download(top)) == int((a * a + b).argmax())
    again = client.empty((5,))
    client.send(m.RunGraph(7, (), encode_arg((rb, ra)), (g(3),), encode_arg((again,))))
    torch.testing.assert_close(client.download(again), b * b + a)


def test_a_graph_rerun_inside_a_batch_runs_in_order_with_the_ops_around_it(client):
    """A rerun by id travels inside a Batch (the client queues it like an op): the C++
    loop hands it to Python and goes on with the items after it, in order."""
    g = lambda i: Ext(torch_values.GRAPH_VALUE, i)  # noqa: E731
    a, b = torch.randn(5), torch.randn(5)
    ra, rb = client.upload(a), client.upload(b)
    nodes = (("aten::mul.Tensor", (g(0), g(0)), {}), ("aten::add.Tensor", (g(2), g(1)), {}))
    first = client.empty((5,))
    client.send(m.RunGraph(8, nodes, encode_arg((ra, rb)), (g(3),), encode_arg((first,))))
    again, doubled, unknown = client.empty((5,)), client.empty((5,)), client.empty((5,))
    client.batch(m.RunOp("aten::add_.Tensor", encode_arg((rb, ra)), {}, encode_arg((rb,)), False),  # b := a + b
                 m.RunGraph(8, (), encode_arg((rb, ra)), (), encode_arg((again,))),  # (a + b)^2 + a
                 m.RunOp("aten::mul.Tensor", encode_arg((again, ra)), {}, encode_arg((doubled,)), False))
    torch.testing.assert_close(client.download(again), (a + b) ** 2 + a)
    torch.testing.assert_close(client.download(doubled), ((a + b) ** 2 + a) * a)
    # an upload after the rerun in the same batch must not land before the graph read it
    old_b, new_b, later = client.download(rb), torch.randn(5), client.empty((5,))
    client.batch(m.RunGraph(8, (), encode_arg((rb, ra)), (), encode_arg((later,))),
                 m.WriteStorage(rb.sid, 0, 20), payloads=[new_b.numpy().tobytes()])
    torch.testing.assert_close(client.download(later), old_b ** 2 + a)
    torch.testing.assert_close(client.download(rb), new_b)
    negated, newer_b = client.empty((5,)), torch.randn(5)  # the same after an op
    client.batch(m.RunOp("aten::neg", encode_arg((rb,)), {}, encode_arg((negated,)), False),
                 m.WriteStorage(rb.sid, 0, 20), payloads=[newer_b.numpy().tobytes()])
    torch.testing.assert_close(client.download(negated), -new_b)
    torch.testing.assert_close(client.download(rb), newer_b)
    client.batch(m.RunGraph(99, (), encode_arg((ra, rb)), (), encode_arg((unknown,))))
    with pytest.raises(RemoteOpError, match="99"):
        client.sync()
    assert client.sync() >= 0  # the session goes on


def test_graph_results_unlike_their_promise_are_errors_at_the_next_sync(client):
    """A graph's results are placed as its outs promise (in C++): a wrong shape, more outs
    than results or a result that is no tensor is an op error at the next sync, and
    the session goes on."""
    g = lambda i: Ext(torch_values.GRAPH_VALUE, i)  # noqa: E731
    a = torch.randn(5)
    ra = client.upload(a)
    nodes = (("aten::mul.Tensor", (g(0), g(0)), {}), ("aten::sum", (g(1),), {}), ("aten::sym_size.int", (g(0), 0), {}))
    for n, (outputs, outs, why) in enumerate((
            ((g(1),), (client.empty((4,)),), "result 0 has shape (5,), the client expects (4,)"),
            ((g(1),), (client.empty((5,)), client.empty(())), "the op returned 1 results, the client expects 2"),
            ((g(3),), (client.empty(()),), "result 0 is int, the client expects a tensor"))):
        client.send(m.RunGraph(20 + n, nodes, encode_arg((ra,)), outputs, encode_arg(outs)))
        with pytest.raises(RemoteOpError) as info:
            client.sync()
        assert info.value.kind == "op" and why in str(info.value)
    square, total = client.empty((5,)), client.empty(())
    client.send(m.RunGraph(30, nodes[:2], encode_arg((ra,)), (g(1), g(2)), encode_arg((square, total))))
    torch.testing.assert_close(client.download(square), a * a)
    torch.testing.assert_close(client.download(total), (a * a).sum())


def test_rng_state_round_trip(client):
    state = client.request(m.Rng("get", None))[0].state
    x = client.upload(torch.zeros(6))
    client.run("aten::uniform_", x)
    first = client.download(x)
    client.request(m.Rng("set", None, state))
    client.run("aten::uniform_", x)
    assert torch.equal(client.download(x), first)
    with pytest.raises(ProtocolError):
        client.request(m.Rng("spin", None))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_shut_down_cleanly(sig):
    with ServerProcess() as proc, Client.tcp(*proc.tcp, token=proc.token) as c:
        c.upload(torch.ones(10))
        c.sync()
        proc.proc.send_signal(sig)
        assert proc.proc.wait(20) == 0
        with pytest.raises(TransportError):
            c.ping()
        log = proc.log()
        assert "client disconnected: session 1" in log and "stopped" in log
