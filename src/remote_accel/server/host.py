"""What a session and its server know of each other, written down as two small interfaces.

A session (session.py) is run by a `Host` (service.Server is the one): it reads the
host's settings and reports its own life (admitted, removed, device lost); it never
reaches into the host's tables. The handshake (auth.py) sees the session as a `Guest`.
Both sides import this module, and neither imports the other.
"""

from __future__ import annotations

from typing import Optional, Protocol

from ..dataplane.transport import Transport
from .device import ComputeDevice
from .graphs import GraphCompiler
from .groups import Groups


class Host(Protocol):
    # settings, fixed when the server starts
    device: ComputeDevice
    token: str
    memory_limit: int  # as configured (0: the device's own), told to clients
    session_limit: int  # the bytes one session may hold
    max_clients: int
    heartbeat_timeout: float
    graphs: GraphCompiler  # compiled graphs, shared by every session
    groups: "Groups"  # process groups' members on this server (groups.py)
    stopping: bool

    def admit(self, session: Guest) -> bool:
        """Count an authenticated session; False when max_clients are already served."""

    def handshake_over(self, session: Guest) -> None:
        """The session authenticated or was refused: it holds no handshake slot any more."""

    def remove(self, session: Guest) -> None:
        """The session ended (its thread is about to return)."""

    def stats(self) -> dict:
        """Server-wide figures, added to each session's STATS reply."""

    def device_lost(self, exc: BaseException) -> str:
        """Record that the device is unusable; returns what clients are told."""

    def exit_if_device_lost(self) -> None:
        """End the process at once once the device is lost."""


class Guest(Protocol):
    """A session during its handshake."""

    server: Host
    transport: Transport
    number: int
    device: ComputeDevice
    client: str  # what the client's HELLO calls it
    admitted: bool
    copy_grant: Optional[tuple]  # a source server's session: the copy it may write now
    copy_binding: bytes  # its WELCOME proof, over which later copies prove their keys
    group_grant: Optional[tuple]  # a peer server's process-group connection: (group, its rank, rank here)
