"""Plans: the first call of an op on given arguments makes one in Python (fallback.py),
later calls are served from it in C++ (csrc/op_queue.cpp), against a real server.

A served call only fills storage ids and CPU scalar values into the plan's encoding. It
must say exactly what the Python call said, never replay a value of an earlier call,
announce storages the server has not seen, and keep requests in the order they were made.
"""

from __future__ import annotations

import copy
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
from remote_accel.pytorch_ext.session import FIRST_BATCH_ITEMS, FLUSH_AFTER_S, MAX_BATCH_ITEMS
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
    tensors' and Scalar arguments' bytes (what the server fills from a RunPlanned's values)."""
    if isinstance(value, m.RunOp):
        return _holes((value.args, value.kwargs, value.outs))
    if isinstance(value, codec.Ext):
        if value.code == torch_values.TENSOR:
            return [value.value[0]]
        if value.code == torch_values.CPU_TENSOR:
            return [value.value[2]]
        if value.code == torch_values.SCALAR:
            return [value.value[1]]
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
    first = torch.addcmul(a[1:], b, b, value=0.5)  # addcmul(self, tensor1, tensor2, value=): a fresh result
    defining = _of_type(_queued(session), m.RunOp)[-1]
    assert defining.plan is not None and defining.op == "aten::addcmul"
    served = _served()
    again = torch.addcmul(a[1:], b, b, value=0.5)
    items = _queued(session)
    assert _served() == served + 1 and not _of_type(items, m.RunOp)  # C++ sent it, not Python
    (planned,) = _of_type(items, m.RunPlanned)
    assert planned.plan == defining.plan
    before, now = _holes(defining), list(planned.values)
    assert len(now) == len(before) == 5  # self, tensor1, tensor2, the keyword value, then the fresh result
    assert now[:3] == before[:3] == [fallback._C.storage_id(t) for t in (a, b, b)]
    assert now[3] == before[3] == struct.pack("<d", 0.5)
    assert now[4] == fallback._C.storage_id(again) != before[4] == fallback._C.storage_id(first)
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
    for value in (0.0, -0.0, 2.5):  # Scalar arguments: values filled in per call, -0.0 too
        x.fill_(value)
        assert torch.equal(torch.signbit(x).cpu(), torch.signbit(torch.full((3,), value)))
        assert x.cpu().tolist() == [value] * 3


def test_scalar_arguments_travel_as_values_not_in_the_plan(session):
    """An optimizer's step size changes every step: one plan serves every value, and each
    call computes with its own (floats, ints, bools and complex numbers alike)."""
    p = torch.randn(6, device="remote_accel")
    g, v = torch.randn(6, device="remote_accel"), torch.rand(6, device="remote_accel") + 0.5
    expected, g_cpu, v_cpu = p.cpu(), g.cpu(), v.cpu()
    session.flush()
    fallback.forget_plans()
    plans = fallback._C.plan_stats()[0]
    for step in range(1, 8):
        value = -0.01 / step
        p.addcdiv_(g, v, value=value)  # AdamW's addcdiv.out with the step size
        expected.addcdiv_(g_cpu, v_cpu, value=value)
    assert fallback._C.plan_stats()[0] - plans == 1  # the first call made the one plan
    planned = _of_type(_queued(session), m.RunPlanned)
    assert [p.values[-1] for p in planned] == [struct.pack("<d", -0.01 / step) for step in range(2, 8)]
    assert torch.equal(p.cpu(), expected)
    i = torch.arange(6, device="remote_accel")
    assert torch.equal(i.add(3, alpha=2).cpu(), torch.arange(6) + 6)  # an int Scalar
    assert torch.equal(i.add(5, alpha=-1).cpu(), torch.arange(6) - 5)  # served, another value
    c = torch.zeros(2, dtype=torch.complex64, device="remote_accel")
    for z in (1 + 2j, -3.5j):
        c.add_(torch.ones(2, dtype=torch.complex64, device="remote_accel"), alpha=z)
    assert torch.equal(c.cpu(), torch.full((2,), 1 - 1.5j, dtype=torch.complex64))


def test_every_call_names_its_own_tensors(session):
    xs = [torch.full((2, 2), float(i), device="remote_accel") for i in range(4)]
    outs = [x * x + x for x in xs]  # one plan per op, four different storages
    assert [o.cpu()[0, 0].item() for o in outs] == [i * i + i for i in range(4)]


def test_a_storage_the_server_has_not_seen_is_announced_first(session):
    x = torch.zeros(3, device="remote_accel")
    x.add_(torch.ones(3, device="remote_accel"))  # makes add_'s plan
    fresh = torch.empty(3, device="remote_accel").fill_(2.0)  # a storage the server makes (below)
    session.flush()
    other = torch.empty(3, device="remote_accel")  # a storage only the client knows, read first
    served = _served()
    x.add_(other)
    assert _served() == served + 1
    alloc, run = _queued(session)[-2:]
    assert alloc[0] == m.AllocStorage.TYPE and run[0] == m.RunPlanned.TYPE
    assert m.from_fields(m.AllocStorage, tuple(alloc[1])).sid == fallback._C.storage_id(other)
    assert fresh.cpu().tolist() == [2.0] * 3


def test_storages_an_op_writes_need_no_alloc(session):
    """out= results (PyTorch routes add and sum to add.out and sum.IntList_out), a
    factory's fill_ and a copy into a new tensor write a storage the server has not seen: no ALLOC travels for it, the
    server makes it from the plan's layout (its counters say so)."""
    a, b = torch.randn(4, 5, device="remote_accel"), torch.randn(4, 5, device="remote_accel")
    ca, cb = a.cpu(), b.cpu()
    for _ in range(2):  # the first calls make the plans
        torch.add(a, b, alpha=2, out=torch.empty(4, 5, device="remote_accel"))
        torch.sum(a, 1, out=torch.empty(4, device="remote_accel"))
        torch.full((3,), 1.0, device="remote_accel")
        a.t().contiguous()  # empty, then copy_ (_copy_from) into it
    session.sync()
    before = session.stats()
    outs, sums, fulls, copies = [], [], [], []
    for i in range(10):
        copies.append(a.t().contiguous())
        outs.append(torch.add(a, b, alpha=i + 2, out=torch.empty(4, 5, device="remote_accel")))  # 1 is the default
        sums.append(torch.sum(b, 1, out=torch.empty(4, device="remote_accel")))
        fulls.append(torch.full((3,), float(i), device="remote_accel"))  # empty, then fill_
    items = _queued(session)
    assert not _of_type(items, m.AllocStorage)
    after = session.stats()
    assert after["alloc_requests"] == before["alloc_requests"]
    assert after["storages_made"] - before["storages_made"] == 40
    for i in range(10):
        torch.testing.assert_close(outs[i].cpu(), torch.add(ca, cb, alpha=i + 2))
        torch.testing.assert_close(sums[i].cpu(), cb.sum(1))
        assert fulls[i].cpu().tolist() == [float(i)] * 3
        assert torch.equal(copies[i].cpu(), ca.t().contiguous())


def test_an_out_of_place_op_travels_as_itself(session):
    """A structured op's functional form (add.Tensor, mul.Tensor) has a generic kernel that
    would allocate the result and call the out= form: three messages per op (ALLOC, the
    op, a FREE later). The fallback takes the op whole, so `x * i + 1.0` is two planned
    messages and the server allocates the results itself."""
    x = torch.randn(16, device="remote_accel")
    x * 2.0 + 1.0  # makes the plans
    defining = _of_type(_queued(session), m.RunOp)
    assert [r.op for r in defining][-2:] == ["aten::mul.Tensor", "aten::add.Tensor"]
    before = session.stats()
    n = (FIRST_BATCH_ITEMS - 1) // 2  # products and sums that stay in the queue's first batch
    ys = [x * float(i) + 1.0 for i in range(n)]
    items = _queued(session)
    # and one FREE, last, of the products `x * i` freed after their sums were queued
    assert [kind for kind, _ in items] == [m.RunPlanned.TYPE] * (2 * n) + [m.FreeStorage.TYPE]
    assert len(_of_type(items, m.FreeStorage)[0].sids) == n
    assert session.stats()["alloc_requests"] == before["alloc_requests"]
    cx = x.cpu()
    for i, y in enumerate(ys):
        torch.testing.assert_close(y.cpu(), cx * float(i) + 1.0)


def test_arange_is_one_planned_op_keyed_by_its_values(session):
    """arange's length comes from its Scalar arguments: a call with other values must not
    be served from the first call's plan."""
    torch.arange(10, device="remote_accel")
    (defining,) = _of_type(_queued(session), m.RunOp)
    assert defining.op == "aten::arange"
    a = torch.arange(10, device="remote_accel")
    assert [kind for kind, _ in _queued(session)] == [m.RunPlanned.TYPE]
    b = torch.arange(12, device="remote_accel")
    c = torch.arange(2, 14, 3, dtype=torch.float32, device="remote_accel")
    assert a.cpu().tolist() == list(range(10)) and b.cpu().tolist() == list(range(12))
    assert c.cpu().tolist() == [2.0, 5.0, 8.0, 11.0]


def test_an_in_place_view_op_changes_only_the_handle(session):
    x = torch.arange(12, dtype=torch.float32, device="remote_accel")
    y = x.view(12)
    session.flush()
    y.as_strided_((3, 2), (4, 1), 1)
    assert not _queued(session)
    assert y.cpu().tolist() == [[1.0, 2.0], [5.0, 6.0], [9.0, 10.0]]


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


def test_the_timer_flush_sleeps_in_cpp_until_an_op_is_queued(session):
    """NativeQueue.wait, the timer flush's sleep without the GIL: it times out on an
    empty queue, returns at once once an op is served into the queue or wake() was
    called, and takes nothing (the session thread waiting beside this one cannot
    swallow what wakes it): only the next take, a flush, clears it. The session's own
    timer flush is off meanwhile: it would take the queued op 2 ms after it came."""
    queue = session.native_queue
    x = torch.zeros(2, device="remote_accel")
    flush_after, session.flush_after = session.flush_after, None
    try:
        x.add_(1.0)
        session.flush()
        assert not queue.wait(0.05)  # nothing queued: the wait times out
        x.add_(1.0)  # served from its plan into the C++ queue
        assert queue.wait(5) and queue.wait(0)  # at once, and again: waiting takes nothing
        session.flush()
        assert not queue.wait(0.01)
        queue.wake()
        assert queue.wait(5) and queue.wait(0)
        session.flush()
        assert not queue.wait(0.01)
        done = []
        waiter = threading.Thread(target=lambda: done.append(queue.wait(30)))
        waiter.start()  # asleep without the GIL: this thread goes on queueing
        x.add_(1.0)
        waiter.join(30)
        assert done == [True]
    finally:
        session.flush_after = flush_after
    assert x.cpu().tolist() == [3.0, 3.0]


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


def test_adamw_steps_take_the_fast_path_after_the_first(session):
    """AdamW's step size changes every step; it travels as a value, so after the first
    steps every op is served from a plan in C++ and run by the server's C++ executor, and
    the parameters stay equal to local ones."""
    torch.manual_seed(0)
    local = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    remote = copy.deepcopy(local).to("remote_accel")
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (local, remote)]
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    rx, ry = x.to("remote_accel"), y.to("remote_accel")

    def step(model, opt, x, y):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    for i in range(6):
        if i == 2:
            plans, stats = fallback._C.plan_stats(), session.stats()
        expected = step(local, opts[0], x, y)
        got = step(remote, opts[1], rx, ry)
        torch.testing.assert_close(got.cpu(), expected)
    after, now = fallback._C.plan_stats(), session.stats()
    assert after[0] == plans[0]  # no new plan: the changing step sizes were values
    assert after[1] - plans[1] > 4 * 20  # every op of the last four steps served in C++
    # ...and run by the C++ executor on the server (the .cpu() reads are no ops)
    assert now["ops_done"] - stats["ops_done"] == now["native_ops_done"] - stats["native_ops_done"] > 0
    for p, q in zip(local.parameters(), remote.parameters()):
        torch.testing.assert_close(q.cpu(), p)


