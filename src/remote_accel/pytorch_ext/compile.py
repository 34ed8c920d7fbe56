"""`torch.compile(model)` on remote_accel: one message per graph call.

`backend="remote_accel"` names this backend; torch.compile's default backend (Inductor)
hands graphs over remote tensors to it too (_route_default_backend), so that code written
for CUDA compiles unchanged. The server compiles each graph with Inductor for its own
device, with CUDA graphs where its device and the shapes allow: what `mode=` asks of a
local Inductor (reduce-overhead, max-autotune) the server's policy decides.

AOTAutograd hands us the forward and backward aten graphs. Each graph is sent to the
server once (RunGraph with its nodes); later calls send only the graph id, the input
references and where to put the outputs, so a compiled training step costs one message
for the forward and one for the backward instead of one per op.

Graph constants (get_attr nodes: tensors a model makes in its forward, lifted by Dynamo
as `_tensor_constantN`) travel as extra inputs after the graph's own: small CPU ones by
value at every call, remote ones (and CPU ones too large to inline, uploaded once per
device) by reference. The server compiles each graph it receives (server/graphs.py).
"""

from __future__ import annotations

import copy
import itertools
import operator
import sys
import weakref

import torch
import torch.fx

from .._import_hooks import after_import
from ..dataplane import codec
from ..dataplane import messages as m
from ..dataplane.codec import Ext, Raw
from ..torch_wire import values as tv
from . import handles, runtime
from ._native import load

_C = load()

_graph_ids = itertools.count(1)


class GraphProgram:
    """An FX graph as wire values, with the results' metadata fixed at compile time."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graph_id = next(_graph_ids)
        # the sessions this graph's nodes went to: a new session (init() again) is a new
        # server-side table of graphs, even on the same device index
        self.sent_to: weakref.WeakSet = weakref.WeakSet()
        self.constants = _constants_as_inputs(gm)
        _specialize_size_arithmetic(gm)
        self._uploaded: dict = {}  # (constant number, device index) -> (session, its remote copy)
        slot: dict = {}
        n_inputs = 0
        nodes = []
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                slot[node] = n_inputs
                n_inputs += 1
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is operator.getitem:
                # element j of a multi-result node: named (i, j), no node of its own
                slot[node] = (slot[node.args[0]], node.args[1])
            elif node.op == "call_function":
                slot[node] = n_inputs + len(nodes)
                nodes.append(self._encode_node(node, slot))
            elif node.op == "output":
                self.outputs = tuple(self._ref(v, slot) for v in node.args[0])
            elif node.op != "placeholder":
                raise NotImplementedError(f"remote_accel graphs cannot hold {node.op} nodes")
        self.nodes = tuple(nodes)
        self.n_inputs = n_inputs
        # result layouts: the graph run on fake copies of the inputs (AOTAutograd's own
        # fake mode, which also takes the graph's factories for remote_accel), else on meta
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        if fake_mode is not None:
            with fake_mode, torch.no_grad():
                meta_out = gm(*example_inputs, *(fake_mode.from_tensor(c, static_shapes=True) for c in self.constants))
        else:
            meta_inputs = [
                torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                if isinstance(t, torch.Tensor) else t for t in (*example_inputs, *self.constants)
            ]
            with torch.no_grad():
                meta_out = gm(*meta_inputs)
        self.out_specs = tuple(
            (tuple(t.shape), tuple(t.stride()), t.dtype) if isinstance(t, torch.Tensor) else None for t in meta_out
        )
        # Outputs that are not tensors (with dynamic shapes, the sizes a forward graph saves
        # for its backward) are functions of the inputs' sizes: computed here, per call
        self._scalar_positions = tuple(i for i, t in enumerate(meta_out) if not isinstance(t, torch.Tensor))
        self._scalar_outs = _scalar_outputs(gm, self._scalar_positions) if self._scalar_positions else None
        self._results = _C.GraphResults([None if spec is None else (*spec[:2], tv.dtype_name(spec[2]))
                                         for spec in self.out_specs])
        self._outputs = Raw(codec.encode(self.outputs))

    @staticmethod
    def _ref(value, slot):
        if isinstance(value, torch.fx.Node):
            return Ext(tv.GRAPH_VALUE, slot[value])
        if isinstance(value, list):  # also FX's immutable_list
            return [GraphProgram._ref(v, slot) for v in value]
        if isinstance(value, tuple):
            return tuple(GraphProgram._ref(v, slot) for v in value)
        return tv.encode_value(value, _no_constants)

    def _encode_node(self, node, slot):
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            raise NotImplementedError(f"remote_accel graphs run aten ops only, not {target}")
        name = target._schema.name
        if target._overloadname != "default":
            name += "." + target._overloadname
        args = tuple(self._ref(a, slot) for a in node.args)
        kwargs = {k: self._ref(v, slot) for k, v in node.kwargs.items()}
        return (name, args, kwargs)

    def __call__(self, *inputs):
        index = next(t.device.index or 0 for t in inputs
                     if isinstance(t, torch.Tensor) and t.device.type == "remote_accel")
        session = runtime.session(index)
        if self.constants:
            inputs += tuple(self._constant(k, t, index) for k, t in enumerate(self.constants))
        # the fields that change per call encoded in C++ (csrc/graph_call.cpp), the rest
        # once per graph: the same bytes codec.encode writes for the values themselves
        refs = Raw(_C.graph_inputs(inputs, index, lambda v: codec.encode(_input_ref(v, index))))
        results, outs = self._results.make(index)
        if self._scalar_outs is not None:
            results = list(results)
            for position, value in zip(self._scalar_positions, self._scalar_outs(*inputs)):
                results[position] = value
        first = session not in self.sent_to
        session.run_graph(m.RunGraph(self.graph_id, self.nodes if first else (), refs, self._outputs, Raw(outs),
                                     _stream(index)))
        self.sent_to.add(session)
        return results

    def _constant(self, k: int, t: torch.Tensor, index: int) -> torch.Tensor:
        """The tensor a graph constant travels as: small CPU ones by value, others remote."""
        if t.device.type == "cpu" and t.nbytes > tv.MAX_INLINE_BYTES:
            session, remote = self._uploaded.get((k, index), (None, None))
            if remote is None or session is not runtime.session(index):
                remote = t.to(torch.device("remote_accel", index))
                self._uploaded[(k, index)] = (runtime.session(index), remote)
            t = remote
        return t


def _specialize_size_arithmetic(gm: torch.fx.GraphModule) -> None:
    """Replace Python arithmetic on sizes with its value for the sizes at hand.

    With dynamic shapes (Dynamo marks a dimension dynamic once it changed, e.g. a last
    batch smaller than the others) a graph computes sizes with Python's operators on
    SymInts (`operator.mul(s0, 2)` before a view), which the server's aten-only graphs
    cannot hold. Each becomes its int here, which makes Dynamo guard on the sizes it came
    from: this graph serves these sizes, and others compile a graph of their own, as the
    result layouts (out_specs) already ask."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or isinstance(node.target, torch._ops.OpOverload):
            continue
        value = node.meta.get("val")
        if not isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
            continue
        if isinstance(value, (torch.SymBool, bool)):  # before int: a bool is an int too
            concrete = bool(value)
        elif isinstance(value, (torch.SymInt, int)):
            concrete = int(value)
        else:
            concrete = float(value)
        node.replace_all_uses_with(concrete)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()


