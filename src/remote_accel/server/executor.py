"""Running ops for one session: decode arguments, call the kernel, place the results.

Results are the op's returns in order, with `Tensor[]` returns expanded in place (so
`split` gives one result per piece and `max.dim` two). `RunOp.outs[i]` names where
result i goes:

- a TENSOR reference whose storage exists: the result is copied into that view;
- a TENSOR reference to a new storage id: the result's own storage is kept under it when
  its layout is exactly the promised one (the usual case, no copy), otherwise a storage
  of the promised layout is allocated and the result copied in (meta and the real kernel
  disagree on strides for a few ops);
- None: nothing to keep (in-place ops and views, whose results alias an input).

With `reply` set, outs are plain storage ids and results are kept as they come; the
client learns their layout from the RunReply.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..dataplane import codec
from ..dataplane import messages as m
from ..dataplane.codec import Ext
from ..dataplane.messages import RunOp
from ..errors import ProtocolError
from ..torch_wire import sparse as torch_sparse
from ..torch_wire import values as torch_values
from . import ops
from .device import ComputeDevice
from .exec_values import _graph_value, _has_layout, _settle_lazy_bits, flatten
from .failure import BAD_HANDLE, OP, Failure
from .graph_runs import GraphRuns
from .graphs import CompiledGraph, GraphCompiler
from .plan_runs import PlanRuns
from .rng import Generators
from .storage import EMPTY_SID, StorageTable, TensorRef, is_sid, parse_ref, ref_parts

_CPU = torch.device("cpu")
_META = torch.device("meta")


def _no_tensor(t):
    raise TypeError("a nested tensor result cannot be returned by value")


class Executor(GraphRuns, PlanRuns):
    """Python's half of the executor. Planned ops that C++ can run from a template (most)
    run there (native.Executor, shared with the StorageTable), in batches with the GIL
    released; this class (with plan_runs.py) defines the templates and runs everything else."""

    def __init__(self, device: ComputeDevice, table: StorageTable, generators: Generators,
                 graphs: Optional[GraphCompiler] = None):
        self.device = device
        ops.use_device_type(device.type)  # which ops run a decomposition (no kernel on this device)
        self.table = table
        self.native = table.native
        self.generators = generators
        shared = device.default_generator()
        if shared is not None:  # seeded ops (native_dropout) run in C++ too
            self.native.set_generators(generators.default, shared)
        self.graphs = graphs  # the server's compiled graphs; None: replay every graph
        self._python_ops = 0
        self.python_alloc_requests = 0  # ALLOC requests the Python path ran (the session counts them)
        self._python_made = 0
        # id -> (nodes, outputs, the compiled graph or None)
        self._graphs: dict[int, tuple[tuple, tuple, Optional[CompiledGraph]]] = {}
        # id -> (the defining RunOp, its holes, (hole, span) of those the op writes)
        self._plans: dict[int, tuple[RunOp, int, tuple]] = {}
        # what each kept plan and graph definition holds, charged to the session's limit
        # (StorageTable.hold) while it is kept: a client cannot make the server hold more
        # than its limit in definitions either
        self._plan_bytes: dict[int, int] = {}
        self._graph_bytes: dict[int, int] = {}
        # The storages whose producing op failed (later uses fail with a message that says
        # why) are kept by the C++ side, which also runs ops.

    @property
    def ops_done(self) -> int:
        return self._python_ops + self.native.ops_done()

    @property
    def python_ops(self) -> int:
        """The ops Python ran (ops_done less the C++ executor's own count)."""
        return self._python_ops

    @property
    def alloc_requests(self) -> int:
        """ALLOC requests run: a storage announced by the client before an op uses it."""
        return self.python_alloc_requests + self.native.alloc_requests()

    @property
    def storages_made(self) -> int:
        """Storages made for an op that writes them, which the client did not ALLOC."""
        return self._python_made + self.native.storages_made()

    # -- arguments ----------------------------------------------------------------------------
    def decode(self, value: Any, touched: list, graph_values: Optional[list] = None,
               decoded: Optional[list] = None) -> Any:
        def resolve(code: int, payload: Any) -> Any:
            if code == torch_values.TENSOR:
                ref = parse_ref(payload)
                touched.append(ref.sid)
                t = self._tensor(ref)
                if decoded is not None:
                    decoded.append((t, ref.flags))
                return t
            if code == torch_values.SPARSE:
                return torch_sparse.decode(payload, lambda ref: resolve(torch_values.TENSOR, ref))
            if code == torch_values.GENERATOR:
                return self.generators.resolve(payload)
            if code == torch_values.DEVICE:
                return self._device(payload)
            if graph_values is None:
                raise ProtocolError("graph value outside a graph")
            return _graph_value(graph_values, payload)

        return torch_values.decode_value(value, resolve)

    def _tensor(self, ref: TensorRef) -> torch.Tensor:
        if is_sid(ref.sid) and self.native.failed(ref.sid) and ref.sid not in self.table:
            raise Failure(BAD_HANDLE, f"storage {ref.sid} does not exist: the op that made it failed")
        return self.table.tensor(ref)

    def _device(self, payload: Any) -> torch.device:
        if type(payload) is not tuple or len(payload) != 2 or type(payload[0]) is not str:
            raise ProtocolError("malformed device")
        kind = payload[0]
        if kind == "remote_accel":
            return self.device.device
        if kind == "cpu":
            return _CPU
        if kind == "meta":
            return _META
        raise ProtocolError(f"device type {kind[:40]!r} is not served here")

    # -- ops ------------------------------------------------------------------------------------
    def run_op(self, msg: RunOp) -> Optional[list]:
        """Execute one RunOp; returns the RunReply results when msg.reply is set."""
        if msg.plan is not None:
            self._define_plan(msg)
        touched: list = []
        mark = self.native.pin_mark()  # the op's storages stay on the device while it runs
        try:
            resolved = ops.resolve(msg.op)
            decoded: list = []
            args = self.decode(msg.args, touched, decoded=decoded)
            kwargs = self.decode(msg.kwargs, touched, decoded=decoded)
            if msg.reply:
                self._check_reply_outs(msg.outs)
            else:
                refs = self._plan_outs(msg.outs)
            if msg.stream is not None and resolved.seeded:
                self._sync_default_stream(msg.stream)
            with torch_sparse.grad_mode(msg.op):
                flat = flatten(self._call(resolved, args, kwargs))
            _settle_lazy_bits(decoded)
            self._python_ops += 1
            results = self._keep(flat, msg.outs) if msg.reply else self._bind(flat, refs, touched)
        except BaseException:
            self.mark_failed(msg.outs)
            self._resync_quietly(touched)
            raise
        finally:
            self.native.unpin(mark)
        self.table.resync(touched)
        return results

    # -- recovery: what a client's snapshot needs, and definitions without running anything ----------
    def define(self, kind: Any, meta: Any) -> None:
        """Keep a plan ("plan": its defining RunOp), a graph ("graph": a RunGraph with its
        nodes) or the random streams ("generators") that a recovering client had on a server
        that died: its replay then refers to them as the original work did."""
        if type(meta) is not bytes:
            raise ProtocolError("Define.meta must be bytes")
        if kind == "plan":
            msg = m.decode(m.MsgType.RUN, meta)
            if msg.plan is None:
                raise ProtocolError("Define of a plan needs a RunOp with its plan id")
            self._define_plan(msg)
        elif kind == "graph":
            msg = m.decode(m.MsgType.RUN_GRAPH, meta)
            if not msg.nodes:
                raise ProtocolError("Define of a graph needs a RunGraph with its nodes")
            self._graph(msg)
        elif kind == "generators":
            self.generators.restore(codec.decode(meta))
        else:
            raise ProtocolError(f"unknown Define kind {str(kind)[:40]!r}")

    # -- calling the kernel, placing its results ------------------------------------------------
    def _sync_default_stream(self, stream: Any) -> None:
        """Reseed the session default if the client's manual_seed moved it since."""
        if type(stream) is not Ext or stream.code != torch_values.GENERATOR:
            raise ProtocolError("a message's stream must be a generator reference")
        self.generators.resolve_default(stream.value)

    def _call(self, resolved: ops.Resolved, args: Any, kwargs: Any) -> Any:
        if type(args) is not tuple:
            args = tuple(args) if type(args) is list else (args,)
        if type(kwargs) is not dict:
            raise ProtocolError("op keyword arguments are not a dict")
        index = resolved.generator_index
        if index is not None:
            # The session's own default, not the device's, which every session shares.
            if len(args) > index:
                if args[index] is None:
                    args = args[:index] + (self.generators.default,) + args[index + 1:]
            elif kwargs.get("generator") is None:
                kwargs["generator"] = self.generators.default
            if resolved.decomposed:
                return self._call_drawing_decomposition(resolved, args, kwargs, index)
        elif resolved.seeded:
            with self.generators.as_device_default():
                return resolved.fn(*args, **kwargs)
        return resolved.fn(*args, **kwargs)

    def _call_drawing_decomposition(self, resolved: ops.Resolved, args: tuple, kwargs: dict, index: int) -> Any:
        """A random op run as a decomposition: those draw from the device's default generator
        (torch._decomp's take no generator argument), which holds the session default's
        state while it runs; another generator of the client's has no such seat."""
        if len(args) > index:
            generator, args = args[index], args[:index] + (None,) + args[index + 1:]
        else:
            generator = kwargs.pop("generator")
        if generator is not self.generators.default:
            raise Failure(OP, f"{resolved.name} runs as a decomposition on this server's device, which draws "
                              f"from the default generator only: pass no generator")
        with self.generators.as_device_default():
            return resolved.fn(*args, **kwargs)

    def _check_reply_outs(self, outs: tuple) -> None:
        for out in outs:
            # a tuple: one storage id per component, should the result be sparse
            for sid in (out if type(out) is tuple and 0 < len(out) <= 3 else (out,)):
                if sid is not None and type(sid) is not int:
                    raise ProtocolError("RunOp(reply=True) outs must be storage ids")
                if sid in self.table:
                    raise Failure(BAD_HANDLE, f"storage {sid} already exists")

    def _plan_outs(self, outs: tuple) -> list:
        """Parse the promised layouts (TensorRefs, None for an out the client keeps no handle
        of) and refuse, before running, outputs over the limit."""
        return [None if sid is None else TensorRef(sid, *layout[:6]) for sid, layout in zip(*self._out_parts(outs))]

    def _out_parts(self, outs: tuple) -> tuple:
        """_plan_outs as (sids, layouts) of storage.ref_parts, None for an out the client
        keeps no handle of: what the C++ placement of a graph's results takes."""
        sids, layouts, need = [], [], 0
        for out in outs:
            if out is None:
                sids.append(None)
                layouts.append(None)
                continue
            if type(out) is not Ext or out.code != torch_values.TENSOR:
                raise ProtocolError("op outs must be tensor references or None")
            sid, layout = ref_parts(out.value)
            if sid not in self.table:
                need += layout[5]
            sids.append(sid)
            layouts.append(layout)
        self.table.check_fits(need)
        return sids, layouts

    def _bind(self, flat: list, refs: list, touched: list, inputs: Optional[set] = None) -> None:
        """Place results as `refs` promise (see the module's docstring); returns None.
        `inputs`: the data pointers of the storages the op read or wrote, when the caller knows them."""
        if len(refs) > len(flat):
            raise Failure(OP, f"the op returned {len(flat)} results, the client expects {len(refs)}")
        if inputs is None:
            inputs = {self.table.storage(s).data_ptr() for s in touched if s in self.table}
        taken: set[int] = set()  # result storages already placed under a storage id
        for i, (ref, value) in enumerate(zip(refs, flat)):
            if ref is None:
                continue
            if not isinstance(value, torch.Tensor):
                raise Failure(OP, f"result {i} is {type(value).__name__}, the client expects a tensor")
            if tuple(value.shape) != ref.shape:
                raise Failure(OP, f"result {i} has shape {tuple(value.shape)}, the client expects {ref.shape}")
            if ref.sid == EMPTY_SID and ref.span == 0:
                continue  # an empty tensor: no bytes to keep
            storage = value.untyped_storage()
            ptr = storage.data_ptr()
            exact = _has_layout(value, ref, self.device.device)
            existing = self.table.get(ref.sid)
            if existing is not None and exact and existing.data_ptr() == ptr:
                continue  # the result already is that view (out= variants)
            need = ref.span
            # The client announces (ALLOCs) an output's storage before the op that fills it,
            # so the usual case is to swap the kernel's fresh storage in for that
            # untouched allocation instead of copying into it.
            if (exact and ptr not in taken and ptr not in inputs and storage.nbytes() > 0
                    and storage.nbytes() == (need if existing is None else existing.nbytes())
                    and (existing is None or existing.data_ptr() not in inputs)):
                taken.add(ptr)
                self.table.put(ref.sid, value)
                continue
            if existing is None:
                self.table.alloc(ref.sid, need)
            self.table.tensor(ref).copy_(value)

    def _keep(self, flat: list, outs: tuple) -> list:
        results: list = []
        kept: list = []  # the client learns of none of them if a later result fails
        try:
            for i, value in enumerate(flat):
                sid = outs[i] if i < len(outs) else None
                if not isinstance(value, torch.Tensor):
                    results.append(torch_values.encode_value(value, _no_tensor))
                elif torch_sparse.is_sparse(value):
                    if type(sid) is not tuple or len(sid) < torch_sparse.n_components(value.layout):
                        raise Failure(OP, f"result {i} is a {value.layout} tensor, the client expects a strided one")
                    results.append(torch_sparse.describe(value, lambda part, k: self._keep_tensor(part, sid[k], kept)))
                else:
                    results.append(self._keep_tensor(value, sid[0] if type(sid) is tuple else sid, kept))
        except BaseException:
            for sid in kept:
                self.table.free(sid)
            raise
        return results

    def _keep_tensor(self, value: torch.Tensor, sid: Optional[int], kept: list) -> tuple:
        value = value.resolve_conj().resolve_neg()
        if value.device != self.device.device:
            value = value.to(self.device.device)
        storage = value.untyped_storage()
        if sid is not None:
            self.table.check_fits(storage.nbytes())
            self.table.put(sid, storage, replace=False)
            kept.append(sid)
        return (storage.nbytes(), torch_values.dtype_name(value.dtype), tuple(value.shape), tuple(value.stride()),
                value.storage_offset())

    def mark_failed(self, outs: Any) -> None:
        for out in outs if type(outs) is tuple else ():
            # storage 0 is every empty tensor's (see StorageTable): it never fails
            if type(out) is Ext and type(out.value) is tuple and out.value:
                out = out.value[0]
            if is_sid(out) and out != EMPTY_SID:
                self.native.mark_failed(out)

    def _resync_quietly(self, touched: list) -> None:
        try:
            self.table.resync(touched)
        except Failure:
            pass  # the op's own error is the one to report

    def forget(self, sid: int) -> None:
        if is_sid(sid):
            self.native.forget(sid)

    def clear(self) -> None:
        self._graphs.clear()
        self.table.release(sum(self._graph_bytes.values()) + sum(self._plan_bytes.values()))
        self._graph_bytes.clear()
        self._plans.clear()
        self._plan_bytes.clear()
        self.native.clear_failed()
        self.native.clear_plans()
