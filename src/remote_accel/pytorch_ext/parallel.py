"""One script, many servers: nn.DataParallel's semantics over remote_accel:0..N-1.

The module stays on devices[0]. Each forward scatters the inputs along `dim` (a chunk per
device, copied straight from where it lies to its server), replicates the parameters and
buffers onto the other devices, runs one replica per server and gathers the outputs on
`output_device`. Nothing here waits: every op is queued on its server's session and the
servers run their replicas at the same time; the first sync point is the user's.

Parameters and gradients move only between servers (transfer.copy_direct over TCP and
TLS sessions): each dtype's parameters are flattened into one tensor on devices[0] and sent
down a binomial tree (devices[0] sends log2(N) copies, not N-1), and the backward
reduces each replica's flat gradient up the mirrored tree, summing where the tensors
are. One copy per dtype and tree edge, not one per parameter: every direct copy costs
about 0.3 ms of this client's Python and a round of messages between two servers. A DPDK session's server takes part
through its TCP listener; one without (no peer address) has the same copies go through
this client (a download and an upload).

The tree copies run inside one autograd Function, in one thread: autograd runs each
device's backward in that device's worker thread, and copies issued from two threads in
opposite directions could interleave into a wait that only the copy timeout breaks (A
waits for bytes from B while B waits for bytes from A); transfer.copy_direct keeps each
copy's two halves together for the same reason.

A torch.compile'd module inside runs compiled on every server, its replicas' backwards
one after another on the client (_backward_before says why); torch.compile around
DataParallel runs its forward eagerly. Copies do not overlap the
backward (the reduce starts once the last replica's backward is done). A server that dies
in the middle of a step: the servers waiting for its copies find within seconds that
nothing listens there any more (server/peer.py) and the error, naming it, reaches this
client at its next sync.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

import torch
from torch import nn
from torch.func import functional_call
from torch.utils._pytree import tree_leaves

from ..errors import RemoteAccelError
from . import runtime

DEVICE_TYPE = "remote_accel"


# -- devices -------------------------------------------------------------------------------------
def resolve_devices(devices: Optional[Sequence[Any]]) -> list[torch.device]:
    """`devices` as remote_accel torch.devices with indices: ints, strings and devices
    accepted, None for every server of the session. Clear errors for another kind of
    device, an index the session does not have, or a device named twice."""
    count = torch.remote_accel.device_count()
    if devices is None:
        devices = range(count)
    out = []
    for d in devices:
        dev = torch.device(DEVICE_TYPE, d) if isinstance(d, int) else torch.device(d)
        if dev.type != DEVICE_TYPE:
            raise ValueError(f"remote_accel.parallel: every device must be a remote_accel device (one server "
                             f"each), got {dev} in {list(devices)}; devices of different kinds cannot share a "
                             "replica's gradients server to server")
        if dev.index is None:
            dev = torch.device(DEVICE_TYPE, torch.remote_accel.current_device())
        if not 0 <= dev.index < count:
            raise ValueError(f"remote_accel.parallel: {dev} is not a server of this session, which has {count} "
                             "(remote_accel.init(servers=[...]) names them)")
        if dev in out:
            raise ValueError(f"remote_accel.parallel: {dev} named twice in {list(devices)}")
        out.append(dev)
    if not out:
        raise ValueError("remote_accel.parallel: no devices")
    return out


def check_alive(devices: Sequence[torch.device]) -> None:
    """One round trip to each server, so that a server that is gone is named now, before
    any replica's ops are queued behind copies that would wait for it. Every server is
    asked, and one that is gone is named before any other error: after a step that lost
    a server, a live one may still hold that step's error (its copy to the lost one
    failed), which is that loss again, not a fault of its own."""
    failures = []
    for dev in devices:
        try:
            torch.remote_accel.synchronize(dev.index)
        except RemoteAccelError as exc:
            failures.append((dev, exc))
    if failures:
        gone = [(dev, exc) for dev, exc in failures if not runtime.session(dev.index).alive]
        dev, exc = (gone or failures)[0]
        raise type(exc)(f"remote_accel.parallel: {dev} cannot be used: {exc}") from exc


def check_module_on(module: nn.Module, device: torch.device) -> None:
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if t.device != device:
            raise ValueError(f"remote_accel.parallel: the module must have its parameters and buffers on "
                             f"{device} (devices[0]), but {name} is on {t.device}; move it with "
                             f"module.to('{device}') first")


# -- scatter and gather --------------------------------------------------------------------------
def scatter(obj: Any, devices: Sequence[torch.device], dim: int) -> list:
    """`obj` split into at most len(devices) pieces: tensors chunked along `dim` (a
    shorter last chunk for an uneven batch, fewer pieces for a batch smaller than the
    device list), each chunk copied to its device; tuples, lists and dicts element by
    element; anything else given to every piece as it is."""
    if isinstance(obj, torch.Tensor):
        return [c.to(dev) for c, dev in zip(obj.chunk(len(devices), dim), devices)]
    if isinstance(obj, (tuple, list)) and obj:
        parts = [scatter(o, devices, dim) for o in obj]
        n = min(len(p) for p in parts)
        return [type(obj)(p[i] for p in parts) if not _is_namedtuple(obj) else type(obj)(*(p[i] for p in parts))
                for i in range(n)]
    if isinstance(obj, dict) and obj:
        keys = list(obj)
        parts = [scatter(obj[k], devices, dim) for k in keys]
        n = min(len(p) for p in parts)
        return [type(obj)(zip(keys, (p[i] for p in parts))) for i in range(n)]
    return [obj] * len(devices)


def _is_namedtuple(obj) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def gather(outputs: list, device: torch.device, dim: int) -> Any:
    """The replicas' outputs concatenated along `dim` on `device` (0-dim tensors stacked,
    as nn.DataParallel does for a per-replica loss), structure kept."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        moved = [o.to(device) for o in outputs]
        return torch.stack(moved) if first.dim() == 0 else torch.cat(moved, dim)
    if first is None:
        return None
    if isinstance(first, dict):
        return type(first)((k, gather([o[k] for o in outputs], device, dim)) for k in first)
    if _is_namedtuple(first):
        return type(first)(*(gather(list(parts), device, dim) for parts in zip(*outputs)))
    if isinstance(first, (tuple, list)):
        return type(first)(gather(list(parts), device, dim) for parts in zip(*outputs))
    return first