def _scalar_outputs(gm: torch.fx.GraphModule, positions: tuple) -> torch.fx.GraphModule:
    """A copy of `gm` that computes only the outputs at `positions` (sizes: sym_size
    calls and arithmetic on the inputs' metadata, which need no server)."""
    graph = copy.deepcopy(gm.graph)
    output = next(n for n in graph.nodes if n.op == "output")
    values = output.args[0]
    graph.erase_node(output)
    graph.output(tuple(values[i] for i in positions))
    graph.eliminate_dead_code()
    return torch.fx.GraphModule(gm, graph)


def _input_ref(value, index: int):
    """A graph input that C++ does not encode itself (CPU tensors, numbers, and every
    value Python must refuse with its own error)."""
    return handles.tensor_ref(value, index) if isinstance(value, torch.Tensor) else value


_streams: dict = {}  # (device, generator id, seed, epoch) -> encoded stream reference


def _stream(index: int) -> Raw:
    """RunGraph.stream, encoded: the default generator's (id, seed, epoch) rarely change."""
    key = (index, *_C.generator_info(_C.default_generator(index)))
    encoded = _streams.get(key)
    if encoded is None:
        if len(_streams) >= 64:
            _streams.clear()
        encoded = _streams[key] = Raw(codec.encode(handles.stream_ref(*key)))
    return encoded


