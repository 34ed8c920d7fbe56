"""Collectives of a process group, run on this server's device in the thread of the
session of the member rank (groups.py has the members and their connections).

A Collective is one-way and runs in order with the client's ops, as a NCCL kernel runs in
order on its stream: the client never waits for it, later ops see its results, and a
failure is kept for the client's next sync point. The data moves between servers only.
The algorithms are NCCL's choices, over one message per step:

- all_reduce: a ring (reduce-scatter, then all-gather: 2(N-1) steps, each rank sending
  2(N-1)/N of the tensor: bandwidth-optimal) for tensors above TREE_MAX_BYTES; below it a
  binomial tree (reduce to rank 0, then broadcast: 2 log2 N steps), where latency rules;
- broadcast and reduce: a binomial tree from / to the root;
- all_gather and reduce_scatter: the ring's halves;
- all_to_all: a pairwise exchange; gather and scatter: straight to and from the root;
- barrier: a tree all-reduce of nothing;
- send and recv: one message on the point-to-point lane, numbered per pair of ranks. A
  send leaves at once (the peer's server reads every connection as data comes); a recv
  only notes where its data goes and the session goes on, as irecv does: the data lands
  at the "wait" the client queues with Work.wait(), so that ranks that each post a
  receive before their send (batch_isend_irecv in any order) never wait for each other.

Each chunk of a ring is reduced in one fixed order, the same on every rank, and so is a
tree: every rank ends with the same bits, run after run. The arithmetic runs on the
server's device; bytes leave and arrive through host memory (the tensor's own on a CPU
server). Every message carries what its sender runs (kind, op, dtype, elements), so that
ranks that disagree fail saying so, and any failure breaks the group on every rank.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from ..dataplane import messages as m
from ..errors import ProtocolError
from .groups import GroupError, Member

#: all_reduce moves tensors up to this size along a tree (latency), larger ones along a ring
TREE_MAX_BYTES = 256 << 10

_REDUCTIONS: dict[str, Callable] = {
    "sum": torch.Tensor.add_,
    "avg": torch.Tensor.add_,  # divided by the group's size at the end
    "product": torch.Tensor.mul_,
    "min": lambda a, b: torch.minimum(a, b, out=a),
    "max": lambda a, b: torch.maximum(a, b, out=a),
    "band": torch.Tensor.bitwise_and_,
    "bor": torch.Tensor.bitwise_or_,
    "bxor": torch.Tensor.bitwise_xor_,
}
_REDUCING = frozenset({"all_reduce", "reduce", "reduce_scatter"})


def check_reduction(op: str, dtype: torch.dtype) -> None:
    """Refuse a reduction the dtype has no meaning for, before any data moves."""
    if op not in _REDUCTIONS:
        raise ValueError(f"reduction {op!r} is not one of {', '.join(_REDUCTIONS)}")
    if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"ReduceOp.AVG needs a floating-point tensor, not {dtype} (use SUM and divide)")
    if op in ("min", "max") and dtype.is_complex:
        raise ValueError(f"ReduceOp.{op.upper()} has no meaning for complex tensors ({dtype})")
    if op.startswith("b") and (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"ReduceOp.{op.upper()} needs an integer or bool tensor, not {dtype}")


class _Run:
    """One collective on one rank: its member, number, lane and tensors' device."""

    def __init__(self, member: Member, request: m.Collective, lane: int, seq: int):
        self.member, self.kind, self.op, self.lane, self.seq = member, request.kind, request.op, lane, seq
        self.root = request.root
        self.rank, self.size = member.rank, member.size
        self.started = time.monotonic()
        self.reduce = _REDUCTIONS.get(request.op)

    def signature(self, t: torch.Tensor, extra=None) -> tuple:
        kind = "send/recv" if self.lane == m.LANE_P2P else self.kind  # a send pairs with a recv
        sig = (kind, self.op, str(t.dtype).removeprefix("torch."), t.numel())
        return sig if extra is None else sig + (extra,)

    def send(self, dest: int, step: int, t: torch.Tensor, extra=None) -> None:
        host = t if t.device.type == "cpu" and t.is_contiguous() else t.contiguous().cpu()
        self.member.send(dest, self.lane, self.seq, step, self.signature(t, extra), host.reshape(-1).view(torch.uint8))

    def receive(self, source: int, step: int, into: torch.Tensor, reduce: bool = False, extra=None) -> None:
        """`source`'s message for `step`, copied into `into` (or reduced into it)."""
        buffer = self.member.take(source, self.lane, self.seq, step, self.signature(into, extra), self.started)
        try:
            got = buffer[: into.numel() * into.element_size()].view(into.dtype).view(into.shape)
            if into.device.type != "cpu":
                got = got.to(into.device, non_blocking=False)
            if reduce:
                self.reduce(into, got)
            else:
                into.copy_(got)
        finally:
            self.member.recycle(buffer)


