"""Python's half of the op fallback: every aten op on remote_accel tensors that the C++
fallback (csrc/op_queue.cpp) cannot serve from a cached plan lands here.

An op becomes a RunOp request queued on the device's session; it returns at once with
result tensors whose shape, dtype and strides come from running the op on `meta`
tensors (cached per op and argument metadata). The first call of each op and argument
key also hands C++ a plan, so that later calls never reach Python. Ops whose results
depend on data (nonzero, unique, item, ...) or that have no meta kernel are sync
points: they run at once and the server answers with the results' metadata.
"""

from __future__ import annotations

import functools
import itertools
import logging

import torch

from ..dataplane.codec import Ext
from ..dataplane.wire import MsgType
from ..torch_wire import values as tv
from . import handles, meta, runtime, sparse, transfer
from .session import FIRST_BATCH_ITEMS, MAX_BATCH_ITEMS

log = logging.getLogger(__name__)
_C = handles._C
_temp_ids = itertools.count(1)


def _device_index(args, kwargs) -> int:
    """The remote_accel device an op runs on: its first remote tensor's, else a device=
    argument's, else the current one. Tensors sit at the top level or in lists."""
    for value in itertools.chain(args, kwargs.values()):
        if isinstance(value, torch.Tensor):
            if value.device.type == "remote_accel":
                return value.device.index or 0
        elif type(value) is list or type(value) is tuple:
            for item in value:
                if isinstance(item, torch.Tensor) and item.device.type == "remote_accel":
                    return item.device.index or 0
        elif isinstance(value, torch.device) and value.type == "remote_accel":
            return value.index if value.index is not None else _C.current_device()
    return _C.current_device()


def encode_args(op, args, kwargs, index: int, scalars: bool = False) -> tuple:
    """Arguments -> wire values; default generators made explicit for random ops.
    Keywords go sorted by name: the order in which a plan's holes are counted.
    `scalars`: Scalar arguments go as SCALAR holes (a plan's RunOp: see _native_plan)."""
    ref = lambda t: handles.tensor_ref(t, index)  # noqa: E731
    enc_args = tuple(_encode(a, ref, index) for a in args)
    enc_kwargs = {k: _encode(kwargs[k], ref, index) for k in sorted(kwargs)}
    if scalars:
        positions, names = _scalar_arguments(op)
        enc_args = tuple(tv.scalar_value(a) if i in positions and tv.is_scalar_value(a) else e
                         for i, (a, e) in enumerate(zip(args, enc_args)))
        for k in names.intersection(kwargs):
            if tv.is_scalar_value(kwargs[k]):
                enc_kwargs[k] = tv.scalar_value(kwargs[k])
    locator = meta.takes_generator(op)
    if locator is not None and meta.argument(args, kwargs, locator) is None:
        # the server keeps one generator per client generator: name the default one
        if locator[0] == "pos" and locator[1] < len(args):
            enc_args = enc_args[: locator[1]] + (handles.generator_ref(None, index),) + enc_args[locator[1] + 1 :]
        else:
            enc_kwargs[locator[-1]] = handles.generator_ref(None, index)
    return enc_args, enc_kwargs


def _encode(value, ref, index):
    if isinstance(value, torch.Generator):
        return handles.generator_ref(value, index)
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Generator) for v in value):
        return type(value)(_encode(v, ref, index) for v in value)
    return tv.encode_value(value, ref)


def slow_path(op: torch._ops.OpOverload, args: tuple, kwargs: dict, want_plan: bool) -> tuple:
    """Every call the C++ fallback (csrc/op_queue.cpp) cannot serve from a cached plan.

    Returns (results, plan): the plan for later calls with the same key when `want_plan`
    and the call allows one (see _native_plan), else None; False when no call of this op
    ever gets one (ops that draw random numbers, data-dependent ops, host transfers).
    """
    if sparse.involved(op, args, kwargs):  # no meta kernel knows a sparse result's nnz
        # no plan: the same op with strided arguments only (layout= aside) still gets one
        never = op._schema.name in sparse.SPARSE_RESULT_OPS
        return run_with_reply(op, args, kwargs, _device_index(args, kwargs)), (False if never else None)
    special = transfer.SPECIAL_OPS.get(op)
    if special is not None and not transfer.runs_on_server(op, args):
        if op is torch.ops.aten._copy_from.default and transfer.on_one_server(args[0], args[1]):
            return _copy_on_server(op, args, kwargs, want_plan)
        return special(op, args, kwargs, _ON_SERVER), (None if op in transfer.SOMETIMES_ON_SERVER else False)
    return queue_op(op, args, kwargs, want_plan)


