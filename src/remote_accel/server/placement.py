"""Where a message's WRITE payloads land: straight into their storage where that is safe."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from ..dataplane import codec
from ..dataplane import messages as m
from ..dataplane.codec import Ext
from ..dataplane.wire import MsgType
from ..torch_wire import values as torch_values


class WriteTarget(NamedTuple):
    """Where one WRITE payload is received: `buffer`. With `staging` set, the bytes are
    copied into `view` (or, when None, the range the WRITE names once it runs) later;
    with `error` set, they are thrown away and the error reported."""

    buffer: Any
    view: Optional[torch.Tensor] = None
    staging: Optional[torch.Tensor] = None
    error: Optional[BaseException] = None


def batch_writes(items: list) -> tuple[list, list]:
    """The batch's WRITE items, and for each whether it may land in its storage at once:
    only when no earlier item of the batch names that storage (an op reading the old
    bytes, or an ALLOC/FREE changing what the id means)."""
    writes, direct, named = [], [], set()
    for item in items:
        if type(item) is m.WriteStorage:
            writes.append(item)
            direct.append(item.sid not in named)
            named.add(item.sid)
        elif type(item) is m.RunOp:
            _collect_sids((item.args, item.kwargs, item.outs), named)
        elif type(item) is m.RunGraph:  # a rerun reads its inputs when it runs, after the receive
            _collect_sids((item.inputs, item.outs, item.nodes), named)
        elif type(item) is m.RunPlanned:  # its ints are storage ids, its bytes CPU scalars
            named.update(v for v in item.values if type(v) is int)
        elif type(item) is m.AllocStorage:
            named.add(item.sid)
        elif type(item) is m.FreeStorage:
            named.update(sid for sid in item.sids if type(sid) is int)
    return writes, direct


def scanned_writes(meta: bytes, items: list) -> tuple[list, list]:
    """batch_writes for a Batch the C++ scan took (`items`: its items' (type, start in
    meta)), decoding only its WRITEs, ALLOCs and FREEs, whose fields the scan checked.
    An op (RunOp, RunPlanned, RunGraph) before a WRITE may name that WRITE's storage
    without this looking: such a WRITE is staged, never placed at once (for the small
    uploads a Batch carries, one more copy instead of decoding every op in Python)."""
    writes, direct, named, ops_before = [], [], set(), False
    for msg_type, begin in items:
        if msg_type == MsgType.WRITE:
            w = m.WriteStorage(*codec.decode_at(meta, begin)[0][1])
            writes.append(w)
            direct.append(not ops_before and w.sid not in named)
            named.add(w.sid)
        elif msg_type == MsgType.ALLOC:
            named.add(codec.decode_at(meta, begin)[0][1][0])
        elif msg_type == MsgType.FREE:
            named.update(sid for sid in codec.decode_at(meta, begin)[0][1][0] if type(sid) is int)
        else:
            ops_before = True
    return writes, direct


def _collect_sids(value: Any, into: set) -> None:
    if type(value) is Ext:
        if value.code == torch_values.TENSOR and type(value.value) is tuple and value.value:
            if type(value.value[0]) is int:
                into.add(value.value[0])
        else:
            _collect_sids(value.value, into)
    elif type(value) in (tuple, list):
        for v in value:
            _collect_sids(v, into)
    elif type(value) is dict:
        for v in value.values():
            _collect_sids(v, into)


class Desync(Exception):
    """Raised from the payload sink when a message's payloads cannot be received: the
    byte stream would be out of step afterwards, so the session must end."""

