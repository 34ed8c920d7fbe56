"""Structured failures: what a request did wrong, as the `kind` an ErrorReply carries."""

from __future__ import annotations

import traceback

import torch

from ..dataplane import messages as m
from ..errors import ProtocolError

# The kinds a client may see (messages.ErrorReply.kind).
OP = "op"
OOM = "oom"
AUTH = "auth"
PROTOCOL = "protocol"
UNKNOWN_OP = "unknown_op"
BAD_HANDLE = "bad_handle"
BUSY = "busy"
#: A client that named the server it meant (HELLO.server) reached another one: over DPDK,
#: whichever server is behind the port (handshake.answers_to)
WRONG_SERVER = "wrong_server"
#: The device itself failed (a CUDA device-side assert, an illegal address): every
#: session's tensors are gone and the server process exits (status EXIT_DEVICE_LOST).
DEVICE_LOST = "device_lost"

#: The server's exit status after its device was lost, so a supervisor restarts it.
EXIT_DEVICE_LOST = 3


class Failure(Exception):
    """A request the server refuses, with the ErrorReply kind to report it under."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def bad_handle(message: str) -> Failure:
    return Failure(BAD_HANDLE, message)


def oom(message: str) -> Failure:
    return Failure(OOM, message)


# The CPU allocator reports exhaustion as a plain RuntimeError (c10::Error), not as
# torch.OutOfMemoryError; these fragments of its message identify it.
_CPU_OOM_TEXT = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")


def classify(exc: BaseException) -> str:
    """The ErrorReply kind for an exception raised while serving a request."""
    if isinstance(exc, Failure):
        return exc.kind
    if isinstance(exc, ProtocolError):
        return PROTOCOL
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return OOM
    if isinstance(exc, RuntimeError) and any(t in str(exc) for t in _CPU_OOM_TEXT):
        return OOM
    return OP


def error_reply(exc: BaseException, max_message: int, max_trace: int) -> m.ErrorReply:
    """The ErrorReply that reports `exc`, its texts clipped to the limits given."""
    kind = classify(exc)
    text = f"{type(exc).__name__}: {exc}" if kind == OP else str(exc)
    notes = getattr(exc, "__notes__", None)
    if notes:
        text += " (" + "; ".join(notes) + ")"
    trace = "" if isinstance(exc, (Failure, ProtocolError)) else "".join(traceback.format_exception(exc))
    return m.ErrorReply(kind, clip(text, max_message), clip(trace, max_trace))


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 20] + " ...[truncated]"