def _copy_on_server(op, args, kwargs, want_plan: bool) -> tuple:
    """`_copy_from(src, dst)` between tensors of one server (PyTorch's copy_ for them, as
    in .contiguous()): queued as itself, so that later calls are served from a plan (the
    server runs it as dst.copy_(src)); its result is dst, argument 1."""
    index = _device_index(args, kwargs)
    plan = (next(_plan_ids), 2, (("arg", 1),)) if want_plan else None
    enc_args, enc_kwargs = encode_args(op, args, kwargs, index)
    runtime.session(index).run(meta.op_name(op), enc_args, enc_kwargs, (None,), None,
                               plan=None if plan is None else plan[0])
    return args[1], plan


def run_op(op, args, kwargs):
    """Queue one op (or, where its results depend on data, run it now); its results."""
    return queue_op(op, args, kwargs, False)[0]


def queue_op(op, args, kwargs, want_plan: bool) -> tuple:
    index = _device_index(args, kwargs)
    session = runtime.session(index)
    plan = meta.infer(op, args, kwargs)
    if plan is None:
        return run_with_reply(op, args, kwargs, index), (False if meta.always_replies(op) else None)
    plan = meta.for_server_device(op, plan, args, kwargs, session.device_type)
    schema = meta.schema_of(op)
    # Ops with a generator argument never get a plan (a Generator cannot be keyed); ops that
    # draw from the default stream implicitly (native_dropout) do: C++ keys the default
    # generator's (seed, epoch), and the RunOp's stream names it for the server.
    random = schema.generator_arg is not None
    # a plan replays the results' making: not an out= tensor's resize
    want_plan = want_plan and not random and not _resizes(plan, args, kwargs)
    device = torch.device("remote_accel", index)
    results, outs = [], []  # outs: the fresh result tensors, numbered as the server does
    for spec in plan.results:
        value = _materialise(spec, args, kwargs, device)
        results.append(value)
        if spec[0] == "tensor":
            outs.append(value)
        elif spec[0] == "list":  # Tensor[] returns are expanded in place
            outs.extend(v if s[0] == "tensor" else None for v, s in zip(value, spec[1]))
        else:
            outs.append(None)
    native = None
    if want_plan:
        native = _native_plan(op, plan, args, kwargs, outs)
    enc_args, enc_kwargs = encode_args(op, args, kwargs, index, scalars=native is not None)
    out_refs = tuple(None if t is None else handles.output_ref(t, index) for t in outs)
    session.run(meta.op_name(op), enc_args, enc_kwargs, out_refs, _stream(op, index),
                plan=None if native is None else native[0])
    return meta.pack_results(op, results), (False if random else native)


def _resizes(plan, args, kwargs) -> bool:
    return any(spec[0] == "arg" and spec[2] is not None and tuple(meta.argument(args, kwargs, spec[1]).shape) != spec[2]
               for spec in plan.results)


# -- plans for the C++ fallback -----------------------------------------------------------------
# A training loop sends the same ops on the same layouts again and again; their RunOps
# differ only in storage ids, CPU scalar values and Scalar arguments (an optimizer's step
# size changes every step). So the first call of each key (op, argument metadata, other
# values) sends its RunOp with a plan id, which the server keeps, and hands C++
# (csrc/op_queue.cpp) the plan: its id and how to make the results. Later calls are
# served there and sent as RunPlanned(id, values): per tensor argument or Scalar
# argument in encoding order its storage id, or for a CPU scalar or a Scalar its bytes,
# then per fresh result its storage id, the order in which the server meets the holes in
# the RunOp (Scalar arguments travel in it as SCALAR holes).

