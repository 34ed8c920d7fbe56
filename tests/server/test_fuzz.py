"""Bad input, on purpose and at random: structured errors or a clean disconnect, never a
crash, and a well-behaved client connected at the same time keeps getting right answers."""

from __future__ import annotations

import os
import socket

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remote_accel._version import WIRE_VERSION
from remote_accel.dataplane import codec, wire
from remote_accel.torch_wire import values as torch_values
from remote_accel.dataplane import messages as m
from remote_accel.dataplane.codec import Ext
from remote_accel.dataplane.handshake import client_handshake
from remote_accel.dataplane.tcp import TcpTransport
from remote_accel.server.testing import Client, ServerProcess, unread_bytes, wait_for

#: Tests of bytes, lengths and message structure (the wire, the codec, the handshake) are
#: the same under any torch (any_torch: the models venv's run leaves them out); those that
#: make the server run aten ops on fuzzed arguments meet torch's own argument checks, whose
#: errors (and crashes) a torch version can change: they run under every torch.
ANY_TORCH = pytest.mark.any_torch

#: REMOTE_ACCEL_FUZZ_EXAMPLES=1000 for a longer hunt than CI's.
FUZZ = settings(max_examples=int(os.environ.get("REMOTE_ACCEL_FUZZ_EXAMPLES", "60")), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def target():
    # A memory limit keeps random allocations small; a short heartbeat reaps stuck sessions.
    with ServerProcess("--memory-limit", "64M", "--heartbeat-timeout", "5") as proc:
        yield proc
        assert proc.alive(), f"the server died:\n{proc.log()}"
        assert "Traceback" not in proc.log(), f"the server hit a bug:\n{proc.log()}"


class Bystander:
    """A client that keeps working correctly while others misbehave."""

    def __init__(self, server):
        self.client = Client.tcp(*server.tcp, token=server.token)
        self.a, self.b = torch.randn(16), torch.randn(16)
        self.ra, self.rb = self.client.upload(self.a), self.client.upload(self.b)

    def check(self) -> None:
        out = self.client.empty((16,))
        self.client.run("aten::mul.Tensor", self.ra, self.rb, outs=(out,))
        assert torch.equal(self.client.download(out), self.a * self.b)
        self.client.free(out.sid)


@pytest.fixture(scope="module")
def bystander(target):
    b = Bystander(target)
    yield b
    b.client.close()


def raw_session(server, authenticated: bool = True) -> socket.socket:
    sock = socket.create_connection(server.tcp, timeout=10)
    if authenticated:
        client_handshake(TcpTransport(sock), server.token, "fuzz", timeout=10)
    return sock


def send_then_drain(sock: socket.socket, data: bytes) -> bytes:
    """Send, say we are done, and return the server's answer. The server may close the
    connection before it has read everything: that is an allowed outcome, not an error."""
    try:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    return drain(sock)


def drain(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (or goes quiet)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (socket.timeout, ConnectionError):
        pass
    return data


def frame(msg_type: int, meta: bytes, payloads=()) -> bytes:
    return wire.encode_prologue(msg_type, meta, [len(p) for p in payloads]) + b"".join(payloads)


# -- raw bytes ------------------------------------------------------------------------------------------------
@ANY_TORCH
@FUZZ
@given(data=st.binary(min_size=1, max_size=2000), authenticated=st.booleans())
def test_random_bytes(target, bystander, data, authenticated):
    with raw_session(target, authenticated) as sock:
        send_then_drain(sock, data)
    bystander.check()


@ANY_TORCH
@FUZZ
@given(st.data())
def test_truncated_messages(target, bystander, data):
    meta = m.encode(m.WriteStorage(1, 0, 64))
    whole = frame(m.MsgType.WRITE, meta, [bytes(64)])
    cut = data.draw(st.integers(1, len(whole) - 1))
    with raw_session(target) as sock:
        # the server sees the peer leave mid-message
        send_then_drain(sock, frame(m.MsgType.ALLOC, m.encode(m.AllocStorage(1, 64))) + whole[:cut])
    bystander.check()


@ANY_TORCH
@pytest.mark.parametrize("fields", [
    dict(meta_len=wire.DEFAULT_LIMITS.max_meta + 1),
    dict(n_payloads=wire.DEFAULT_LIMITS.max_payloads + 1),
    dict(payload_total=wire.DEFAULT_LIMITS.max_payload_total + 1),
])
def test_oversized_lengths_close_the_connection(target, bystander, fields):
    values = dict(meta_len=0, n_payloads=0, payload_total=0)
    values.update(fields)
    head = wire.HEADER.pack(wire.MAGIC, WIRE_VERSION, int(m.MsgType.PING), 0, values["n_payloads"], 1,
                            values["meta_len"], values["payload_total"], 0)
    with raw_session(target) as sock:
        assert send_then_drain(sock, head) == b""  # closed at once, nothing allocated
    bystander.check()


@ANY_TORCH
def test_a_huge_echo_that_cannot_be_taken_ends_the_session(target, bystander):
    prologue = wire.encode_prologue(m.MsgType.ECHO, m.encode(m.Echo(1)), [8 << 30])
    with raw_session(target) as sock:
        reply = send_then_drain(sock, prologue + bytes(4096))
    header, _, reply_meta, _ = wire.decode_prologue(reply)
    assert header.type == m.MsgType.ERROR and m.decode(header.type, reply_meta).kind == "protocol"
    bystander.check()


@ANY_TORCH
@pytest.mark.parametrize("msg_type, meta, total", [
    (m.MsgType.WRITE, m.encode(m.WriteStorage(1, 0, 60 << 30)), 60 << 30),  # a bad target, 60 GiB
    (m.MsgType.SINK, m.encode(m.Sink(1)), 8 << 30),
])
def test_huge_payloads_nobody_keeps_are_read_through(target, bystander, msg_type, meta, total):
    """Bytes the server throws away pass through a small buffer (transport.Discard), so
    no size of them can make it hold memory: it reads on, waiting for the rest, and a
    peer that leaves mid-payload ends only its own session."""
    prologue = wire.encode_prologue(msg_type, meta, [total])
    with raw_session(target) as sock:
        sock.sendall(prologue + bytes(8 << 20))
        # the scenario: the server has read all 8 MiB (more than the socket buffers hold)
        # and waits for the rest; a slow server that had not come to them yet would
        # still answer or close later
        wait_for(lambda: unread_bytes(sock) in (0, None), "the server to read what was sent")
        assert unread_bytes(sock) == 0, "the server closed the connection"
        sock.settimeout(0.5)
        with pytest.raises(socket.timeout):  # no error, no close: it is reading on
            sock.recv(1)
    bystander.check()


# -- well-formed messages with wrong contents ----------------------------------------------------------------
SEMANTIC_ERRORS = [
    ("unknown_op", lambda c, x: c.run("aten::no_such_op", x)),
    ("unknown_op", lambda c, x: c.run("os.system", "true")),
    ("unknown_op", lambda c, x: c.run("aten::__class__", x)),
    ("unknown_op", lambda c, x: c.run("aten::add.__init__", x, x)),
    ("unknown_op", lambda c, x: c.run("aten::save", x, "/tmp/x")),  # a JIT builtin, not a dispatcher op
    ("unknown_op", lambda c, x: c.run("aten::from_file", "/etc/passwd")),
    ("bad_handle", lambda c, x: c.run("aten::neg", x._replace(sid=999), outs=(c.empty((4,)),))),
    ("bad_handle", lambda c, x: c.run("aten::neg", x.view((5,), (1,)), outs=(c.empty((5,)),))),  # past the end
    ("bad_handle", lambda c, x: c.write(999, b"abc")),
    ("bad_handle", lambda c, x: c.write(x.sid, bytes(8), offset=12)),
    ("bad_handle", lambda c, x: c.alloc(8, sid=x.sid)),  # already exists
    ("op", lambda c, x: c.run("aten::add.Tensor", x, x, outs=(c.empty((5,)),))),  # shape mismatch
    ("op", lambda c, x: c.run("aten::mm", x, x, outs=(c.empty((4, 4)),))),
    ("oom", lambda c, x: c.alloc(1 << 40)),
    # an op's own allocation failing in the device allocator (1 PiB: beyond any address space)
    ("oom", lambda c, x: c.run("aten::empty.memory_format", [1 << 50], dtype=torch.uint8)),
    ("oom", lambda c, x: c.run("aten::resize_", x, [1 << 25])),  # grows a storage past the limit
    ("protocol", lambda c, x: c.alloc(-5)),
    ("protocol", lambda c, x: c.run("aten::neg", Ext(torch_values.TENSOR, (x.sid, "float128", (4,), (1,), 0, 0)))),
    ("protocol", lambda c, x: c.run("aten::neg", Ext(torch_values.TENSOR, (x.sid, "float32", (-4,), (1,), 0, 0)))),
    ("protocol", lambda c, x: c.run("aten::neg", Ext(99, 1))),
    ("protocol", lambda c, x: c.send(m.RunGraph(1, (("aten::neg", (Ext(torch_values.GRAPH_VALUE, 5),), {}),),
                                                (), (), ()))),
    ("protocol", lambda c, x: c.send(m.RunPlanned(12345, (x.sid,)))),  # never defined
    ("protocol", lambda c, x: _planned(c, x, (x.sid,))),  # a value short
    ("protocol", lambda c, x: _planned(c, x, (b"\0" * 4, c.new_sid()))),  # bytes where a storage id goes
]


def _planned(c: Client, x, values: tuple) -> None:
    """Define plan 9 as neg(x) -> a new storage, then run it with `values`."""
    c.send(m.RunOp("aten::neg", (x.ext,), {}, (c.empty((4,)).ext,), False, None, 9))
    c.sync()
    c.send(m.RunPlanned(9, values))


@pytest.mark.parametrize("kind, action", SEMANTIC_ERRORS)
def test_semantic_errors_are_structured(target, bystander, kind, action):
    with Client.tcp(*target.tcp, token=target.token) as c:
        x = c.upload(torch.ones(4))
        action(c, x)
        with pytest.raises(Exception) as info:
            c.sync()
        assert getattr(info.value, "kind", None) == kind, info.value
        assert torch.equal(c.download(x)[:4], torch.ones(4)) or kind == "oom"
        assert c.ping() == 7
    bystander.check()


def test_semantic_errors_in_replies(target, bystander):
    with Client.tcp(*target.tcp, token=target.token) as c:
        x = c.upload(torch.ones(4))
        with pytest.raises(Exception, match="bad_handle"):
            c.read(999, 4)
        with pytest.raises(Exception, match="bad_handle"):
            c.read(x.sid, 17)
        with pytest.raises(Exception, match="unknown_op"):
            c.run_reply("aten::nonexistent", x)
        with pytest.raises(Exception, match="must be a matrix"):
            c.run_reply("aten::mm", x, x, outs=(50,))
        assert c.sync() >= 0
    bystander.check()


# -- random well-formed messages -------------------------------------------------------------------------------
leaf = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 63) - 1), st.floats(allow_nan=True),
                 st.text(max_size=20), st.binary(max_size=20))