# -- broadcast and reduce, server to server ------------------------------------------------------
def tree_broadcast(t: torch.Tensor, devices: Sequence[torch.device]) -> list[torch.Tensor]:
    """Copies of `t` (on devices[0]) on every device, devices[0]'s being `t` itself: in
    each round every device that holds a copy sends one to a device that has none."""
    held = [t]
    while len(held) < len(devices):
        round_ = [src.to(devices[len(held) + i]) for i, src in enumerate(held[:len(devices) - len(held)])]
        held.extend(round_)
    return held


def tree_reduce(grads: Sequence[Optional[torch.Tensor]], devices: Sequence[torch.device]) -> Optional[torch.Tensor]:
    """The sum of `grads` (grads[i] on devices[i], None for none) on devices[0], summed
    up the tree that tree_broadcast sends down: in each round device k adds what device
    k + step holds, so each device receives at most log2(N) copies."""
    acc = dict((i, g) for i, g in enumerate(grads) if g is not None)
    step = 1
    while step < len(devices):
        for k in range(0, len(devices), 2 * step):
            partner = acc.pop(k + step, None)
            if partner is None:
                continue
            moved = partner.to(devices[k])
            acc[k] = moved if k not in acc else acc[k] + moved
        step *= 2
    return acc.get(0)


class _Broadcast(torch.autograd.Function):
    """flat (on devices[0]) -> flat itself and its copies on devices[1:]; backward: their
    gradients summed on devices[0]. devices[0]'s replica uses the first output too, so
    that this backward runs after the last replica's, devices[0]'s included: run any
    earlier and devices[0] would wait for the others' gradients before computing its own
    (a server works through its requests in order, and a copy's receiving half blocks it)."""

    @staticmethod
    def forward(ctx, devices, flat):
        ctx.devices = devices
        ctx.set_materialize_grads(False)  # a replica that did not use a parameter gives None
        return (flat.view_as(flat), *tree_broadcast(flat, devices)[1:])

    @staticmethod
    def backward(ctx, *grads):
        return None, tree_reduce(grads, ctx.devices)


def _by_dtype(named: list[tuple[str, torch.Tensor]]) -> dict[torch.dtype, list[tuple[str, torch.Tensor]]]:
    groups: dict[torch.dtype, list] = {}
    for name, t in named:
        groups.setdefault(t.dtype, []).append((name, t))
    return groups


def _unflatten(flat: torch.Tensor, group: list[tuple[str, torch.Tensor]], out: dict) -> None:
    for (name, t), piece in zip(group, flat.split([t.numel() for _, t in group])):
        out[name] = piece.view(t.shape)