def test_an_error_among_scalar_and_written_storage_ops_raises_at_the_next_sync(session):
    """A served op that fails mid-batch, between ops whose Scalars travel as values and
    whose out= storages the server makes: the next sync raises naming the op, the ops
    around it ran with their own values, and the session goes on."""
    p = torch.zeros(3, device="remote_accel")
    x = torch.arange(4.0, device="remote_accel")
    good, bad = torch.tensor([0, 1]).to("remote_accel"), torch.tensor([0, 99]).to("remote_accel")
    for _ in range(2):  # the plans
        p.add_(torch.ones(3, device="remote_accel"), alpha=0.5)
        torch.mul(x, 2.0, out=torch.empty(4, device="remote_accel"))
        x.index_select(0, good)
    session.sync()
    made = session.stats()["storages_made"]
    outs = []
    for i in range(20):
        p.add_(torch.ones(3, device="remote_accel"), alpha=float(i))
        outs.append(torch.mul(x, float(i), out=torch.empty(4, device="remote_accel")))
        if i == 10:
            x.index_select(0, bad)  # only the server sees the bad index
    with pytest.raises(Exception) as info:
        session.sync()
    assert "index_select" in str(info.value) + "".join(getattr(info.value, "__notes__", []))
    assert p.cpu().tolist() == [1.0 + sum(range(20))] * 3  # 2 x 0.5, then 0 + 1 + ... + 19
    for i, out in enumerate(outs):
        assert out.cpu().tolist() == [float(i) * v for v in range(4)]
    assert session.stats()["storages_made"] - made == 40  # the ones()s and the out= results
    assert x.index_select(0, good).cpu().tolist() == [0.0, 1.0]


