"""`raccl`: the torch.distributed backend of the remote_accel device.

Registered with torch where the device is (`register`, called by _register.py), for the
device type "remote_accel", as NCCL is for CUDA:

    dist.init_process_group()                      # raccl for remote_accel tensors, gloo for CPU
    dist.init_process_group(device_id=torch.device("remote_accel", local_rank))
    dist.get_default_backend_for_device("remote_accel")  # "raccl"

A rank's collectives run on its server, in order with its ops, and move data between the
servers only (server/collectives.py): the client queues each one as it queues an op and
goes on (`Work.wait()` returns at once: later ops on the device run after it, as on a
CUDA stream; `barrier()` and `Work.synchronize()` wait for the server). A failure, on
this rank or any other, is raised at this rank's next sync point (`.item()`, `.cpu()`,
`synchronize()`), and the group is broken from then on: no rank goes on with data it
did not get. CPU tensors go to a gloo group made beside this one.

The group's ranks find each other through torch's store: rank 0 draws the group's id,
and each rank publishes its server's address, the key its server derives from its token
for this group and rank (dataplane.handshake.group_key; never the token), and its TLS CA,
at its first collective on a remote_accel tensor (as NCCL makes its communicator then).
"""

from __future__ import annotations

import logging
import os
import secrets
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d
from torch.distributed import ReduceOp

from ..dataplane import codec
from ..dataplane import handshake
from ..dataplane import messages as m
from ..errors import ConfigError
from . import handles, runtime, torch_patches

log = logging.getLogger(__name__)

NAME = "raccl"
DEVICE = "remote_accel"

_OPS = {
    ReduceOp.RedOpType.SUM: "sum", ReduceOp.RedOpType.AVG: "avg", ReduceOp.RedOpType.PRODUCT: "product",
    ReduceOp.RedOpType.MIN: "min", ReduceOp.RedOpType.MAX: "max", ReduceOp.RedOpType.BAND: "band",
    ReduceOp.RedOpType.BOR: "bor", ReduceOp.RedOpType.BXOR: "bxor",
}


def register() -> None:
    """Make raccl torch's backend for remote_accel tensors (once per process)."""
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, ProcessGroupRaccl.create, devices=[DEVICE])
        torch_patches.apply()


def _op_name(op) -> str:
    kind = op.op if hasattr(op, "op") else op
    try:
        return _OPS[kind if isinstance(kind, ReduceOp.RedOpType) else ReduceOp.RedOpType(int(kind))]
    except (KeyError, ValueError, TypeError):
        raise ValueError(f"raccl does not support the reduction {op} (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR "
                         "and BXOR are supported)") from None


