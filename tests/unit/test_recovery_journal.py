"""The recovery journal's bookkeeping, one layer alone (pytorch_ext/recovery.py); the real
path, a server killed and started again, is tests/e2e/test_recovery.py."""

from __future__ import annotations

import logging

from remote_accel.dataplane import codec
from remote_accel.dataplane import messages as m
from remote_accel.dataplane.wire import MsgType
from remote_accel.pytorch_ext import recovery


def _batch(*items, payloads=()) -> tuple:
    encoded = b"".join(codec.encode(m.batch_item(i)) for i in items)
    return (int(MsgType.BATCH), m.encoded_batch(len(items), encoded), list(payloads), 0)


def test_one_way_requests_are_kept_with_their_payloads_copied_and_queries_are_not():
    journal = recovery.Journal(1 << 20)
    buffer = bytearray(b"abcd")
    write = (int(MsgType.WRITE), m.encode(m.WriteStorage(5, 0, 4)), [memoryview(buffer)], 0)
    sync = (int(MsgType.SYNC), m.encode(m.Sync()), (), 7)
    journal.record([_batch(m.AllocStorage(5, 4)), write, sync])
    buffer[:] = b"zzzz"  # the caller reuses its buffer: the journal kept the bytes sent
    assert [e[0] for e in journal.entries] == [MsgType.BATCH, MsgType.WRITE]
    assert journal.entries[1][2] == (b"abcd",)
    assert journal.entry_bytes == sum(len(e[1]) for e in journal.entries) + 4


def test_answered_requests_that_change_state_are_kept_and_mark_the_sync_point():
    journal = recovery.Journal(1 << 20)
    journal.record([_batch(m.AllocStorage(1, 8))])
    journal.record_answered(int(MsgType.READ), m.encode_read(1, 0, 8))
    assert len(journal.entries) == 1 and journal.synced == 1
    rng = m.encode(m.Rng("set", None, b"state"))
    journal.record_answered(int(MsgType.RNG), rng)
    assert journal.entries[-1] == (MsgType.RNG, rng, ()) and journal.synced == 2


def test_definitions_mirror_the_servers_bounds(monkeypatch):
    monkeypatch.setattr(recovery, "MAX_PLANS", 3)
    journal = recovery.Journal(1 << 20)
    for plan in range(5):
        journal.define_plan(plan, b"x" * (plan + 1))
    assert list(journal.plans) == [2, 3, 4]  # the oldest dropped, as the server does
    assert journal.definition_bytes == 3 + 4 + 5
    journal.define_plan(3, b"yy")  # redefined: keeps its place, its new size counts
    assert list(journal.plans) == [2, 3, 4] and journal.definition_bytes == 3 + 2 + 5


def test_a_journal_past_its_bound_stops_and_says_so(caplog):
    journal = recovery.Journal(100)
    with caplog.at_level(logging.WARNING, logger="remote_accel"):
        journal.record([(int(MsgType.WRITE), m.encode(m.WriteStorage(1, 0, 200)), [b"x" * 200], 0)])
    assert journal.broken and journal.entries == [] and journal.unrecoverable()
    assert "recovery is off until the next snapshot" in caplog.text
    journal.record([_batch(m.AllocStorage(2, 4))])
    assert journal.entries == []  # nothing is kept until a snapshot fits


def test_snapshots_are_due_when_the_journal_would_not_fit_beside_the_next_one():
    journal = recovery.Journal(1000)
    journal.record([(int(MsgType.WRITE), m.encode(m.WriteStorage(1, 0, 300)), [b"x" * 300], 0)])
    now = journal.last_snapshot
    assert not journal.snapshot_due(now, live_bytes=300)
    assert journal.snapshot_due(now, live_bytes=800)
    state = m.StateReply(((1, 300),), ((0, None, b"gen"),))
    journal.take_snapshot(state, lambda sid, nbytes: b"y" * nbytes)
    assert journal.entries == [] and journal.snapshot.nbytes == 300 and journal.snapshots == 1
    # a minute later with work in the journal, but no sooner than its cost allows
    journal.record([_batch(m.AllocStorage(2, 4))])
    assert journal.snapshot_due(journal.last_snapshot + recovery.SNAPSHOT_EVERY_S, live_bytes=300)


def test_a_snapshot_larger_than_the_bound_turns_recovery_off():
    journal = recovery.Journal(100)
    journal.take_snapshot(m.StateReply(((1, 500),), ()), lambda sid, nbytes: b"")
    assert journal.broken and "more than REMOTE_ACCEL_RECOVERY_MEMORY" in journal.broken


def test_a_batch_replays_carefully_as_one_request_per_item_with_its_payload():
    entry = _batch(m.AllocStorage(1, 4), m.WriteStorage(1, 0, 4), m.RunPlanned(9, (1,)), payloads=[b"abcd"])
    singles = recovery.single_requests(entry[:3])
    assert [s[0] for s in singles] == [MsgType.ALLOC, MsgType.WRITE, MsgType.RUN_PLANNED]
    assert singles[1][2] == (b"abcd",) and singles[2][2] == ()
    journal = recovery.Journal(1 << 20)
    journal.define_plan(9, m.encode(m.RunOp("aten::relu", (), {}, (), False, None, 9)))
    assert journal.op_name(singles[2][0], singles[2][3]) == "aten::relu"
    assert recovery.count_ops([entry[:3]]) == 1


def test_large_uploads_are_borrowed_until_their_tensor_changes():
    import torch

    journal = recovery.Journal(1 << 30)
    source = torch.zeros(1 << 16)
    view = memoryview(source.numpy()).cast("B")
    journal.lend(view, source)
    journal.record([(int(MsgType.WRITE), m.encode(m.WriteStorage(1, 0, view.nbytes)), [view], 0)])
    kept = journal.entries[0][2][0]
    assert type(kept) is recovery.Borrowed and kept.view is view  # no copy
    assert journal.entry_bytes > view.nbytes and not journal.changed_uploads()
    assert journal.unrecoverable() is None
    source.add_(1)
    assert journal.changed_uploads() and "changed in place" in journal.unrecoverable()
    assert journal.snapshot_due(journal.last_snapshot, live_bytes=0)


def test_keeping_a_prefix_counts_borrowed_bytes_and_forgets_the_rest():
    import torch

    journal = recovery.Journal(1 << 30)
    source = torch.zeros(1 << 16)
    view = memoryview(source.numpy()).cast("B")
    journal.lend(view, source)
    journal.record([(int(MsgType.WRITE), m.encode(m.WriteStorage(1, 0, view.nbytes)), [view], 0),
                    _batch(m.AllocStorage(2, 4))])
    first = journal.entries[:1]
    whole = journal.entry_bytes
    journal.keep_only(first)
    assert journal.synced == 1 and journal.entry_bytes == whole - len(_batch(m.AllocStorage(2, 4))[1])
    journal.keep_only([])
    source.add_(1)  # the dropped upload's tensor no longer matters
    assert journal.entry_bytes == 0 and not journal.changed_uploads()