small = st.integers(-2, 6)
refs = st.builds(lambda sid, dtype, shape, stride, off, flags: Ext(torch_values.TENSOR, (sid, dtype, shape, stride, off, flags)),
                 st.integers(0, 3), st.sampled_from(["float32", "int64", "bool", "complex64", "bogus"]),
                 st.lists(small, max_size=3).map(tuple), st.lists(small, max_size=3).map(tuple), small, st.integers(0, 4))
values = st.recursive(
    st.one_of(leaf, refs, st.builds(Ext, st.integers(0, 10), leaf)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.lists(inner, max_size=4).map(tuple),
                            st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=12)
op_names = st.one_of(st.sampled_from(["aten::add.Tensor", "aten::mm", "aten::neg", "aten::copy_", "aten::resize_",
                                      "aten::as_strided", "aten::set_.source_Tensor", "aten::index_put_",
                                      "aten::empty.memory_format", "aten::_copy_from", "aten::view",
                                      "aten::convolution_overrideable", "aten::normal_", "aten::cat"]),
                     st.text(max_size=30))
requests = st.one_of(
    st.builds(m.RunOp, op_names, st.lists(values, max_size=4).map(tuple),
              st.dictionaries(st.sampled_from(["out", "alpha", "generator", "dim", "dtype"]), values, max_size=2),
              st.lists(st.one_of(st.none(), refs), max_size=2).map(tuple), st.just(False)),
    st.builds(m.RunOp, op_names, st.lists(values, max_size=3).map(tuple), st.just({}),
              st.lists(st.one_of(st.none(), st.integers(0, 20)), max_size=2).map(tuple), st.just(True)),
    st.builds(m.AllocStorage, st.integers(0, 5), st.integers(-10, 1 << 41)),
    st.builds(m.FreeStorage, st.lists(leaf, max_size=3).map(tuple)),
    st.builds(m.ReadStorage, st.integers(0, 5), st.integers(-2, 40), st.integers(-2, 40)),
    st.builds(m.Rng, st.sampled_from(["get", "set", "x"]), values, st.binary(max_size=40)),
    st.builds(m.RunGraph, st.integers(0, 3), st.lists(st.tuples(op_names, st.lists(values, max_size=3).map(tuple),
                                                                st.just({})), max_size=3).map(tuple),
              st.lists(values, max_size=2).map(tuple), st.lists(values, max_size=2).map(tuple),
              st.lists(st.one_of(st.none(), refs), max_size=2).map(tuple)),
    st.builds(m.RunOp, op_names, st.lists(values, max_size=3).map(tuple), st.just({}),
              st.lists(st.one_of(st.none(), refs), max_size=2).map(tuple), st.booleans(), st.none(),
              st.one_of(st.integers(0, 3), leaf)),
    st.builds(m.RunPlanned, st.one_of(st.integers(0, 3), leaf),
              st.lists(st.one_of(st.integers(0, 5), leaf), max_size=4).map(tuple)),
    st.builds(m.Sync), st.builds(m.Stats), st.builds(m.Ping, st.integers(0, 100)),
)


def still_serving(c: Client) -> None:
    """Ping with a nonce no fuzzed request uses and read every answer up to its Pong:
    each must be a well-formed message, and the session must be alive to answer."""
    c.send(m.Ping(1 << 40))
    for _ in range(1000):
        reply, _ = c.recv(timeout=30)
        if type(reply) is m.Pong and reply.nonce == 1 << 40:
            return
    raise AssertionError("no PONG after 1000 answers")


@FUZZ
@given(batch=st.lists(requests, min_size=1, max_size=5))
def test_random_requests(target, bystander, batch):
    with Client.tcp(*target.tcp, token=target.token) as c:
        c.upload(torch.arange(8, dtype=torch.float32))  # sid 1, for requests to find
        for request in batch:
            c.send(request)
        still_serving(c)
    bystander.check()


@ANY_TORCH
@FUZZ
@given(meta=values)
def test_random_meta_for_every_type(target, bystander, meta):
    with Client.tcp(*target.tcp, token=target.token) as c:
        for msg_type in list(wire.MsgType) + [0, 99, 255]:
            if msg_type not in (m.MsgType.GOODBYE, m.MsgType.HELLO):
                c.transport.send(int(msg_type), codec.encode(meta))
        still_serving(c)
    bystander.check()


batch_members = st.one_of(
    st.builds(m.AllocStorage, st.integers(0, 5), st.integers(-2, 1 << 12)),
    st.builds(m.WriteStorage, st.integers(0, 5), st.integers(-2, 40), st.integers(0, 40)),
    st.builds(m.FreeStorage, st.lists(st.one_of(st.integers(0, 5), leaf, st.lists(leaf, max_size=2)), max_size=3)
              .map(tuple)),
    st.builds(m.RunOp, op_names, st.lists(values, max_size=3).map(tuple), st.just({}),
              st.lists(st.one_of(st.none(), refs), max_size=2).map(tuple), st.booleans()),
)


@FUZZ
@given(data=st.data())
def test_random_batches(target, bystander, data):
    members = data.draw(st.lists(st.one_of(batch_members.map(m.batch_item),
                                           st.tuples(st.integers(0, 70), values)), max_size=6))
    writes = [fields[2] for kind, fields in members
              if kind == m.MsgType.WRITE and type(fields) is tuple and len(fields) == 3]
    if data.draw(st.booleans(), label="payloads match the writes"):
        payloads = [bytes(max(n, 0)) for n in writes]
    else:
        payloads = data.draw(st.lists(st.binary(max_size=48), max_size=4))
    with Client.tcp(*target.tcp, token=target.token) as c:
        c.upload(torch.arange(8, dtype=torch.float32))
        c.transport.send(int(m.MsgType.BATCH), codec.encode((tuple(members),)), payloads)
        still_serving(c)
    bystander.check()