class Work(dist._Work):
    """A queued collective: done as far as this client can tell, in order with the
    device's later ops. `synchronize` (barrier's wait) waits for the server."""

    def __init__(self, result, session=None, on_wait=None):
        super().__init__()
        self._result = result
        self._session = session  # set: wait() is a sync point (barrier)
        self._on_wait = on_wait  # queues what the device's later ops must wait for (a receive's data)
        self._future = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        on_wait, self._on_wait = self._on_wait, None
        if on_wait is not None:
            on_wait()
        if self._session is not None:
            self._session.sync(timeout.total_seconds() or None)
        return True

    def synchronize(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def result(self):
        return self._result

    def get_future(self) -> torch.futures.Future:
        return self._future


class ProcessGroupRaccl(dist.ProcessGroup):
    """One process group: this rank's collectives on its remote_accel device."""

    @staticmethod
    def create(store, rank: int, size: int, timeout: timedelta) -> "ProcessGroupRaccl":
        return ProcessGroupRaccl(store, rank, size, timeout)

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        # torchrun's store may keep the keys of an attempt that --max-restarts restarted:
        # this attempt's are its own
        store = dist.PrefixStore(f"raccl/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
        self._store = store
        self._timeout = timeout
        if rank == 0:
            store.set("group_id", secrets.token_bytes(m.GROUP_ID_BYTES))
        self.group_id: bytes = bytes(store.get("group_id"))
        # CPU tensors (object collectives, DCP's planning, a CPU barrier) go to gloo, as
        # "cpu:gloo,cuda:nccl" does for CUDA; it is made now, while every rank makes this group
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)
        self._index: Optional[int] = None  # the remote_accel device this rank joined with
        self._seq = 0
        self._receives = 0  # ids of posted receives (irecv), which Work.wait() completes
        self._coalescing: Optional[list] = None  # send/recv ops of a batch (batch_isend_irecv)

    # -- what torch asks of a process group ---------------------------------------------------------
    #: torch asks a device's backend whether it splits groups (init_process_group(device_id=...))
    supports_splitting = False

    def getBackendName(self) -> str:
        return NAME

    def _get_backend(self, device):
        """The backend of a device type: gloo's for CPU, this group (written in Python,
        where torch's own backends are C++ objects) for remote_accel."""
        if torch.device(device).type == DEVICE:
            return self
        return super()._get_backend(torch.device(device))

    def name(self) -> str:
        return NAME

    def _get_backend_name(self) -> str:
        return NAME

    # -- joining: at the first collective on a remote_accel tensor ----------------------------------------
    def _device_of(self, tensors) -> int:
        devices = {t.device for t in tensors}
        if len(devices) != 1 or next(iter(devices)).type != DEVICE:
            raise ValueError(f"raccl: a collective's tensors must all be on one remote_accel device, not "
                             f"{sorted(map(str, devices))}")
        return handles.device_index(tensors[0])

    def _session(self, index: int):
        """The session of remote_accel:`index`, joined to this group at its first use."""
        if self._index is None:
            self._join(index)
        elif index != self._index:
            raise ValueError(f"raccl: this rank's collectives run on remote_accel:{self._index}; this one's tensors "
                             f"are on remote_accel:{index} (one device per rank, as NCCL has)")
        return runtime.session(index)

    def _join(self, index: int) -> None:
        session = runtime.session(index)
        if session.peer_address is None:
            raise ConfigError(
                f"raccl: the server of remote_accel:{index} ({session.transport.peer}) takes no connections from "
                "other servers: it needs a TCP listener others reach (start it with --transport tcp or "
                "tcp,dpdk) and init(direct_copies=True)")
        rank, size = self.rank(), self.size()
        mine = (session.peer_address, handshake.group_key(session.token, self.group_id, rank), session.peer_tls_ca)
        keys = [f"peer/{self.group_id.hex()}/{r}" for r in range(size)]
        self._store.set(keys[rank], codec.encode(mine))
        timeout = self._timeout or dist.default_pg_timeout
        try:  # every rank's first collective on the group waits for the others', as NCCL's does
            self._store.wait(keys, timeout)
        except (RuntimeError, dist.DistError) as exc:
            missing = [r for r, key in enumerate(keys) if not self._store.check([key])]
            raise dist.DistError(f"raccl: rank(s) {missing} of this group did not reach their first collective on "
                                 f"it within the group's timeout ({timeout.total_seconds():g} s): {exc}") from None
        peers = tuple(_peer(codec.decode(self._store.get(key))) for key in keys)
        session.join_group(m.CollJoin(self.group_id, rank, size, peers, float(timeout.total_seconds()),
                                      float(session.timeout)))
        self._index = index
        log.info("raccl: rank %d of %d joined on remote_accel:%d (%s)", rank, size, index, session.peer_address)

    def _queue(self, kind: str, tensors: list, outputs: list = (), op: str = "", root: int = 0, params=None,
               index: Optional[int] = None, seq: int = 0) -> None:
        """Queue one collective on the device (every rank's collectives are numbered in
        order; send and recv go per pair of ranks, numbered on the servers)."""
        if index is None:
            index = self._device_of([*tensors, *outputs])
        session = self._session(index)
        refs = tuple(handles.tensor_ref(t, index) for t in tensors)
        outs = tuple(handles.tensor_ref(t, index) for t in outputs)
        if kind not in ("send", "recv", "wait"):
            self._seq += 1
            seq = self._seq
        session.collective(m.Collective(self.group_id, seq, kind, op, refs, outs, root, params))

    @staticmethod
    def _on_cpu(tensors) -> bool:
        return all(t.device.type == "cpu" for t in tensors)

    # -- collectives --------------------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        tensors = _listed(tensors)
        if self._on_cpu(tensors):
            return self._gloo.allreduce(tensors, _options(opts, c10d.AllreduceOptions))
        op = _op_name(opts.reduceOp if opts is not None else ReduceOp.SUM)
        for t in tensors:
            self._queue("all_reduce", [t], op=op)
        return Work(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        if self._on_cpu(tensors):
            return self._gloo.allreduce_coalesced(tensors, _options(opts, c10d.AllreduceCoalescedOptions))
        op = _op_name(opts.reduceOp if opts is not None else ReduceOp.SUM)
        for t in tensors:
            self._queue("all_reduce", [t], op=op)
        return Work(tensors)

    def broadcast(self, tensors, opts=None):
        tensors = _listed(tensors)
        if self._on_cpu(tensors):
            return self._gloo.broadcast(tensors, _options(opts, c10d.BroadcastOptions))
        for t in tensors:
            self._queue("broadcast", [t], root=opts.rootRank if opts is not None else 0)
        return Work(tensors)

    def reduce(self, tensors, opts=None):
        tensors = _listed(tensors)
        if self._on_cpu(tensors):
            return self._gloo.reduce(tensors, _options(opts, c10d.ReduceOptions))
        op = _op_name(opts.reduceOp if opts is not None else ReduceOp.SUM)
        for t in tensors:
            self._queue("reduce", [t], op=op, root=opts.rootRank if opts is not None else 0)
        return Work(tensors)

    def all_gather_single(self, output, input, opts=None):
        if self._on_cpu([output, input]):
            return self._gloo._allgather_base(output, input, _options(opts, c10d.AllgatherOptions))
        self._queue("all_gather", [input], [output])
        return Work([output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        if self._on_cpu([*outputs, *inputs]):
            return self._gloo.allgather_into_tensor_coalesced(outputs, inputs, _options(opts, c10d.AllgatherOptions))
        for output, input in zip(outputs, inputs):
            self._queue("all_gather", [input], [output])
        return Work(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather(self, output_lists, inputs, opts=None):
        if self._on_cpu([*inputs, *(t for ts in output_lists for t in ts)]):
            return self._gloo.allgather(output_lists, inputs, _options(opts, c10d.AllgatherOptions))
        for outputs, input in zip(output_lists, inputs):
            self._check_parts(outputs, input, "all_gather")
            whole = input.new_empty((self.size() * input.numel(),))
            self._queue("all_gather", [input], [whole])
            for i, part in enumerate(outputs):
                part.copy_(whole[i * input.numel():(i + 1) * input.numel()].view(part.shape))
        return Work(output_lists)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return self.allgather(output_lists, inputs, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        if self._on_cpu([output, input]):
            return self._gloo._reduce_scatter_base(output, input, _options(opts, c10d.ReduceScatterOptions))
        op = _op_name(opts.reduceOp if opts is not None else ReduceOp.SUM)
        self._queue("reduce_scatter", [input], [output], op=op)
        return Work([output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        if self._on_cpu([*outputs, *inputs]):
            return self._gloo.reduce_scatter_tensor_coalesced(outputs, inputs,
                                                              _options(opts, c10d.ReduceScatterOptions))
        op = _op_name(opts.reduceOp if opts is not None else ReduceOp.SUM)
        for output, input in zip(outputs, inputs):
            self._queue("reduce_scatter", [input], [output], op=op)
        return Work(outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        if self._on_cpu([*outputs, *(t for ts in input_lists for t in ts)]):
            return self._gloo.reduce_scatter(outputs, input_lists, _options(opts, c10d.ReduceScatterOptions))
        op = _op_name(opts.reduceOp if opts is not None else ReduceOp.SUM)
        for output, inputs in zip(outputs, input_lists):
            self._check_parts(inputs, output, "reduce_scatter")
            whole = torch.cat([t.reshape(-1) for t in inputs])
            self._queue("reduce_scatter", [whole], [output], op=op)
        return Work(outputs)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        if self._on_cpu([output, input]):
            return self._gloo.alltoall_base(output, input, output_split_sizes, input_split_sizes,
                                            _options(opts, c10d.AllToAllOptions))
        self._queue("all_to_all", [input], [output], params=(tuple(output_split_sizes), tuple(input_split_sizes)))
        return Work([output])

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        if self._on_cpu([*outputs, *inputs]):
            return self._gloo.alltoall(outputs, inputs, _options(opts, c10d.AllToAllOptions))
        whole_in = torch.cat([t.reshape(-1) for t in inputs])
        whole_out = whole_in.new_empty((sum(t.numel() for t in outputs),))
        self._queue("all_to_all", [whole_in], [whole_out],
                    params=(tuple(t.numel() for t in outputs), tuple(t.numel() for t in inputs)))
        at = 0
        for t in outputs:
            t.copy_(whole_out[at:at + t.numel()].view(t.shape))
            at += t.numel()
        return Work(outputs)

    def gather(self, output_lists, inputs, opts=None):
        root = opts.rootRank if opts is not None else 0
        if self._on_cpu([*inputs, *(t for ts in output_lists for t in ts)]):
            return self._gloo.gather(output_lists, inputs, _options(opts, c10d.GatherOptions))
        (input,) = inputs
        if self.rank() != root:
            self._queue("gather", [input], root=root)
            return Work([])
        (outputs,) = output_lists
        self._check_parts(outputs, input, "gather")
        whole = input.new_empty((self.size() * input.numel(),))
        self._queue("gather", [input], [whole], root=root)
        for i, part in enumerate(outputs):
            part.copy_(whole[i * input.numel():(i + 1) * input.numel()].view(part.shape))
        return Work(output_lists)

    def scatter(self, outputs, input_lists, opts=None):
        root = opts.rootRank if opts is not None else 0
        if self._on_cpu([*outputs, *(t for ts in input_lists for t in ts)]):
            return self._gloo.scatter(outputs, input_lists, _options(opts, c10d.ScatterOptions))
        (output,) = outputs
        if self.rank() != root:
            self._queue("scatter", [], [output], root=root)
            return Work(outputs)
        (inputs,) = input_lists
        self._check_parts(inputs, output, "scatter")
        whole = torch.cat([t.reshape(-1) for t in inputs])
        self._queue("scatter", [whole], [output], root=root)
        return Work(outputs)

    def barrier(self, opts=None):
        """On the rank's remote_accel device (the one it joined with, else the current
        one), as NCCL's barrier is on the current CUDA device; its wait() waits until
        every rank's earlier work and the barrier are done. Gloo's where there is none."""
        index = self._index
        if index is None and (runtime.is_initialized() or runtime.connects_on_first_use()):
            index = torch.remote_accel.current_device()
        if index is None:
            return self._gloo.barrier(_options(opts, c10d.BarrierOptions))
        self._queue("barrier", [], [], index=index)
        return Work([], session=runtime.session(index))

    def send(self, tensors, dst: int, tag: int = 0):
        if self._on_cpu(tensors):
            return self._gloo.send(tensors, dst, tag)
        return self._p2p("send", tensors, dst, tag)

    def recv(self, tensors, src: int, tag: int = 0):
        """Posts the receive; its Work's wait() makes the device's later ops wait for the
        data (dist.recv waits at once, irecv when the caller does)."""
        if self._on_cpu(tensors):
            return self._gloo.recv(tensors, src, tag)
        return self._p2p("recv", tensors, src, tag)

    def recv_anysource(self, tensors, tag: int = 0):
        if self._on_cpu(tensors):
            return self._gloo.recv_anysource(tensors, tag)
        raise NotImplementedError("raccl receives from a named rank only (dist.recv(tensor, src=...)), as NCCL does")

    def _p2p(self, kind: str, tensors, peer: int, tag: int) -> Work:
        tensors = list(tensors)
        if not 0 <= peer < self.size() or peer == self.rank():
            raise ValueError(f"raccl: {kind} to rank {peer}: not another rank of a group of {self.size()}")
        index = self._device_of(tensors)
        if kind == "send":
            self._queue(kind, tensors, root=peer, params=tag, index=index)
            return Work(tensors)
        self._receives += 1
        receive = self._receives
        self._queue(kind, tensors, root=peer, params=tag, index=index, seq=receive)
        work = Work(tensors, on_wait=lambda: self._queue("wait", [], params=(receive,), index=index))
        if self._coalescing is not None:
            self._coalescing.append(work)
        return work

    # -- coalescing (_coalescing_manager; batch_isend_irecv issues its ops one by one here) ---------
    def _start_coalescing(self, device) -> None:
        self._coalescing = []

    def _end_coalescing(self, device):
        """One Work for the batch: its wait() waits for every receive in it."""
        works, self._coalescing = self._coalescing or [], None
        return Work([], on_wait=lambda: [work.wait() for work in works])

    def _check_parts(self, parts, like, what: str) -> None:
        if len(parts) != self.size() or any(p.numel() != like.numel() or p.dtype != like.dtype for p in parts):
            raise ValueError(f"raccl {what}: expected {self.size()} tensors of {like.numel()} {like.dtype} elements")


def _listed(tensors) -> list:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _options(opts, cls):
    return opts if opts is not None else cls()


def _peer(value) -> tuple:
    if type(value) is not tuple or len(value) != 3:
        raise ValueError("raccl: a rank published a malformed peer entry in the store")
    return value
