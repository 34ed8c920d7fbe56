"""Plans for an Executor: a RunOp kept (RunOp.plan) to be run again by RunPlanned with other
storage ids and CPU scalars in its holes. Where it can, a plan is handed to C++ as a
template with a placeholder in each hole (native.Executor runs the RunPlanned calls then,
without Python); the rest run here, the template's holes filled in wire order.

A mixin of server.executor.Executor, as graph_runs.py is: it uses the executor's plans
table, its native half, its storage table and its run_op.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..dataplane.codec import Ext
from ..dataplane.messages import RunOp, RunPlanned
from ..errors import ProtocolError
from ..torch_wire import values as torch_values
from . import ops
from .exec_values import _count_holes, _fill, _written_holes, definition_bytes
from .failure import Failure
from .storage import EMPTY_SID, is_sid, parse_ref

#: Plans kept per session (RunOp.plan), the oldest dropped first: a client keeps fewer.
MAX_PLANS = 1 << 16
_COPY_FROM = frozenset({"aten::_copy_from", "aten::_copy_from.default"})
#: Ops whose kernels may flip an out= tensor's conj/neg bit instead of writing values:
#: they stay on the Python path, where _settle_lazy_bits rewrites the bytes.
_FLIPS_LAZY_BITS = frozenset({"aten::linalg_lu_solve.out"})


def _written_arguments(op: str) -> frozenset:
    """Positions and names of the arguments `op` writes (out=, in-place self; _copy_from's dst)."""
    if op in _COPY_FROM:
        return frozenset({1, "dst"})
    try:
        schema = ops.resolve(op).schema  # the named op's, also where a decomposition runs it
    except Failure:  # running the op reports what is wrong with its name
        return frozenset()
    if schema is None:
        return frozenset()
    return frozenset(x for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
                     for x in (i, a.name))


def _no_resolve(code: int, payload: Any) -> Any:
    raise _NotNative


class _NotNative(Exception):
    """A plan that only the Python path can run (generators, graph values)."""


class PlanRuns:
    """Defining plans (a RunOp with `plan`, or a recovering client's Define) and running
    them (RunPlanned): in C++ where the template went there, else here."""

    def _define_plan(self, msg: RunOp) -> None:
        if type(msg.plan) is not int or msg.reply:
            raise ProtocolError("RunOp.plan must be an int, and cannot go with reply")
        holes = _count_holes((msg.args, msg.kwargs, msg.outs))
        if msg.plan in self._plans:
            self._drop_plan(msg.plan)
        nbytes = definition_bytes(msg.op, msg.args, msg.kwargs, msg.outs)
        self.table.hold(nbytes)  # past the limit: Failure (out of memory), nothing kept
        if len(self._plans) >= MAX_PLANS:
            self._drop_plan(next(iter(self._plans)))
        self._plan_bytes[msg.plan] = nbytes
        self._plans[msg.plan] = (RunOp(msg.op, msg.args, msg.kwargs, msg.outs, False, msg.stream), holes,
                                 _written_holes(msg.args, msg.kwargs, _written_arguments(msg.op)))
        self.native.drop(msg.plan)
        if is_sid(msg.plan):
            try:
                self._define_native(msg)
            except (_NotNative, ProtocolError, Failure):
                pass  # the Python path runs it (and reports what is wrong with it)

    def _define_native(self, msg: RunOp) -> None:
        """Hand C++ the plan's template: its arguments with a placeholder per hole."""
        resolved = ops.resolve(msg.op)
        # a seeded op's stream (the session default's seed and epoch) is applied by the
        # RunOp that defines the plan; its RunPlanned calls draw on from there (the client
        # keys that seed and epoch: after a manual_seed a new plan is made)
        if msg.stream is not None and not resolved.seeded:
            raise _NotNative
        fn = resolved.fn
        if msg.op in _COPY_FROM:
            fn = torch.ops.aten._copy_from.default
        if (not isinstance(fn, torch._ops.OpOverload) or resolved.generator_index is not None
                or msg.op in _FLIPS_LAZY_BITS):
            raise _NotNative
        holes: list = []
        placeholders: list = []
        if type(msg.args) not in (tuple, list) or type(msg.kwargs) is not dict:
            raise _NotNative
        schema = fn._schema
        names = [a.name for a in schema.arguments]
        # top-level values know their stack slot, which a scalar hole needs (a number has no
        # identity to be found by on the stack, as a placeholder tensor has)
        args = tuple(self._template(v, holes, placeholders, 1, i) for i, v in enumerate(msg.args))
        kwargs = {k: self._template(v, holes, placeholders, 1, names.index(k) if k in names else None)
                  for k, v in msg.kwargs.items()}
        for i, out in enumerate(msg.outs):
            if out is None:
                continue
            if type(out) is not Ext or out.code != torch_values.TENSOR:
                raise _NotNative
            ref = parse_ref(out.value)
            holes.append(("o", i, ref.dtype, ref.shape, ref.stride, ref.offset, ref.flags, ref.span))
        if msg.op in _COPY_FROM:  # the client's name for dst.copy_(src) between its tensors
            if len(args) not in (2, 3) or kwargs:
                raise _NotNative
            fn = torch.ops.aten.copy_.default
            args = (args[1], args[0]) + args[2:]  # holes keep their wire order: C++ finds placeholders
        schema = fn._schema
        self.native.define(msg.plan, msg.op, schema.name, schema.overload_name, args, kwargs, placeholders, holes,
                           len(msg.outs), resolved.seeded)

    def _template(self, value: Any, holes: list, placeholders: list, depth: int, slot: Optional[int] = None) -> Any:
        """A wire value decoded with a distinct placeholder tensor in each hole, in
        _count_holes' order; `holes` gets each hole's kind and layout. `slot`: the schema
        index of a top-level argument, where a scalar hole's value goes."""
        t = type(value)
        if depth > 8:
            raise _NotNative
        if t is Ext:
            code = value.code
            if code == torch_values.SCALAR:
                number = torch_values.decode_scalar(value.value)
                if slot is None:
                    raise _NotNative  # inside a list: only top-level Scalar arguments are sent so
                holes.append(("s", slot, torch_values.dtype_from_name(value.value[0])))
                return number
            if code == torch_values.TENSOR:
                ref = parse_ref(value.value)
                holes.append(("t", len(placeholders), ref.dtype, ref.shape, ref.stride, ref.offset, ref.flags,
                              ref.span))
                placeholders.append(torch.empty(0))
                return placeholders[-1]
            if code == torch_values.CPU_TENSOR:
                tensor = torch_values.decode_cpu_tensor(value.value)
                holes.append(("c", len(placeholders), tensor.dtype, tuple(tensor.shape)))
                placeholders.append(tensor)
                return tensor
            if code == torch_values.DEVICE:
                return self._device(value.value)
            if code in (torch_values.GENERATOR, torch_values.GRAPH_VALUE):
                raise _NotNative
            return torch_values.decode_value(value, _no_resolve)
        if t is tuple:
            return tuple([self._template(v, holes, placeholders, depth + 1) for v in value])
        if t is list:
            return [self._template(v, holes, placeholders, depth + 1) for v in value]
        if t is dict:
            return {k: self._template(v, holes, placeholders, depth + 1) for k, v in value.items()}
        return value

    def run_planned(self, msg: RunPlanned) -> None:
        if self.native.planned(msg.plan) if is_sid(msg.plan) else False:
            self.native.run_planned(msg.plan, msg.values)
            return
        try:
            template, holes, written = self._plans[msg.plan]
        except KeyError:
            raise ProtocolError(f"plan {msg.plan} was never defined by a RunOp of this session") from None
        if len(msg.values) != holes:
            raise ProtocolError(f"plan {msg.plan} has {holes} holes, RunPlanned gave {len(msg.values)} values")
        for hole, span in written:  # a storage the op makes (no ALLOC came for it)
            sid = msg.values[hole]
            if is_sid(sid) and sid != EMPTY_SID and sid not in self.table and not self.native.failed(sid):
                self.table.alloc(sid, span)
                self._python_made += 1
        values = iter(msg.values)
        self.run_op(RunOp(template.op, _fill(template.args, values), _fill(template.kwargs, values),
                          _fill(template.outs, values), False, template.stream))

    def _drop_plan(self, plan: int) -> None:
        del self._plans[plan]
        self.native.drop(plan)
        self.table.release(self._plan_bytes.pop(plan))