def test_dropout_is_served_from_a_plan_and_follows_manual_seed(session):
    """native_dropout draws from the default stream without a generator argument: it is
    served from a plan keyed by the default generator's seed and epoch, run by the
    server's C++ executor with the session's stream, and equals local CPU's dropout."""
    x = torch.ones(64, device="remote_accel")
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        runs.append([torch.nn.functional.dropout(x, 0.5) for _ in range(4)])
    runs = [[t.cpu() for t in run] for run in runs]
    torch.manual_seed(11)
    local = [torch.nn.functional.dropout(torch.ones(64), 0.5) for _ in range(4)]
    for a, b, c in zip(runs[0], runs[1], local):
        assert torch.equal(a, b) and torch.equal(a, c)  # the same stream after each manual_seed
    assert not torch.equal(runs[0][0], runs[0][1])  # the stream moves on between calls
    torch.nn.functional.dropout(x, 0.5)  # the plan for the epoch of the last manual_seed
    plans, stats = fallback._C.plan_stats(), session.stats()
    for _ in range(5):
        torch.nn.functional.dropout(x, 0.5)
    now = session.stats()
    assert fallback._C.plan_stats()[0] == plans[0] and fallback._C.plan_stats()[1] - plans[1] == 5
    assert now["ops_done"] - stats["ops_done"] == now["native_ops_done"] - stats["native_ops_done"] == 5