_plan_ids = itertools.count(1)


def _native_plan(op, plan, args, kwargs, outs: list):
    """(plan id, number of tensor arguments, results), or None when this call cannot make
    a plan: a CPU tensor that is sent whole, or tensors nested deeper than C++ looks."""
    tensors = _tensor_arguments(args, kwargs)
    for t in tensors:
        if t.device.type == "cpu" and (t.dim() != 0 or t.is_conj() or t.is_neg()):
            return None  # no hole of a fixed size
    if _count_tensors((args, kwargs)) != len(tensors):
        return None
    schema = meta.schema_of(op)
    positions, names = _scalar_arguments(op)
    scalars = sum(1 for i in positions if i < len(args) and tv.is_scalar_value(args[i]))
    scalars += sum(1 for k in names.intersection(kwargs) if tv.is_scalar_value(kwargs[k]))
    return next(_plan_ids), len(tensors) + scalars, tuple(_plan_result(spec, schema) for spec in plan.results)


@functools.lru_cache(maxsize=None)
def _scalar_arguments(op) -> tuple[frozenset, frozenset]:
    """(positions, names) of the op's Scalar and Scalar? arguments: as op_plans.cpp keys
    them, they travel as values (holes), not in the plan's key; none for arange and range,
    whose results' length depends on them."""
    if op._schema.name in ("aten::arange", "aten::range"):
        return frozenset(), frozenset()
    found = [(i, a.name) for i, a in enumerate(op._schema.arguments)
             if isinstance(a.type, torch.NumberType) or (isinstance(a.type, torch.OptionalType)
                                                         and isinstance(a.type.getElementType(), torch.NumberType))]
    return frozenset(i for i, _ in found), frozenset(n for _, n in found)


def _plan_result(spec, schema) -> tuple:
    """A meta.Plan result as op_queue.cpp reads it: arguments by their schema index."""
    kind = spec[0]
    if kind == "arg":
        return ("arg", _schema_index(spec[1], schema))
    if kind == "view":
        _, locator, shape, stride, offset, _dtype = spec
        return ("view", _schema_index(locator, schema), shape, stride, offset)
    if kind == "list":
        return ("list", tuple(_plan_result(s, schema) for s in spec[1]))
    return spec  # ("tensor", shape, stride, dtype) or ("none",)


def _schema_index(locator, schema) -> int:
    return locator[1] if locator[0] == "pos" else schema.arg_names.index(locator[1])


def _tensor_arguments(args, kwargs) -> list:
    """Tensor arguments in encoding order, as op_queue.cpp gathers them: positional, then
    keyword by name, lists one level deep."""
    found = []
    for value in itertools.chain(args, (kwargs[k] for k in sorted(kwargs))):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif type(value) is list or type(value) is tuple:
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def _count_tensors(value) -> int:
    """Tensors at any depth: what the server counts as a plan's tensor holes."""
    if isinstance(value, torch.Tensor):
        return 1
    if isinstance(value, (list, tuple)):
        return sum(_count_tensors(v) for v in value)
    if isinstance(value, dict):
        return sum(_count_tensors(v) for v in value.values())
    return 0


def forget_plans() -> None:
    """Drop every cached plan: they hold result shapes for one server's device type."""
    _C.clear_plans()


def _stream(op, index: int):
    """The default stream's reference for seeded ops without a generator argument."""
    return handles.generator_ref(None, index) if meta.schema_of(op).seeded_without_generator else None


def _materialise(spec, args, kwargs, device):
    """One result of an op: the tensor(s) the caller gets."""
    kind = spec[0]
    if kind == "arg":  # in-place / out=: the result is an argument itself
        value = meta.argument(args, kwargs, spec[1])
        if spec[2] is not None and tuple(value.shape) != spec[2]:
            value.resize_(spec[2])  # out= tensors of another shape are resized, as in eager
        return value
    if kind == "view":  # a non-writing alias of an argument: metadata only
        base = meta.argument(args, kwargs, spec[1])
        _, _, shape, stride, offset, dtype = spec
        return torch.as_strided(base, shape, stride, base.storage_offset() + offset)
    if kind == "tensor":
        _, shape, stride, dtype = spec
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)
    if kind == "list":
        return [_materialise(s, args, kwargs, device) for s in spec[1]]
    if kind == "none":
        return None
    raise AssertionError(f"unknown result kind {kind}")


