"""Plans: the first call of an op on given arguments makes one in Python (fallback.py),
later calls are served from it in C++ (csrc/op_queue.cpp), against a real server.

A served call only fills storage ids and CPU scalar values into the plan's encoding. It
must say exactly what the Python call said, never replay a value of an earlier call,
announce storages the server has not seen, and keep requests in the order they were made.
"""

from __future__ import annotations

import struct
import threading
import time

import pytest
import torch

import remote_accel
from remote_accel.dataplane import codec
from remote_accel.dataplane import messages as m
from remote_accel.torch_wire import values as torch_values
from remote_accel.pytorch_ext import fallback, runtime
from remote_accel.pytorch_ext.session import FLUSH_AFTER_S
from remote_accel.server.testing import ServerProcess


@pytest.fixture(scope="module")
def session():
    with ServerProcess() as server:
        remote_accel.init(transport="tcp", server="%s:%d" % server.tcp, token=server.token)
        session = runtime.sessions()[0]
        session.flush_after = None  # these tests look at what is queued: no timer flush
        yield session
        remote_accel.shutdown()


def _queued(session) -> list:
    """The requests queued since the last flush (in Python and in C++), decoded, then sent."""
    with session._lock:
        session._take_native()
        items = codec.decode(codec.tuple_header(session._batch_items) + bytes(session._batch))
        session.flush()
    return list(items)


def _of_type(items, cls) -> list:
    return [m.from_fields(cls, tuple(fields)) for kind, fields in items if kind == cls.TYPE]


def _served() -> int:
    """Calls served from plans in C++ so far."""
    return fallback._C.plan_stats()[1]


def _holes(value) -> list:
    """A RunOp's plan holes in wire order: tensor references' storage ids, inline CPU
    tensors' bytes (what the server fills from a RunPlanned's values)."""
    if isinstance(value, m.RunOp):
        return _holes((value.args, value.kwargs, value.outs))
    if isinstance(value, codec.Ext):
        if value.code == torch_values.TENSOR:
            return [value.value[0]]
        if value.code == torch_values.CPU_TENSOR:
            return [value.value[2]]
        return []
    if isinstance(value, (list, tuple)):
        return [h for v in value for h in _holes(v)]
    if isinstance(value, dict):
        return [h for v in value.values() for h in _holes(v)]
    return []


def test_a_served_call_fills_the_holes_of_the_call_that_made_the_plan(session):
    a = torch.randn(4, 5, device="remote_accel")
    b = torch.randn(4, 5, device="remote_accel")[1:]  # a view: another offset
    session.flush()
    fallback.forget_plans()
    first = torch.addcmul(a[1:], b, b, value=0.5)  # addcmul.out(self, tensor1, tensor2, value=, out=)
    defining = _of_type(_queued(session), m.RunOp)[-1]
    assert defining.plan is not None and defining.op == "aten::addcmul.out"
    served = _served()
    again = torch.addcmul(a[1:], b, b, value=0.5)
    items = _queued(session)
    assert _served() == served + 1 and not _of_type(items, m.RunOp)  # C++ sent it, not Python
    (planned,) = _of_type(items, m.RunPlanned)
    assert planned.plan == defining.plan
    before, now = _holes(defining), list(planned.values)
    assert len(now) == len(before) == 4  # self, tensor1, tensor2, out
    assert now[:3] == before[:3] == [fallback._C.storage_id(t) for t in (a, b, b)]
    assert now[3] == fallback._C.storage_id(again) != before[3] == fallback._C.storage_id(first)
    torch.testing.assert_close(again.cpu(), first.cpu())
    torch.testing.assert_close(again.cpu(), torch.addcmul(a.cpu()[1:], b.cpu(), b.cpu(), value=0.5))


def test_cpu_scalars_travel_as_their_bytes(session):
    x = torch.zeros(3, device="remote_accel")
    x.add_(torch.tensor(1.5, dtype=torch.float64))  # a 0-dim CPU tensor argument
    session.flush()
    x.add_(torch.tensor(-2.25, dtype=torch.float64))
    (planned,) = _of_type(_queued(session), m.RunPlanned)
    assert planned.values[1] == struct.pack("<d", -2.25)
    assert x.cpu().tolist() == [-0.75] * 3


def test_scalars_are_never_replayed(session):
    x = torch.zeros(3, device="remote_accel")
    for step in range(1, 6):  # wrapped numbers: CPU scalars filled in per call
        x.add_(float(step))
    assert x.cpu().tolist() == [15.0] * 3
    for value in (0.0, -0.0, 2.5):  # Scalar arguments: part of the cache key, -0.0 too
        x.fill_(value)
        assert torch.equal(torch.signbit(x).cpu(), torch.signbit(torch.full((3,), value)))
        assert x.cpu().tolist() == [value] * 3