def test_freed_storages_leave_in_one_free_after_the_requests_queued_before(session):
    """NativeQueue.take ends with one FreeStorage of the storages freed since the last take
    that the server knew; a storage it never saw is not named."""
    a = torch.ones(4, device="remote_accel")
    b = a + 1
    c = b * 2  # b, c: announced to the server as results
    session.flush()
    unseen = torch.empty(8, device="remote_accel")  # never used by an op: the server has no storage
    del b, c, unseen
    d = a + 3
    items = _queued(session)
    frees = _of_type(items, m.FreeStorage)
    assert len(frees) == 1 and items[-1][0] == m.FreeStorage.TYPE, items
    assert len(frees[0].sids) == 2
    assert d.cpu().tolist() == [4.0] * 4  # and the server took the FREE well


def test_after_a_sync_point_batches_start_small_and_double(session):
    """Slow start (csrc/op_queue_internal.h): after a sync point the server has nothing
    to do, so the C++ queue's batch leaves at FIRST_BATCH_ITEMS requests and each full
    batch after it at twice as many, up to MAX_BATCH_ITEMS; the next sync starts over."""
    x = torch.zeros(4, device="remote_accel")
    x.add_(1)  # its plan: later calls are served in C++
    assert x.sum().item() == 4.0
    sizes = []  # the ops of each take of the C++ queue (a batch's, without its FREE item)
    queue = session.native_queue
    take = queue.take

    def recording():
        taken = take()
        sizes.append(taken[1])
        return taken

    queue.take = recording
    try:
        for _ in range(1000):
            x.add_(1)
        assert x.sum().item() == 1001 * 4.0
        first_round = len(sizes)
        for _ in range(100):
            x.add_(1)
        assert x.sum().item() == 1101 * 4.0
    finally:
        del queue.take
    first = _slow_start(1000)
    assert sizes[:first_round] == first, sizes
    assert len(first) > 3  # the 1000 calls did reach the doubled lengths
    assert sizes[first_round:] == _slow_start(100), sizes  # started over


def _slow_start(ops: int) -> list:
    """The C++ queue's takes for `ops` queued ops and a sync point's READ: full batches
    from FIRST_BATCH_ITEMS on, each twice the last (up to MAX_BATCH_ITEMS), then the rest
    with the sum that the READ reads."""
    takes, limit = [], FIRST_BATCH_ITEMS
    while ops >= limit:
        takes.append(limit)
        ops, limit = ops - limit, min(2 * limit, MAX_BATCH_ITEMS)
    return takes + [ops + 1]
