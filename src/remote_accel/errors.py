"""Exceptions raised by remote_accel.

Every exception derives from RemoteAccelError (itself a RuntimeError, like torch's own
device errors) and also from the matching builtin, so callers can catch either.
"""


class RemoteAccelError(RuntimeError):
    """Base of every error raised by remote_accel."""


class UnavailableError(RemoteAccelError, ImportError):
    """An optional feature (DPDK, the C++ device extension) is not built or not installed."""


class ConfigError(RemoteAccelError, ValueError):
    """An argument, option or environment variable has an invalid value."""


class TransportError(RemoteAccelError, ConnectionError):
    """The transport cannot carry messages any more."""


class TransportClosed(TransportError):
    """This side closed the transport; no further send or receive is possible."""


class PeerGone(TransportError):
    """The peer closed the connection, died, or stopped answering."""


class PeerSilent(PeerGone):
    """The transport gave the peer up after its own silence limit, with nothing saying that
    the peer went away (no close, no reset, the link still up): a frozen or hung peer, or a
    path cut without a reset, which a new connection would not reach either. DPDK's channel
    raises it; over TCP the same silence ends a client's wait as its `timeout`."""


class TransportTimeout(RemoteAccelError, TimeoutError):
    """Nothing arrived within the allowed time; the transport is still usable."""


class ProtocolError(RemoteAccelError, ValueError):
    """Bytes that do not form a valid message: bad magic, version, checksum or length."""


class MessageTooLarge(ProtocolError):
    """A length field is beyond the configured limits (checked before any allocation)."""


class DpdkError(RemoteAccelError, OSError):
    """A DPDK call failed; errno and the operation are in the message."""


class AuthError(RemoteAccelError, PermissionError):
    """Authentication failed: the server refused the client's token (or, with mutual TLS,
    its certificate), or the client refused a server that could not prove it holds the
    token or has no valid certificate for its name."""


class RemoteOpError(RemoteAccelError):
    """An operation failed on the server; the server's traceback is attached as a note."""


class DeadlineExceeded(RemoteAccelError, TimeoutError):
    """A sync given a deadline did not finish in time; the server goes on, the session too."""


class WrongPeerError(RemoteAccelError, ConnectionError):
    """The address answers, but not as a remote_accel server (a silent listener, HTTP, SSH...)."""


def __getattr__(name):
    # RemoteOutOfMemoryError is a torch.OutOfMemoryError, so that `except
    # torch.OutOfMemoryError` catches it as on CUDA; made on first use, so that importing
    # the errors does not import torch (the tools and the data plane do without it).
    if name == "RemoteOutOfMemoryError":
        import torch

        global RemoteOutOfMemoryError

        class RemoteOutOfMemoryError(RemoteAccelError, torch.OutOfMemoryError, MemoryError):
            """The server refused an allocation: its memory limit or the device is full."""

        RemoteOutOfMemoryError.__module__ = __name__
        return RemoteOutOfMemoryError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
