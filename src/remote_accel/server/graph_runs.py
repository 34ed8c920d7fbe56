"""Running captured graphs (RunGraph) for an Executor: a graph is sent once with its nodes
and rerun by id; it runs compiled (graphs.py) where it can, else node by node.

A mixin of server.executor.Executor, kept apart so that each module stays small; it uses
the executor's decoding, binding and failure handling."""

from __future__ import annotations

from typing import Optional

from ..dataplane.codec import Ext
from ..dataplane.messages import RunGraph
from ..errors import ProtocolError
from ..torch_wire import values as torch_values
from . import ops
from .exec_values import definition_bytes, flatten
from .failure import BAD_HANDLE, Failure
from .graphs import CompiledGraph, value_signature
from .storage import TensorRef, ref_parts

#: Graphs kept per session for reruns by id, and the nodes they may hold together.
MAX_GRAPHS = 256
MAX_GRAPH_NODES = 1 << 17


class GraphRuns:
    def run_graph(self, msg: RunGraph) -> None:
        """Run a captured graph. Values are numbered inputs first, then one per node, so
        Ext(GRAPH_VALUE, i) is value i and Ext(GRAPH_VALUE, (i, j)) element j of value i.
        A graph sent once with its nodes may be run again by id with `nodes` empty.
        Graphs run compiled (see graphs.py) where they can, else node by node."""
        touched: list = []
        try:
            nodes, outputs, compiled = self._graph(msg)
            if msg.stream is not None:
                self._sync_default_stream(msg.stream)
            signature: list = []
            values = self._graph_inputs(msg.inputs, touched, signature)
            out_sids, out_layouts = self._out_parts(msg.outs)
            if compiled is not None and len(values) == compiled.n_inputs and outputs == compiled.outputs:
                extras = self._graph_inputs(compiled.extras, touched, signature)
                flat = flatten(self.graphs.run(compiled, values, extras, self.generators,
                                               lambda: self._replay(msg.graph_id, nodes, outputs, list(values),
                                                                    touched), tuple(signature)))
                self._python_ops += len(nodes)
            else:
                flat = self._replay(msg.graph_id, nodes, outputs, values, touched)
            # results placed in C++ (about 5 us a result in Python; a forward has ~60); the
            # storages of `touched`, the graph's inputs, are never taken over
            self.native.bind_graph(flat, out_sids, out_layouts, touched)
        except BaseException:
            self.mark_failed(msg.outs)
            self._resync_quietly(touched)
            raise
        self.table.resync(touched)

    def _graph_inputs(self, wire: tuple, touched: list, signature: list) -> list:
        """A graph's inputs, and what compiled code is keyed by (graphs.signature) appended
        to `signature`. Storage references, most of a graph's inputs, take a short way
        (storage.ref_parts, one C++ call for their views): decoding a graph call's ~100 of
        them was a tenth of a compiled step's server time."""
        values: list = []
        sids, layouts, slots = [], [], []
        for v in wire:
            if type(v) is Ext and v.code == torch_values.TENSOR:
                sid, layout = ref_parts(v.value)
                touched.append(sid)
                sids.append(sid)
                layouts.append(layout)
                slots.append(len(values))
                values.append(None)
                signature.append(layout[6])
            else:
                value = self.decode(v, touched)
                values.append(value)
                signature.append(value_signature(value))
        if sids:
            for slot, sid, layout, t in zip(slots, sids, layouts, self.native.views(sids, layouts)):
                # None: Python's StorageTable.tensor says what is wrong
                values[slot] = t if t is not None else self._tensor(TensorRef(sid, *layout[:6]))
        return values

    def _replay(self, graph_id: int, nodes: tuple, outputs: tuple, values: list, touched: list) -> list:
        for k, node in enumerate(nodes):
            resolved = ops.resolve(node[0])
            args = self.decode(node[1], touched, values)
            kwargs = self.decode(node[2], touched, values)
            try:
                values.append(self._call(resolved, args, kwargs))
            except Exception as exc:
                exc.add_note(f"in node {k} ({node[0]}) of graph {graph_id}")
                raise
            self._python_ops += 1
        return flatten([self.decode(o, touched, values) for o in outputs])

    def _drop_graph(self, graph_id) -> None:
        del self._graphs[graph_id]
        self.table.release(self._graph_bytes.pop(graph_id))

    def _graph(self, msg: RunGraph) -> tuple[tuple, tuple, Optional[CompiledGraph]]:
        if not msg.nodes:
            cached = self._graphs.get(msg.graph_id)
            if cached is None:
                raise Failure(BAD_HANDLE, f"graph {msg.graph_id} was never sent")
            return cached[0], msg.outputs or cached[1], cached[2]
        if len(msg.nodes) > MAX_GRAPH_NODES:
            raise ProtocolError(f"a graph may hold at most {MAX_GRAPH_NODES} nodes")
        for node in msg.nodes:
            if (type(node) is not tuple or len(node) != 3 or type(node[0]) is not str
                    or type(node[1]) not in (tuple, list) or type(node[2]) is not dict):
                raise ProtocolError("graph nodes must be (op, args, kwargs)")
        if msg.graph_id in self._graphs:
            self._drop_graph(msg.graph_id)
        nbytes = definition_bytes(msg.nodes, msg.outputs)
        self.table.hold(nbytes)  # past the limit: Failure (out of memory), nothing kept
        held = sum(len(entry[0]) for entry in self._graphs.values())
        while self._graphs and (len(self._graphs) >= MAX_GRAPHS or held + len(msg.nodes) > MAX_GRAPH_NODES):
            oldest = next(iter(self._graphs))
            held -= len(self._graphs[oldest][0])
            self._drop_graph(oldest)
        compiled = self.graphs.lookup(msg.nodes, msg.outputs, len(msg.inputs)) if self.graphs else None
        self._graphs[msg.graph_id] = (msg.nodes, msg.outputs, compiled)
        self._graph_bytes[msg.graph_id] = nbytes
        return msg.nodes, msg.outputs, compiled

