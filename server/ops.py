"""Which callables an op name from the wire may reach: torch.ops.aten, and a short table.

A name is checked against a strict pattern before any lookup, must resolve to a real
OpOverload registered with the dispatcher (JIT-only builtins such as aten::save are not),
and must not be on the deny list. Nothing else is ever looked up by name.
"""

from __future__ import annotations

import re
from typing import Callable, Optional

import torch

from .failure import UNKNOWN_OP, Failure

_NAME = re.compile(r"aten::([A-Za-z_][A-Za-z0-9_]{0,127})(?:\.([A-Za-z_][A-Za-z0-9_]{0,63}))?\Z")

#: Ops that reach outside the tensor world (the server's files, its stdout) or that
#: raise device-side asserts, which on CUDA poison the context of every session.
DENIED = frozenset({"from_file", "_print"})


# -- substitutes: ops a client may send that the server runs another way -------------------
def _convolution_backward_overrideable(grad_output, input, weight, stride, padding, dilation, transposed,
                                       output_padding, groups, output_mask):
    # The PrivateUse1 backward has no bias_sizes; the generic kernel needs it only for grad_bias.
    channels = weight.shape[1] * groups if transposed else weight.shape[0]
    return torch.ops.aten.convolution_backward.default(
        grad_output, input, weight, [channels], stride, padding, dilation, transposed, output_padding,
        groups, output_mask)


def _copy_from(self, dst, non_blocking=False):
    return dst.copy_(self, non_blocking)


def _copy_from_and_resize(self, dst):
    dst.resize_(self.shape)
    return dst.copy_(self)


def _assert_async(self, assert_msg="Expected Tensor with single nonzero value, but got zero"):
    # Checked on the host: the CUDA kernel would fail with a device-side assert instead.
    if not bool(self):
        raise RuntimeError(assert_msg)


def _efficientzerotensor(size, *, dtype=None, layout=None, device=None, pin_memory=None):
    # Autograd formulas (sgn's, for one) make these for gradients known to be zero. A
    # ZeroTensor has no storage to keep under the client's storage id, and the client's
    # tensor for it is an ordinary one: real zeros are what it stands for.
    return torch.zeros(size, dtype=dtype, layout=layout, device=device, pin_memory=pin_memory)


SUBSTITUTES: dict[str, Callable] = {
    "aten::convolution_overrideable": torch.ops.aten.convolution.default,
    "aten::convolution_overrideable.default": torch.ops.aten.convolution.default,
    "aten::convolution_backward_overrideable": _convolution_backward_overrideable,
    "aten::convolution_backward_overrideable.default": _convolution_backward_overrideable,
    "aten::_copy_from": _copy_from,
    "aten::_copy_from.default": _copy_from,
    "aten::_copy_from_and_resize": _copy_from_and_resize,
    "aten::_copy_from_and_resize.default": _copy_from_and_resize,
    "aten::_assert_async": _assert_async,
    "aten::_assert_async.default": _assert_async,
    "aten::_assert_async.msg": _assert_async,
    "aten::_efficientzerotensor": _efficientzerotensor,
    "aten::_efficientzerotensor.default": _efficientzerotensor,
}


class Resolved:
    """An op ready to call, with what the executor needs to know about its schema."""

    __slots__ = ("name", "fn", "generator_index", "seeded")

    def __init__(self, name: str, fn: Callable, schema: Optional[torch.FunctionSchema]):
        self.name = name
        self.fn = fn
        #: position of a `Generator? generator` argument, or None
        self.generator_index = None
        #: draws from the default generator without taking one as an argument (dropout)
        self.seeded = False
        if schema is not None:
            for i, arg in enumerate(schema.arguments):
                if arg.name == "generator" and "Generator" in str(arg.type):
                    self.generator_index = i
            tags = getattr(fn, "tags", ())
            self.seeded = self.generator_index is None and torch.Tag.nondeterministic_seeded in tags


_cache: dict[str, Resolved] = {}
_CACHE_MAX = 8192


def _unknown(name: str, why: str) -> Failure:
    return Failure(UNKNOWN_OP, f"op {name[:200]!r} {why}")


def resolve(name) -> Resolved:
    """Op name from the wire -> Resolved; Failure(unknown_op) for anything else."""
    if type(name) is not str:
        raise _unknown(repr(name), "is not a string")
    hit = _cache.get(name)
    if hit is not None:
        return hit
    match = _NAME.match(name)
    if match is None:
        raise _unknown(name, "is not an aten op name (expected aten::name or aten::name.overload)")
    if name in SUBSTITUTES:
        resolved = Resolved(name, SUBSTITUTES[name], None)
    else:
        op_name, overload = match.group(1), match.group(2) or "default"
        if op_name in DENIED:
            raise _unknown(name, "is not allowed on this server")
        try:
            packet = getattr(torch.ops.aten, op_name)
        except (AttributeError, RuntimeError):
            raise _unknown(name, "does not exist in torch.ops.aten") from None
        if not isinstance(packet, torch._ops.OpOverloadPacket) or overload not in packet.overloads():
            raise _unknown(name, "does not exist in torch.ops.aten")
        op = getattr(packet, overload)
        try:
            torch._C._dispatch_find_schema_or_throw(f"aten::{op_name}", "" if overload == "default" else overload)
        except RuntimeError:
            raise _unknown(name, "is not a dispatcher op") from None
        resolved = Resolved(name, op, op._schema)
    if len(_cache) < _CACHE_MAX:
        _cache[name] = resolved
    return resolved