def replicate(module: nn.Module, devices: Sequence[torch.device]) -> list[dict[str, torch.Tensor]]:
    """For each device, the module's tensors there by name, for functional_call:
    parameters that train through _Broadcast (differentiable) on every device; frozen
    parameters and buffers as plain copies on devices[1:], devices[0]'s replica using the
    module's own (a replica's buffer updates are dropped, as nn.DataParallel drops them)."""
    replicas: list[dict[str, torch.Tensor]] = [{} for _ in devices]
    trained = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    for group in _by_dtype(trained).values():
        flat = torch.cat([p.reshape(-1) for _, p in group])
        for replica, copy in zip(replicas, _Broadcast.apply(devices, flat)):
            _unflatten(copy, group, replica)
    # frozen parameters would make the flat tensor of trained ones compute their gradient
    plain = [(n, p) for n, p in module.named_parameters() if not p.requires_grad] + list(module.named_buffers())
    with torch.no_grad():
        for group in _by_dtype(plain).values():
            flat = torch.cat([b.reshape(-1) for _, b in group])
            for replica, copy in zip(replicas[1:], tree_broadcast(flat, devices)[1:]):
                _unflatten(copy, group, replica)
    return replicas


# -- DataParallel --------------------------------------------------------------------------------
class _After(torch.autograd.Function):
    """`t` itself, whose backward must run before `anchor`'s grad_fn may: it hands
    `anchor` no gradient, but autograd counts the edge, so the node that made `anchor`
    waits for this one. No byte moves and no server is asked: a view on the client."""

    @staticmethod
    def forward(ctx, t, anchor):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _backward_before(earlier_outputs: Any, replica: dict) -> None:
    """Make the next replica's backward run wholly before the previous one's starts.

    Autograd runs each device's part of a backward in that device's own thread, so two
    replicas' backwards run at once. For eager replicas that is fine (their nodes are
    C++); a torch.compile'd replica's backward is one Python node that torch runs inside
    the contextvars.Context backward() stashed for its device threads, and two of them at
    once fail ("cannot enter context"). Ordering them costs little: a backward here only
    queues work for its server, and the servers still compute at the same time.

    One of the replica's parameters passes through _After tied to the previous replica's
    output, so the previous replica's backward waits until this parameter's gradient,
    and with it this replica's whole backward, is done."""
    anchor = next((o for o in tree_leaves(earlier_outputs) if isinstance(o, torch.Tensor) and o.requires_grad),
                  None)
    name = next((n for n, v in replica.items() if v.requires_grad), None)
    if anchor is not None and name is not None:
        replica[name] = _After.apply(replica[name], anchor)


def _as_device(d) -> torch.device:
    return torch.device(DEVICE_TYPE, d) if isinstance(d, int) else torch.device(d)


class DataParallel(nn.Module):
    """nn.DataParallel over remote_accel servers: see the module's docstring.

    module: on devices[0] (its parameters and buffers). devices: remote_accel devices,
    default every server of the session. output_device: where outputs are gathered
    (default devices[0]; a CPU device downloads them). dim: the dimension the inputs are
    split along and the outputs joined along.
    """

    def __init__(self, module: nn.Module, devices=None, output_device=None, dim: int = 0):
        super().__init__()
        self.module = module
        self.devices = resolve_devices(devices)
        self.output_device = self.devices[0] if output_device is None else _as_device(output_device)
        self.dim = dim
        check_module_on(module, self.devices[0])
        check_alive(self.devices)

    def forward(self, *inputs, **kwargs):
        # Dynamo would trace into the device's own Python (the copies between servers):
        # torch.compile(DataParallel(m)) runs the forward eagerly instead. Only where
        # Dynamo is loaded already (nothing compiles otherwise): importing it takes a second.
        if "torch._dynamo" in sys.modules:
            return torch.compiler.disable(self._forward)(*inputs, **kwargs)
        return self._forward(*inputs, **kwargs)

    def _forward(self, *inputs, **kwargs):
        check_module_on(self.module, self.devices[0])
        pieces = scatter((inputs, kwargs), self.devices, self.dim)
        devices = self.devices[:len(pieces)]  # a batch smaller than the device list uses fewer
        replicas = replicate(self.module, devices)
        compiled = hasattr(self.module, "_orig_mod")  # torch.compile's OptimizedModule
        outputs = []
        for dev, tensors, (args, kw) in zip(devices, replicas, pieces):
            if compiled and outputs:
                _backward_before(outputs[-1], tensors)
            # the device guard, as nn.DataParallel's threads set theirs: a factory inside
            # forward without a device argument lands on the replica's server
            with torch.remote_accel.device(dev.index):
                outputs.append(functional_call(self.module, tensors, tuple(args), dict(kw)))
        return gather(outputs, self.output_device, self.dim)