def _constants_as_inputs(gm: torch.fx.GraphModule) -> tuple:
    """Turn get_attr nodes into placeholders after the graph's own; returns their tensors."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    constants = []
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        value = operator.attrgetter(node.target)(gm)
        if not isinstance(value, torch.Tensor):
            raise NotImplementedError(f"remote_accel graphs cannot hold a {type(value).__name__} attribute")
        where = (gm.graph.inserting_after(placeholders[-1]) if placeholders
                 else gm.graph.inserting_before(next(iter(gm.graph.nodes))))
        with where:
            ph = gm.graph.placeholder(f"constant_{len(constants)}")
        placeholders.append(ph)
        node.replace_all_uses_with(ph)
        gm.graph.erase_node(node)
        constants.append(value)
    if constants:
        gm.recompile()
    return tuple(constants)


def _no_constants(t):
    raise NotImplementedError("tensor values inside a compiled graph's nodes are not supported")


def _compile(gm: torch.fx.GraphModule, example_inputs):
    program = GraphProgram(gm, example_inputs)

    from functorch.compile import make_boxed_func

    return make_boxed_func(program)


def backend():
    from torch._dynamo.backends.common import aot_autograd

    # Inference graphs (a compiled optimizer step, anything under no_grad) write the inputs
    # they mutate themselves, with copy_ nodes the server runs in place: otherwise AOT's
    # wrapper copies every new value back on the client, one eager op each (AdamW: three a
    # parameter, which cost more than the whole graph). Only where every tensor input is
    # on the server: of a CPU input (AdamW's step counts, unless capturable=True) the
    # server has a copy, so its new value must come back through AOT's wrapper.
    in_graph = aot_autograd(fw_compiler=_compile, bw_compiler=_compile, keep_inference_input_mutations=True)
    on_client = aot_autograd(fw_compiler=_compile, bw_compiler=_compile)

    def compile_graph(gm: torch.fx.GraphModule, example_inputs, mode=None, options=None):
        # mode and options: torch.compile passes them to any backend; see the docstring above
        # Dynamo installs a compiled optimizer's state as attributes of the module
        attrs = [operator.attrgetter(n.target)(gm) for n in gm.graph.nodes if n.op == "get_attr"]
        if any(isinstance(t, torch.Tensor) and t.device.type != "remote_accel" for t in (*example_inputs, *attrs)):
            return on_client(gm, example_inputs)
        return in_graph(gm, example_inputs)

    return compile_graph


_backend = None


def remote_accel_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """torch.compile(backend="remote_accel"): found by name through the entry point of
    group torch_dynamo_backends (pyproject.toml), so that registering the device does
    not import torch._dynamo (about a second and a half of `import torch` with autoload);
    built at the first graph."""
    global _backend
    if _backend is None:
        _backend = backend()
    return _backend(gm, example_inputs, **kwargs)


def register_backend() -> None:
    """The default backend's graphs over remote tensors go to remote_accel_backend; the
    name "remote_accel" too where torch._dynamo is already loaded (its registry reads
    the entry points only when it is asked for a name it does not know)."""
    _route_default_backend(remote_accel_backend)
    after_import("torch._dynamo", _leave_our_frames_alone)
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and "remote_accel" not in dynamo.list_backends(exclude_tags=()):
        dynamo.register_backend(name="remote_accel")(remote_accel_backend)


def _leave_our_frames_alone(dynamo) -> None:
    """Dynamo compiles every Python frame that runs under torch.compile unless its file
    is on its skip list, as torch's own are. Where a compiled function runs an op on a
    remote tensor eagerly (around a graph break: DistributedDataParallel's forward breaks
    at its C++ reducer), the dispatcher calls the device's Python fallback, and Dynamo
    then tried to trace the fallback's meta inference itself (and failed). Our frames
    are the device's, as torch's C++ kernels are: never traced."""
    dynamo.trace_rules.add("remote_accel")


def _route_default_backend(remote) -> None:
    """torch.compile(model) with the default backend: graphs that touch remote tensors
    compile here (on the server), every other graph with Inductor as before. Inductor has
    no code generator for remote_accel (KeyError: 'remote_accel'); the server's Inductor
    has one for the device the tensors really live on. torch.compile wraps Inductor in
    torch._TorchCompileInductorWrapper, whose __call__ gets each graph."""
    wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
    if wrapper is None or getattr(wrapper.__call__, "remote_accel_routed", False):
        return
    inductor_call = wrapper.__call__

    def __call__(self, model_, inputs_, **kwargs):
        if _touches_remote(model_, inputs_):
            return remote(model_, inputs_)
        return inductor_call(self, model_, inputs_, **kwargs)

    __call__.remote_accel_routed = True
    wrapper.__call__ = __call__


def _touches_remote(gm: torch.fx.GraphModule, example_inputs) -> bool:
    def remote(t):
        return isinstance(t, torch.Tensor) and t.device.type == "remote_accel"

    if any(remote(t) for t in example_inputs):
        return True
    # parameters and buffers Dynamo kept as attributes, and tensors a graph makes there
    return any(remote(t) for t in itertools.chain(gm.parameters(), gm.buffers())) or any(
        remote(n.meta.get("val")) or _is_remote_device(n.kwargs.get("device")) for n in gm.graph.nodes)


def _is_remote_device(device) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "remote_accel"