def test_every_call_names_its_own_tensors(session):
    xs = [torch.full((2, 2), float(i), device="remote_accel") for i in range(4)]
    outs = [x * x + x for x in xs]  # one plan per op, four different storages
    assert [o.cpu()[0, 0].item() for o in outs] == [i * i + i for i in range(4)]


def test_a_storage_the_server_has_not_seen_is_announced_first(session):
    first = torch.empty(3, device="remote_accel")
    first.fill_(2.0)  # makes fill_'s plan
    assert first.cpu().tolist() == [2.0] * 3
    fresh = torch.empty(3, device="remote_accel")  # a storage only the client knows
    served = _served()
    fresh.fill_(2.0)
    assert _served() == served + 1
    alloc, run = _queued(session)[-2:]
    assert alloc[0] == m.AllocStorage.TYPE and run[0] == m.RunPlanned.TYPE
    assert m.from_fields(m.AllocStorage, tuple(alloc[1])).sid == fallback._C.storage_id(fresh)
    assert fresh.cpu().tolist() == [2.0] * 3


def test_requests_keep_their_order_across_python_and_cpp(session):
    x = torch.zeros(4, device="remote_accel")
    x.add_(1.0)
    for i in range(50):  # served in C++, with uploads (Python) in between that they read
        y = torch.full((4,), float(i)).to("remote_accel")
        x.add_(y)
        x.mul_(0.5)
    expected = torch.zeros(4).add_(1.0)
    for i in range(50):
        expected.add_(torch.full((4,), float(i))).mul_(0.5)
    torch.testing.assert_close(x.cpu(), expected)


def test_a_full_queue_leaves_without_a_sync(session):
    x = torch.zeros(2, device="remote_accel")
    x.add_(1.0)
    session.flush()
    batches, served = session.counters["batches"], _served()
    for _ in range(600):
        x.add_(1.0)
    assert _served() - served == 600
    assert session.counters["batches"] - batches >= 2  # the C++ queue sent itself when full
    assert x.cpu().tolist() == [601.0, 601.0]


def _wait_for_batches(session, batches: int) -> None:
    deadline = time.monotonic() + 30  # generous: the machine may be loaded
    while session.counters["batches"] <= batches and time.monotonic() < deadline:
        time.sleep(0.005)


def test_the_timer_flush_sends_a_batch_that_is_not_full(session):
    """Requests leave without a sync and without filling a batch (pipelining), once."""
    x = torch.zeros(2, device="remote_accel")
    x.add_(1.0)
    session.flush()
    batches = session.counters["batches"]
    session.flush_after = FLUSH_AFTER_S
    try:
        for _ in range(5):
            x.add_(1.0)
        _wait_for_batches(session, batches)
        assert session.counters["batches"] > batches  # no sync, no full queue: the timer sent it
        sent = session.counters["batches"]
        time.sleep(0.05)
        assert session.counters["batches"] - sent <= 1  # nothing queued: nothing more leaves
    finally:
        session.flush_after = None
    assert x.cpu().tolist() == [6.0, 6.0]


def test_an_error_in_a_timer_flushed_batch_raises_at_the_next_sync(session):
    """A served op that fails on the server, in a batch the timer sent, while later
    batches follow: the next sync raises naming the op, and the session goes on."""
    x = torch.arange(4.0, device="remote_accel")
    good, bad = torch.tensor([0, 1]).to("remote_accel"), torch.tensor([0, 99]).to("remote_accel")
    x.index_select(0, good)
    session.sync()
    served = _served()
    session.flush_after = FLUSH_AFTER_S
    try:
        batches = session.counters["batches"]
        x.index_select(0, bad)  # from the plan: only the server sees the bad index
        assert _served() - served == 1
        _wait_for_batches(session, batches)
        for _ in range(300):  # later batches, full ones and timer-flushed ones
            x.add_(1.0)
        with pytest.raises(Exception) as info:
            session.sync()
        assert "index_select" in str(info.value) + "".join(getattr(info.value, "__notes__", []))
    finally:
        session.flush_after = None
    assert x.cpu().tolist() == [300.0, 301.0, 302.0, 303.0]  # the ops after it ran
    assert x.index_select(0, good).cpu().tolist() == [300.0, 301.0]


def test_threads_share_a_device(session):
    """Served ops run without the GIL: threads queueing at once lose nothing and keep
    each thread's order (with syncs and uploads from Python in between)."""
    def work(k: int, out: list) -> None:
        x = torch.zeros(64, device="remote_accel")
        for i in range(400):
            x.add_(1.0)
            x.mul_(1.0)
            if i % 100 == 99:
                x.add_(torch.ones(64).to("remote_accel"))
        out[k] = x.cpu()

    results = [None] * 4
    threads = [threading.Thread(target=work, args=(k, results)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    for r in results:
        assert r is not None and r.tolist() == [404.0] * 64
