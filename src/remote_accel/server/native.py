"""The C++ executor (server/csrc/): the one module that imports it.

It holds a session's storage table, its plan templates and the failed-storage set, and
runs batches of planned ops with the GIL released; storage.py, executor.py and
session.py drive it. Its errors reach Python as the exceptions the Python path raises.
"""

from __future__ import annotations

import torch

from .._version import __version__
from ..errors import ProtocolError
from . import _native
from .failure import Failure

if _native.VERSION != __version__:
    raise ImportError(f"remote_accel.server._native was built for version {_native.VERSION}, "
                      f"this is {__version__}: reinstall remote_accel")

#: What batch items Executor.resume stopped at (csrc/native.h, Executor::Stop).
END, SLOW, ERROR = 0, 1, 2
#: Why FastLoop.run returned (csrc/fast_loop.h, FastLoop::Code).
LOOP_YIELD, LOOP_MESSAGE, LOOP_FAILED, LOOP_STOPPED = 0, 1, 2, 3

_TYPES = {
    "RuntimeError": RuntimeError, "IndexError": IndexError, "ValueError": ValueError, "TypeError": TypeError,
    "NotImplementedError": NotImplementedError, "MemoryError": MemoryError,
    "OutOfMemoryError": torch.OutOfMemoryError, "LinAlgError": torch.linalg.LinAlgError,
}


def to_exception(kind: str, type_name: str, message: str, op: str) -> BaseException:
    """An error of the C++ side as the exception the Python path would have raised."""
    if kind == "protocol":
        return ProtocolError(message)
    if kind != "exception":
        return Failure(kind, message)
    exc = _TYPES.get(type_name, RuntimeError)(message)
    if op:
        exc.add_note(f"in {op}")
    return exc


_native.set_error_factory(to_exception)

Executor = _native.Executor
FastLoop = _native.FastLoop
DpdkLink = _native.DpdkLink
TcpLink = _native.TcpLink
TlsLink = _native.TlsLink
Pool = _native.Pool
lock_default_generator = _native.lock_default_generator
unlock_default_generator = _native.unlock_default_generator
parse_read = _native.parse_read
read_small = _native.read_small
install_cpu_bernoulli = _native.install_cpu_bernoulli
cpu_bernoulli_installed = _native.cpu_bernoulli_installed
cpu_bernoulli_ = _native.cpu_bernoulli_  # the kernel itself, installed or not (tests)
keep_freed_heap = _native.keep_freed_heap
