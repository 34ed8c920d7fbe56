"""Compiled graphs: each RunGraph graph becomes an fx.GraphModule compiled for the device.

Replaying a graph node by node in Python costs several microseconds per node on every
call; compiled once, a whole forward or backward runs as a few fused kernels. A graph
the server decoded is rebuilt here as an fx.GraphModule whose every node is an op that
`ops.resolve` allows (the same allowlist as eager ops: nothing else is ever looked up),
then handed to `torch.compile` with Inductor. Compiled code is kept per input signature
(shapes, strides, dtypes): the first STATIC_SIGNATURES signatures are compiled for static
shapes, later ones share one dynamic-shape compilation, and past MAX_SIGNATURES calls
are replayed, much as torch.compile recompiles and then goes dynamic locally. On CUDA,
static-shape code also runs as CUDA graphs (Inductor's cudagraph trees; untested here:
no GPU was lent for this change). Compiling runs in a thread of its own (GraphCompiler).

Graphs are cached per server by a hash of their wire encoding, so a second client (or a
rerun of a program, which numbers its graphs anew) compiles nothing. A graph that cannot
be compiled, or whose compiled code fails where the replay succeeds, is replayed from
then on; why is logged once per graph.

Values in a graph: inputs first, then one per node (see messages.RunGraph). Constants
travel inside the nodes: small CPU tensors inline (CPU_TENSOR) become attributes of the
module, references to device storages (TENSOR) extra inputs resolved at every call.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import operator
import queue
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch
import torch.fx

from .. import config
from ..dataplane import codec
from ..errors import ProtocolError
from ..torch_wire import values as torch_values
from . import ops
from .device import ComputeDevice
from .rng import Generators

log = logging.getLogger(__name__)

#: Compiled graphs a server keeps, the least recently used dropped first.
MAX_ENTRIES = 512
#: REMOTE_ACCEL_COMPILE_GRAPHS=0 makes the server replay every graph (for comparisons).
ENV_SWITCH = "REMOTE_ACCEL_COMPILE_GRAPHS"
#: Input signatures compiled for static shapes before a graph's compilation goes dynamic.
STATIC_SIGNATURES = 2
#: Input signatures a graph is compiled for at most; calls with others are replayed.
MAX_SIGNATURES = 64
#: at::internal::GRAIN_SIZE: ATen's CPU kernels run in parallel only past this many elements.
ATEN_GRAIN_SIZE = 32768


#: Views Dynamo's retrace might refuse: a few ops' meta strides differ from their kernels'
#: (the client traced the graph with the real layouts), so a view that holds when the graph
#: runs can fail on fake tensors (GPT-2's attention: "Cannot view a tensor with shape
#: [2, 2, 16, 16] and strides (512, 16, 1, 32)"). reshape is the same view where one exists
#: and a copy where not; the outputs are copied into the client's storages anyway, so no
#: aliasing is lost.
_VIEW_AS_RESHAPE = {torch.ops.aten.view.default: torch.ops.aten.reshape.default}


class NotCompilable(Exception):
    """The graph is well formed but holds something the compiled path does not take."""


class CompiledGraph:
    """One graph and its compiled forms, shared by every session that sends it.

    Compiled code is keyed by the inputs' signature (shapes, strides, dtypes, plain
    values): the first STATIC_SIGNATURES signatures each get code for their static
    shapes (CUDA graphs on CUDA), later ones share one dynamic-shape compilation."""

    def __init__(self, key: str, nodes: tuple, outputs: tuple, n_inputs: int, extras: tuple, random: bool):
        self.key = key
        self.nodes = nodes
        self.outputs = outputs  # the wire outputs the module returns
        self.n_inputs = n_inputs
        self.n_nodes = len(nodes)
        self.extras = extras  # wire TENSOR values, appended to the inputs at every call
        self.random = random  # draws from the default generator: run with the session's
        self.ready: dict = {}  # signature -> compiled callable
        self.pending: set = set()  # signatures being compiled
        self.static_compiles = 0
        self.dynamic_fn: Optional[Callable] = None
        self.failed: Optional[str] = None
        self.compiles = 0  # Inductor compilations, recompilations included
        self.cudagraphs = False
        # writes its inputs in place (a compiled optimizer step): a compiled run that fails
        # may have written some of them, so it is not replayed on top
        self.mutates = any(_mutable(node[0]) for node in nodes)


def _mutable(name: str) -> bool:
    schema = ops.resolve(name).schema
    return schema is not None and schema.is_mutable


def _device_of(payload: Any, device: torch.device) -> torch.device:
    if type(payload) is not tuple or len(payload) != 2 or type(payload[0]) is not str:
        raise ProtocolError("malformed device")
    kind = payload[0]
    if kind == "remote_accel":
        return device
    if kind in ("cpu", "meta"):
        return torch.device(kind)
    raise ProtocolError(f"device type {kind[:40]!r} is not served here")


def _tensor_refs(value: Any, found: list) -> None:
    """Every TENSOR value inside `value`, in decoding order."""
    t = type(value)
    if t is codec.Ext:
        if value.code == torch_values.TENSOR:
            found.append(value)
    elif t is tuple or t is list:
        for v in value:
            _tensor_refs(v, found)
    elif t is dict:
        for v in value.values():
            _tensor_refs(v, found)


def build(nodes: tuple, outputs: tuple, n_inputs: int, device: torch.device) -> tuple:
    """Wire graph -> (GraphModule, extra TENSOR inputs, whether it draws random numbers).

    Raises Failure for ops outside the allowlist, ProtocolError for malformed values and
    NotCompilable for what only the replay takes (generator arguments)."""
    graph = torch.fx.Graph()
    root = torch.nn.Module()
    values: list = [graph.placeholder(f"input_{i}") for i in range(n_inputs)]
    refs: list = []
    for node in nodes:
        _tensor_refs(node, refs)
    extras: dict = {}
    for ref in refs:  # the same storage view named twice is one input
        if ref not in extras:
            extras[ref] = graph.placeholder(f"extra_{len(extras)}")
    items: dict = {}

    def resolve(code: int, payload: Any) -> Any:
        if code == torch_values.GRAPH_VALUE:
            if type(payload) is int and 0 <= payload < len(values):
                return values[payload]
            if (type(payload) is tuple and len(payload) == 2 and all(type(p) is int for p in payload)
                    and 0 <= payload[0] < len(values) and payload[1] >= 0):
                if payload not in items:
                    items[payload] = graph.call_function(operator.getitem, (values[payload[0]], payload[1]))
                return items[payload]
            raise ProtocolError(f"graph value {payload!r} does not name an earlier value")
        if code == torch_values.TENSOR:
            return extras[codec.Ext(code, payload)]
        if code == torch_values.DEVICE:
            return _device_of(payload, device)
        raise NotCompilable("a node takes a generator argument")

    random = False
    for node in nodes:
        resolved = ops.resolve(node[0])
        random = random or resolved.generator_index is not None or resolved.seeded
        args = torch_values.decode_value(node[1], resolve)
        kwargs = torch_values.decode_value(node[2], resolve)
        if any(type(k) is not str for k in kwargs):
            raise ProtocolError("op keyword names must be strings")
        args, kwargs = _constants_as_attributes(graph, root, (tuple(args), kwargs))
        values.append(graph.call_function(_VIEW_AS_RESHAPE.get(resolved.fn, resolved.fn), args, kwargs))
    out = torch_values.decode_value(tuple(outputs), resolve)
    graph.output(tuple(out))
    gm = torch.fx.GraphModule(root, graph)
    return gm, tuple(extras), random


def _constants_as_attributes(graph: torch.fx.Graph, root: torch.nn.Module, value: Any) -> Any:
    """Inline CPU tensors (graph constants) become buffers of the module, read by get_attr."""

    def walk(v):
        if isinstance(v, torch.Tensor):
            name = f"constant_{len(root._buffers)}"
            root.register_buffer(name, v)
            return graph.get_attr(name)
        if type(v) is tuple:
            return tuple(walk(x) for x in v)
        if type(v) is list:
            return [walk(x) for x in v]
        if type(v) is dict:
            return {k: walk(x) for k, x in v.items()}
        return v

    return walk(value)


def graph_key(nodes: tuple, outputs: tuple, n_inputs: int) -> str:
    return hashlib.sha256(codec.encode((n_inputs, tuple(nodes), tuple(outputs)))).hexdigest()


def value_signature(a: Any) -> tuple:
    """What Dynamo guards on, roughly: a new signature may mean a recompilation. A storage
    reference's is (dtype, shape, stride, flags), taken from the reference (Executor)."""
    return (a.dtype, a.shape, a.stride(), a.device) if isinstance(a, torch.Tensor) else (type(a), a)


