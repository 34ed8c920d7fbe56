"""Which callables an op name from the wire may reach: torch.ops.aten, the ops of the
libraries the server's configuration enables (torchvision::nms, ...), and a short table.

A name is checked against a strict pattern before any lookup, must name an enabled
namespace, must resolve to a real OpOverload registered with the dispatcher (JIT-only
builtins such as aten::save are not), and must not be on the deny list. Nothing is ever
imported or looked up by a name from the wire: libraries are imported at start-up, from
the server's own configuration (enable_namespaces).

An op that has no kernel for the server's device (the CUDA-only fused RNN cells on a CPU
server) resolves to its decomposition (decompositions.py), per the device type the
server's executors run on (use_device_type).
"""

from __future__ import annotations

import importlib
import logging
import re
from typing import Callable, Optional

import torch

from ..errors import ConfigError
from . import decompositions, sparse_checks
from .failure import UNKNOWN_OP, Failure

log = logging.getLogger(__name__)

_IDENT = r"[A-Za-z_][A-Za-z0-9_]{0,63}"
_NAME = re.compile(rf"({_IDENT})::([A-Za-z_][A-Za-z0-9_]{{0,127}})(?:\.({_IDENT}))?\Z")
NAMESPACE = re.compile(rf"{_IDENT}\Z")
MODULE = re.compile(rf"{_IDENT}(?:\.{_IDENT})*\Z")

#: Ops that reach outside the tensor world (the server's files, its stdout) or that
#: raise device-side asserts, which on CUDA poison the context of every session.
DENIED = frozenset({"aten::from_file", "aten::_print"})

#: Libraries whose ops a server serves by default, when they import there: namespace ->
#: the module whose import registers its ops.
DEFAULT_NAMESPACES = {"torchvision": "torchvision"}

_enabled: set[str] = {"aten"}
#: the server's device type: which ops lack a kernel there and run a decomposition instead
_device_type = "cpu"
#: namespace -> why this server does not serve it (its library did not import)
_unavailable: dict[str, str] = {}


def enable_namespaces(namespaces: Optional[dict[str, str]]) -> list[str]:
    """Serve the ops of these libraries (namespace -> module to import) besides aten.

    None: DEFAULT_NAMESPACES, each where it imports (one that does not is logged, and its
    ops fail with a message that says so). Named explicitly, a library that does not
    import raises ConfigError: the operator asked for it. Returns the namespaces served.
    """
    explicit = namespaces is not None
    _enabled.intersection_update({"aten"})
    _unavailable.clear()
    _cache.clear()
    for namespace, module in (DEFAULT_NAMESPACES if namespaces is None else namespaces).items():
        if namespace == "aten":
            continue
        try:
            importlib.import_module(module)
        except Exception as exc:  # an ImportError, or a library that fails beside this torch
            why = f"importing {module} failed: {type(exc).__name__}: {exc}"
            if explicit:
                raise ConfigError(f"op namespace {namespace!r}: {why}") from None
            log.info("not serving %s:: ops: %s", namespace, why)
            _unavailable[namespace] = why
            continue
        _enabled.add(namespace)
    return sorted(_enabled)


def namespaces() -> list[str]:
    """The op namespaces this server serves."""
    return sorted(_enabled)


def use_device_type(device_type: str) -> None:
    """Resolve ops for a server whose tensors live on `device_type` ("cpu", "cuda", ...).

    A server has one device, so this is set once per process (each Executor sets it, with
    the same value); a change re-resolves every name."""
    global _device_type
    if device_type != _device_type:
        _device_type = device_type
        _cache.clear()


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
    **sparse_checks.SUBSTITUTES,
}


class Resolved:
    """An op ready to call, with what the executor needs to know about its schema."""

    __slots__ = ("name", "fn", "schema", "decomposed", "generator_index", "seeded")

    def __init__(self, name: str, fn: Callable, schema: Optional[torch.FunctionSchema], tags: tuple = (),
                 decomposed: bool = False):
        self.name = name
        self.fn = fn
        #: the schema of the op the client named, which fn (a decomposition) may not carry
        self.schema = schema
        #: fn is the op's decomposition (the device has no kernel for it)
        self.decomposed = decomposed
        #: position of a `Generator? generator` argument, or None
        self.generator_index = None
        #: draws from the default generator without taking one as an argument (dropout)
        self.seeded = False
        if schema is not None:
            for i, arg in enumerate(schema.arguments):
                if arg.name == "generator" and "Generator" in str(arg.type):
                    self.generator_index = i
            tags = tags or getattr(fn, "tags", ())
            self.seeded = self.generator_index is None and torch.Tag.nondeterministic_seeded in tags


_cache: dict[str, Resolved] = {}
_CACHE_MAX = 8192


def _unknown(name: str, why: str) -> Failure:
    return Failure(UNKNOWN_OP, f"op {name[:200]!r} {why}")


def _not_served(namespace: str) -> str:
    why = _unavailable.get(namespace)
    if why is not None:
        return (f"needs {namespace} on the server, which cannot load it ({why[:300]}): "
                f"install {namespace} where the server runs")
    return (f"is in namespace {namespace!r}, which this server does not serve (it serves "
            f"{', '.join(namespaces())}): start it with --op-namespaces {namespace} to allow its ops")


def resolve(name) -> Resolved:
    """Op name from the wire -> Resolved; Failure(unknown_op) for anything else."""
    if type(name) is not str:
        raise _unknown(repr(name), "is not a string")
    hit = _cache.get(name)
    if hit is not None:
        return hit
    match = _NAME.match(name)
    if match is None:
        raise _unknown(name, "is not an op name (expected namespace::name or namespace::name.overload)")
    namespace, op_name, overload = match.group(1), match.group(2), match.group(3) or "default"
    if namespace not in _enabled:
        raise _unknown(name, _not_served(namespace))
    if name in SUBSTITUTES:
        resolved = Resolved(name, SUBSTITUTES[name], None)
    else:
        if f"{namespace}::{op_name}" in DENIED:
            raise _unknown(name, "is not allowed on this server")
        try:
            # only an enabled namespace's object is ever asked for an attribute
            packet = getattr(getattr(torch.ops, namespace), op_name)
        except (AttributeError, RuntimeError):
            raise _unknown(name, f"does not exist in torch.ops.{namespace}") from None
        if not isinstance(packet, torch._ops.OpOverloadPacket) or overload not in packet.overloads():
            raise _unknown(name, f"does not exist in torch.ops.{namespace}")
        op = getattr(packet, overload)
        try:
            torch._C._dispatch_find_schema_or_throw(f"{namespace}::{op_name}", "" if overload == "default" else overload)
        except RuntimeError:
            raise _unknown(name, "is not a dispatcher op") from None
        decomposition = decompositions.for_device(op, _device_type)
        if decomposition is None:
            resolved = Resolved(name, op, op._schema)
        else:
            resolved = Resolved(name, decomposition, op._schema, tuple(op.tags), decomposed=True)
    if len(_cache) < _CACHE_MAX:
        _cache[name] = resolved
    return resolved