def run_with_reply(op, args, kwargs, index):
    """Run now; the server tells the results' shapes (data-dependent ops, no meta kernel)."""
    session = runtime.session(index)
    n_out = meta.count_tensor_returns(op)
    may_be_sparse = sparse.involved(op, args, kwargs)
    if may_be_sparse:
        temp = sparse.result_ids(n_out, lambda: -next(_temp_ids))
    else:
        temp = tuple(-next(_temp_ids) for _ in range(n_out))
    enc_args, enc_kwargs = encode_args(op, args, kwargs, index)
    reply = session.run_with_reply(meta.op_name(op), enc_args, enc_kwargs, temp, _stream(op, index))
    device = torch.device("remote_accel", index)
    results = []
    adopt = lambda sid, desc: _adopt(session, sid, desc, device, index)  # noqa: E731
    for i, value in enumerate(reply):  # the server kept result i under temp[i]
        if may_be_sparse and i < len(temp) and sparse.is_description(value):
            results.append(sparse.adopt(value, temp[i], adopt))
        elif type(value) is tuple and len(value) == 5 and type(value[1]) is str:
            ids = temp[i]
            if may_be_sparse:  # a strided result took the first id; the others were not used
                ids = ids[0]
            results.append(adopt(ids, value))
        else:
            results.append(value)
    results = meta.regroup(op, results)
    _write_back(op, args, kwargs, results)
    return meta.pack_results(op, results)


def _write_back(op, args, kwargs, results: list) -> None:
    """In-place and out= results are the argument tensors themselves; an out= tensor that
    the op resized on the server takes the new storage and shape."""
    schema = meta.schema_of(op)
    for i, (target, writes) in enumerate(zip(schema.alias_of, schema.writes)):
        if not writes or target is None or i >= len(results):
            continue
        arg, result = meta.argument(args, kwargs, target), results[i]
        if isinstance(arg, torch.Tensor) and isinstance(result, torch.Tensor):
            if arg.layout is not torch.strided:
                sparse.write_back(arg, result)
            elif result.shape != arg.shape:
                arg.set_(result)
            results[i] = arg


def _adopt(session, temp_sid: int, desc: tuple, device, index) -> torch.Tensor:
    """Move a server-side temporary result into a storage the client allocator owns."""
    nbytes, dtype_name, shape, stride, offset = desc
    dtype = tv.dtype_from_name(dtype_name)
    storage = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if nbytes:
        whole = Ext(tv.TENSOR, (temp_sid, "uint8", (nbytes,), (1,), 0, 0))
        session.run("aten::copy_", (handles.tensor_ref(storage, index), whole), {}, (None,))
    session.free([temp_sid])
    return torch.empty(0, dtype=dtype, device=device).set_(storage.untyped_storage(), offset, shape, stride)


_installed = False


def register() -> None:
    """Install the C++ fallback for every op at the PrivateUse1 key (once per process)."""
    global _installed
    if not _installed:
        _C.install_op_fallback(slow_path, _flush, int(MsgType.ALLOC), int(MsgType.RUN_PLANNED), FIRST_BATCH_ITEMS,
                               MAX_BATCH_ITEMS)
        _C.install_scalar_read(transfer.read_scalar)
        sparse.register(lambda op, args, kwargs: run_with_reply(op, args, kwargs, _device_index(args, kwargs)))
        _installed = True


#: how a host transfer (transfer.SPECIAL_OPS) runs an op on the server after all
_ON_SERVER = transfer.OnServer(run_op, run_with_reply)


def _flush(index: int) -> None:
    """The C++ queue of device `index` is full: send it."""
    runtime.session(index).flush()