def _signature(args: tuple) -> tuple:
    return tuple(value_signature(a) for a in args)


def _warm_copy(a: Any) -> Any:
    """A private copy of an input for a compilation run: the same layout, storage and all."""
    if not isinstance(a, torch.Tensor):
        return a
    storage = a.untyped_storage()
    copy = torch.empty(0, dtype=a.dtype, device=a.device)
    return copy.set_(storage.clone(), a.storage_offset(), a.shape, a.stride())


class GraphCompiler:
    """The server's compiled graphs, shared by its sessions (each runs in a thread of its own).

    Compiling takes seconds (minutes for a large backward on a small CPU), far longer
    than a client waits at a sync point, so it happens in a thread of its own, on
    copies of the inputs of the call that asked for it; until it is done the graph is
    replayed. A compilation run draws its random numbers from a scratch stream."""

    def __init__(self, device: ComputeDevice, enabled: Optional[bool] = None):
        self.device = device
        if enabled is None:
            enabled = config.enabled(ENV_SWITCH)
        self.enabled = enabled
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, CompiledGraph] = OrderedDict()
        self._unfit: OrderedDict[str, str] = OrderedDict()  # key -> why it is only replayed
        self._work: queue.Queue = queue.Queue()
        self._worker: Optional[threading.Thread] = None
        self._warming = threading.local()
        self.counters = {"graphs_compiled": 0, "graph_compiles": 0, "graph_cache_hits": 0,
                         "graph_compile_failures": 0, "graph_runs_compiled": 0, "graph_runs_replayed": 0}

    def lookup(self, nodes: tuple, outputs: tuple, n_inputs: int) -> Optional[CompiledGraph]:
        """The compiled graph for these nodes, made on first sight; None: always replay it."""
        if not self.enabled:
            return None
        key = graph_key(nodes, outputs, n_inputs)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.counters["graph_cache_hits"] += 1
                return entry
            if key in self._unfit:
                return None
        try:
            _, extras, random = build(nodes, outputs, n_inputs, self.device.device)
        except NotCompilable as exc:
            with self._lock:
                self._unfit[key] = str(exc)
                while len(self._unfit) > MAX_ENTRIES:
                    self._unfit.popitem(last=False)
            log.info("graph %s (%d nodes) is replayed, not compiled: %s", key[:12], len(nodes), exc)
            return None
        entry = CompiledGraph(key, tuple(nodes), tuple(outputs), n_inputs, extras, random)
        with self._lock:
            entry = self._entries.setdefault(key, entry)  # another session may have been first
            while len(self._entries) > MAX_ENTRIES:
                self._entries.popitem(last=False)
        return entry

    # -- running ----------------------------------------------------------------------------------
    def run(self, entry: CompiledGraph, inputs: list, extras: list, generators, replay: Callable[[], Any],
            sig: Optional[tuple] = None) -> Any:
        """The graph's outputs from its compiled code; `replay()`'s until that is ready, or where it fails.
        `sig`: the inputs' signature, where the caller has it (see value_signature)."""
        args = (*inputs, *extras)
        fn = None
        if entry.failed is None:
            if sig is None:
                sig = _signature(args)
            fn = entry.ready.get(sig)
            if fn is None:
                self._schedule(entry, sig, args)
        if fn is None:
            self.counters["graph_runs_replayed"] += 1
            return replay()
        try:
            if entry.random:
                with generators.as_device_default():
                    out = fn(*args)
            else:
                out = fn(*args)
        except Exception as exc:
            if entry.mutates:  # its inputs may be half written: a replay would apply it twice
                self._give_up(entry, exc)
                raise
            out = replay()  # raises the graph's own error if it has one, not its compiler's
            self._give_up(entry, exc)
            return out
        self.counters["graph_runs_compiled"] += 1
        if entry.cudagraphs:
            # cudagraph outputs live in the graph's pool and are overwritten by its next run
            out = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in out)
        return out

    def _schedule(self, entry: CompiledGraph, sig: tuple, args: tuple) -> None:
        with self._lock:
            if sig in entry.pending or len(entry.ready) + len(entry.pending) >= MAX_SIGNATURES:
                return
            entry.pending.add(sig)
            if self._worker is None:
                self._worker = threading.Thread(target=self._work_loop, name="graph compiler", daemon=True)
                self._worker.start()
        copies = tuple(_warm_copy(a) for a in args)
        event = None
        if self.device.accelerator:  # the copies are queued on the session's stream
            event = torch.Event(device=self.device.device)
            event.record()
        self._work.put((entry, sig, copies, event))

    def _work_loop(self) -> None:
        torch.set_grad_enabled(False)  # as in session threads: Dynamo guards on it
        self.device.bind_thread(self.device.new_stream())
        while True:
            entry, sig, copies, event = self._work.get()
            if event is not None:
                event.synchronize()
            compiles = entry.compiles
            try:
                fn = self._callable(entry, copies)
                self._warming.on = True
                try:
                    fn(*copies)  # dynamic: compiles for this signature; static: a first run
                finally:
                    self._warming.on = False
            except Exception as exc:
                self._give_up(entry, exc)
                fn = None
            with self._lock:  # counted once the code is ready to use
                entry.pending.discard(sig)
                if fn is not None and entry.failed is None:
                    entry.ready[sig] = fn
                self.counters["graph_compiles"] += entry.compiles - compiles
                if compiles == 0 and entry.compiles > 0:
                    self.counters["graphs_compiled"] += 1
            del copies

    def _callable(self, entry: CompiledGraph, copies: tuple) -> Callable:
        """Code for the signature of `copies`. Static shapes: Inductor straight on the graph,
        which already is aten ops; Dynamo's guards and wrappers cost about 0.25 ms a call on
        a tiny Transformer's graphs, and run() keys the code by the inputs' signature, which
        checks more than those guards (shapes, strides, dtypes, devices, plain values).
        Dynamic shapes: torch.compile of a module of its own (Dynamo keys its cache by
        code object), whose guards pick the code for each call."""
        if entry.static_compiles < STATIC_SIGNATURES:
            gm, _, _ = build(entry.nodes, entry.outputs, entry.n_inputs, self.device.device)
            entry.static_compiles += 1
            return self._inductor(entry, gm, list(copies))
        if entry.dynamic_fn is None:
            gm, _, _ = build(entry.nodes, entry.outputs, entry.n_inputs, self.device.device)
            entry.dynamic_fn = torch.compile(gm, backend=functools.partial(self._inductor, entry), dynamic=True)
        return entry.dynamic_fn

    def _inductor(self, entry: CompiledGraph, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        """Dynamo's backend: Inductor, with CUDA graphs where the device and shapes allow."""
        from torch._inductor.compile_fx import compile_fx

        # random ops as the eager kernels draw them: compiled and replayed runs agree
        patches: dict = {"fallback_random": True}
        if self.device.type == "cpu":
            # Inductor splits a loop over OpenMP threads from 512 elements a thread on; eager
            # kernels only past ATen's grain size (32768 elements). Each parallel region wakes
            # the pool's sleeping threads (the server waits passively), which on a small shared
            # host costs more than a small model's kernels: a tiny Transformer step took 28 ms
            # instead of 16. Split only where eager kernels would.
            patches["cpp.min_chunk_size"] = max(512, ATEN_GRAIN_SIZE // max(1, torch.get_num_threads()))
        static = not any(isinstance(a, torch.SymInt) or isinstance(a, torch.Tensor)
                         and any(isinstance(s, torch.SymInt) for s in a.shape) for a in example_inputs)
        if static:
            # run() keys static code by its inputs' shapes, strides, dtypes and devices, so
            # Inductor's checks of the same at each call are redundant: an AdamW step's
            # graph has 135 inputs
            patches["size_asserts"] = False
        if self.device.type == "cuda" and static:
            patches["triton.cudagraphs"] = True
            entry.cudagraphs = True
        start = time.perf_counter()
        compiled = compile_fx(gm, example_inputs, config_patches=patches)
        seconds = time.perf_counter() - start
        entry.compiles += 1
        shapes = [tuple(a.shape) for a in example_inputs if isinstance(a, torch.Tensor)][:3]
        log.info("graph %s: %d nodes compiled by Inductor (%s shapes%s) in %.2f s; inputs %s...",
                 entry.key[:12], entry.n_nodes, "static" if static else "dynamic",
                 ", CUDA graphs" if "triton.cudagraphs" in patches else "", seconds, shapes)
        if not entry.random:
            return compiled
        warming, scratch = self._warming, Generators(self.device)

        def run(*args):
            if getattr(warming, "on", False):  # a compilation run: keep the sessions' streams untouched
                with scratch.as_device_default():
                    return compiled(*args)
            return compiled(*args)

        return run

    def _give_up(self, entry: CompiledGraph, exc: Exception) -> None:
        with self._lock:
            if entry.failed is not None:
                return
            entry.failed = f"{type(exc).__name__}: {str(exc).strip()[:2000]}"
            self.counters["graph_compile_failures"] += 1
        log.warning("graph %s (%d nodes) failed to compile and is replayed from now on: %s",
                    entry.key[:12], entry.n_nodes, entry.failed)

    def stats(self) -> dict:
        with self._lock:
            return dict(self.counters, graphs_cached=len(self._entries))