def run(member: Member, request: m.Collective, tensors: list, outputs: list) -> None:
    """Run `request` with its tensors resolved on this server's device."""
    kind = request.kind
    if kind not in _KINDS:
        raise ProtocolError(f"unknown collective {kind[:40]!r}")
    if member.broken:
        raise GroupError(member.broken)
    if kind == "send":
        member.p2p_sent[request.root] += 1
        lane, seq = m.LANE_P2P, member.p2p_sent[request.root]
    elif kind == "recv":
        member.p2p_received[request.root] += 1
        lane, seq = m.LANE_P2P, member.p2p_received[request.root]
    elif kind == "wait":
        lane, seq = m.LANE_P2P, 0
    else:
        lane, seq = m.LANE_COLLECTIVE, request.seq
        member.seq = seq
    if not all(isinstance(t, torch.Tensor) for t in (*tensors, *outputs)):
        raise ProtocolError("a Collective names tensors only")
    if not 0 <= request.root < member.size:
        raise ValueError(f"rank {request.root} is not in a group of {member.size}")
    try:
        if kind in _REDUCING:
            for t in tensors:
                check_reduction(request.op, t.dtype)
        _KINDS[kind](_Run(member, request, lane, seq), request, tensors, outputs)
    except GroupError:
        raise
    except Exception as exc:  # a rank that cannot run its part breaks the group for all
        raise GroupError(_broken(member, f"{kind} {seq} failed on rank {member.rank}: {exc}")) from exc
    member.groups.collectives += 1


def _broken(member: Member, why: str) -> str:
    member.fail(why)
    return member.broken


# -- the kinds ---------------------------------------------------------------------------------------
def _contiguous(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A flat view of `t`'s elements, or of a contiguous copy (True: copy it back after)."""
    if t.is_contiguous():
        return t.view(-1), False
    return t.contiguous().view(-1), True


def _in_place(body: Callable[[_Run, torch.Tensor], None]):
    """A kind that works on its one tensor in place (flattened, contiguous). One tensor
    per Collective: its messages are numbered by (seq, step) alone."""

    def kind(run: _Run, request: m.Collective, tensors: list, outputs: list) -> None:
        if len(tensors) != 1 or outputs:
            raise ProtocolError(f"{run.kind} takes one tensor")
        (t,) = tensors
        flat, copied = _contiguous(t)
        body(run, flat)
        if copied:
            t.copy_(flat.view(t.shape))

    return kind


def _all_reduce(run: _Run, flat: torch.Tensor) -> None:
    if run.size > 1:
        if flat.numel() * flat.element_size() <= TREE_MAX_BYTES:
            _tree_reduce(run, flat, root=0, step=0)
            _tree_broadcast(run, flat, root=0, step=1)
        else:
            _ring_all_gather(run, flat, owned_shift=1, first_step=_ring_reduce_scatter(run, flat, owned_shift=1))
    if run.op == "avg":
        flat.div_(run.size)


def _broadcast(run: _Run, flat: torch.Tensor) -> None:
    _tree_broadcast(run, flat, root=run.root, step=0)


def _reduce(run: _Run, flat: torch.Tensor) -> None:
    root = run.root
    work = flat if run.rank == root else flat.clone()  # the input of a non-root rank stays as it was
    _tree_reduce(run, work, root=root, step=0)
    if run.rank == root and run.op == "avg":
        flat.div_(run.size)


def _all_gather(run: _Run, request: m.Collective, tensors: list, outputs: list) -> None:
    """tensors: one input per rank's part; outputs: the whole, the size parts back to back
    (all_gather's list is sent as one contiguous tensor by the client)."""
    (source,), (out,) = tensors, outputs
    if out.numel() != source.numel() * run.size or out.dtype != source.dtype:
        raise ValueError(f"all_gather: the output holds {out.numel()} {out.dtype} elements, not {run.size} x "
                         f"{source.numel()} {source.dtype}")
    flat, copied = _contiguous(out)
    n = source.numel()
    flat[run.rank * n:(run.rank + 1) * n].copy_(source.reshape(-1))
    _ring_all_gather(run, flat, owned_shift=0, first_step=0)
    if copied:
        out.copy_(flat.view(out.shape))


def _reduce_scatter(run: _Run, request: m.Collective, tensors: list, outputs: list) -> None:
    (source,), (out,) = tensors, outputs
    if source.numel() != out.numel() * run.size or out.dtype != source.dtype:
        raise ValueError(f"reduce_scatter: the input holds {source.numel()} {source.dtype} elements, not "
                         f"{run.size} x {out.numel()} {out.dtype}")
    work = source.reshape(-1).clone()  # the input stays as it was
    _ring_reduce_scatter(run, work, owned_shift=0)
    n = out.numel()
    mine = work[run.rank * n:(run.rank + 1) * n]
    if run.op == "avg":
        mine.div_(run.size)
    out.copy_(mine.view(out.shape))


def _all_to_all(run: _Run, request: m.Collective, tensors: list, outputs: list) -> None:
    """params: (output split sizes, input split sizes) along dim 0, () for equal parts."""
    (source,), (out,) = tensors, outputs
    out_splits, in_splits = _splits(request.params, out, run.size), _splits(request.params, source, run.size, 1)
    src_parts = _parts(source.reshape(source.shape[0], -1) if source.dim() else source.view(1), in_splits)
    flat_out, copied = (out, False) if out.is_contiguous() else (out.contiguous(), True)
    out_parts = _parts(flat_out.reshape(flat_out.shape[0], -1) if flat_out.dim() else flat_out.view(1), out_splits)
    out_parts[run.rank].copy_(src_parts[run.rank])
    for shift in range(1, run.size):
        dest, origin = (run.rank + shift) % run.size, (run.rank - shift) % run.size
        run.send(dest, 0, src_parts[dest])
        run.receive(origin, 0, out_parts[origin])
    if copied:
        out.copy_(flat_out)


def _splits(params, t: torch.Tensor, size: int, which: int = 0) -> list:
    rows = t.shape[0] if t.dim() else 1
    given = params[which] if type(params) is tuple and len(params) == 2 else ()
    if not given:
        if rows % size:
            raise ValueError(f"all_to_all: {rows} rows do not split into {size} equal parts")
        return [rows // size] * size
    if len(given) != size or any(type(n) is not int or n < 0 for n in given) or sum(given) != rows:
        raise ValueError(f"all_to_all: split sizes {list(given)[:16]} do not split {rows} rows among {size} ranks")
    return list(given)


def _parts(rows: torch.Tensor, splits: list) -> list:
    out, at = [], 0
    for n in splits:
        out.append(rows[at:at + n])
        at += n
    return out


def _gather(run: _Run, request: m.Collective, tensors: list, outputs: list) -> None:
    """outputs (on the root): one tensor per rank, back to back in one tensor."""
    (source,) = tensors
    if run.rank != run.root:
        run.send(run.root, 0, source)
        return
    (out,) = outputs
    parts = out.view(run.size, *source.shape) if out.is_contiguous() else None
    if parts is None or out.numel() != source.numel() * run.size:
        raise ValueError("gather: the root's output must hold one contiguous input of each rank")
    for rank in range(run.size):
        if rank == run.rank:
            parts[rank].copy_(source)
        else:
            run.receive(rank, 0, parts[rank])


def _scatter(run: _Run, request: m.Collective, tensors: list, outputs: list) -> None:
    """tensors (on the root): one part per rank, back to back in one tensor."""
    (out,) = outputs
    if run.rank != run.root:
        run.receive(run.root, 0, out)
        return
    (source,) = tensors
    if source.numel() != out.numel() * run.size:
        raise ValueError("scatter: the root's input must hold one output of each rank")
    parts = source.reshape(run.size, *out.shape)
    for rank in range(run.size):
        if rank == run.rank:
            out.copy_(parts[rank])
        else:
            run.send(rank, 0, parts[rank])


def _barrier(run: _Run, request: m.Collective, tensors: list, outputs: list) -> None:
    token = torch.zeros(0, dtype=torch.uint8)
    _tree_reduce(run, token, root=0, step=0, reduce=False)
    _tree_broadcast(run, token, root=0, step=1)


def _send(run: _Run, request: m.Collective, tensors: list, outputs: list) -> None:
    for i, t in enumerate(tensors):
        run.send(run.root, i, t, extra=request.params)


def _recv(run: _Run, request: m.Collective, tensors: list, outputs: list) -> None:
    """Note the receive under the client's id (request.seq); "wait" completes it."""
    if request.seq in run.member.receives:
        raise ProtocolError(f"receive {request.seq} is posted already")

    def complete() -> None:
        for i, t in enumerate(tensors):
            flat, copied = _contiguous(t)
            run.receive(run.root, i, flat, extra=request.params)
            if copied:
                t.copy_(flat.view(t.shape))

    run.member.receives[request.seq] = complete


def _wait(run: _Run, request: m.Collective, tensors: list, outputs: list) -> None:
    """The client waits for receives (params: their ids): their data lands now, and later
    ops see it. An id no longer posted was waited for already."""
    if type(request.params) is not tuple or not all(type(i) is int for i in request.params):
        raise ProtocolError("a wait names the ids of its receives")
    for receive in request.params:
        complete = run.member.receives.pop(receive, None)
        if complete is not None:
            complete()


# -- the algorithms over a flat tensor ---------------------------------------------------------------
def _chunks(flat: torch.Tensor, n: int) -> list:
    """`flat` cut in n nearly equal consecutive parts (the first ones one element longer)."""
    size, extra = divmod(flat.numel(), n)
    out, at = [], 0
    for i in range(n):
        length = size + (i < extra)
        out.append(flat[at:at + length])
        at += length
    return out


def _ring_reduce_scatter(run: _Run, flat: torch.Tensor, owned_shift: int) -> int:
    """Reduce `flat` so that rank r holds the reduced chunk (r + owned_shift) mod N;
    returns the next free step number. Chunk c is reduced in ring order from rank
    c - owned_shift + 1 on: the same order on every rank."""
    size, rank = run.size, run.rank
    chunks = _chunks(flat, size)
    after, before = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):
        run.send(after, step, chunks[(rank - step - 1 + owned_shift) % size])
        run.receive(before, step, chunks[(rank - step - 2 + owned_shift) % size], reduce=True)
    return size - 1


def _ring_all_gather(run: _Run, flat: torch.Tensor, owned_shift: int, first_step: int) -> None:
    """Rank r holds chunk (r + owned_shift) mod N of `flat`; afterwards every rank holds all."""
    size, rank = run.size, run.rank
    chunks = _chunks(flat, size)
    after, before = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):
        run.send(after, first_step + step, chunks[(rank - step + owned_shift) % size])
        run.receive(before, first_step + step, chunks[(rank - step - 1 + owned_shift) % size])


def _tree_reduce(run: _Run, flat: torch.Tensor, root: int, step: int, reduce: bool = True) -> None:
    """Binomial tree to `root`: each rank reduces its children's data in order of
    distance (1, 2, 4, ...), then sends the sum to its parent."""
    size, rel = run.size, (run.rank - root) % run.size
    mask = 1
    while mask < size:
        if rel & mask:
            run.send((rel - mask + root) % size, step, flat)
            return
        if rel + mask < size:
            run.receive((rel + mask + root) % size, step, flat, reduce=reduce)
        mask <<= 1


def _tree_broadcast(run: _Run, flat: torch.Tensor, root: int, step: int) -> None:
    """Binomial tree from `root` (MPICH's): receive from the parent, then send to the
    children, farthest first."""
    size, rel = run.size, (run.rank - root) % run.size
    mask = 1
    while mask < size:
        if rel & mask:
            run.receive((rel - mask + root) % size, step, flat)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if rel + mask < size:
            run.send((rel + mask + root) % size, step, flat)
        mask >>= 1


_KINDS: dict[str, Callable] = {
    "all_reduce": _in_place(_all_reduce),
    "broadcast": _in_place(_broadcast),
    "reduce": _in_place(_reduce),
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_to_all": _all_to_all,
    "gather": _gather,
    "scatter": _scatter,
    "barrier": _barrier,
    "send": _send,
    "recv": _recv,
    "wait": _wait,
}
