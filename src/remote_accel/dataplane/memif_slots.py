"""memif client slots of a local DPDK server: which interface id a local client takes.

memif is point to point: a server has one memif interface (one DPDK port) per client
slot on its socket, and each local client must take an id no other client holds. The
server publishes its slots in one file next to the socket (`memif.sock.slots`, plain
text); a client takes slot i with an open-file-description lock on one byte of that
file, held for the life of its process (its EAL's memif vdev is fixed for that long).
The kernel drops the lock the moment the process exits or is killed, so the slot is
free again at once and no per-client file is ever left behind. The server removes the
file when it stops; a server started after a killed one rewrites it in place (clients
still holding locks on it keep them).

Slots per server: min(--max-clients, MAX_SLOTS). MAX_SLOTS is DPDK's port limit per
process (RTE_MAX_ETHPORTS is 32 in Debian's 22.11 build): more local clients than that
cannot have a memif interface each, and use TCP ("auto" falls back by itself).
"""

from __future__ import annotations

import errno
import fcntl
import glob
import os
import struct
from typing import Optional

from ..errors import ConfigError

MAX_SLOTS = 32
#: Slots of a listener made without a --max-clients (tools, tests): few, so that ports
#: remain for other devices in that process.
DEFAULT_SLOTS = 4
#: Locked bytes start past the text, so that rewriting the text never touches them.
_LOCK_BASE = 1 << 16
_FORMAT = "remote_accel memif slots v1"

_held: dict[str, tuple[int, int]] = {}  # socket path -> (fd, slot) of this process


class MemifSlotsFull(ConfigError):
    """Every memif client slot of the local server is held by a live client."""


def slots_path(sock_path: str) -> str:
    return sock_path + ".slots"


def slots_for(max_clients: int) -> int:
    """memif interfaces a server with this --max-clients creates."""
    return max(1, min(max_clients, MAX_SLOTS))


def _flock(slot: int, kind: int) -> bytes:
    # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)
    return struct.pack("hhqqi", kind, os.SEEK_SET, _LOCK_BASE + slot, 1, 0)


def _try_lock(fd: int, slot: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(slot, fcntl.F_WRLCK))
        return True
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def held_slots(sock_path: str) -> list[int]:
    """Slots that some process holds now (for tests and diagnostics)."""
    info = read_slots(sock_path)
    if info is None:
        return []
    fd = os.open(slots_path(sock_path), os.O_RDWR)
    try:
        out = []
        for i in range(info["slots"]):
            res = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(i, fcntl.F_WRLCK))
            if struct.unpack("hhqqi", res[:struct.calcsize("hhqqi")])[0] != fcntl.F_UNLCK:
                out.append(i)
        return out
    finally:
        os.close(fd)


def publish(sock_path: str, slots: int, limited_by: str) -> str:
    """Server: say how many slots listen on this socket. `limited_by` is "max_clients"
    or "ports": what a client that finds them all taken is told to change."""
    path = slots_path(sock_path)
    text = f"{_FORMAT}\nslots={slots}\nlimited_by={limited_by}\npid={os.getpid()}\n".encode()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 0)  # in place: locks held on the old contents stay valid
        os.write(fd, text)
    finally:
        os.close(fd)
    for legacy in glob.glob(glob.escape(sock_path) + ".id*.lock"):
        try:  # per-id lock files of older versions
            os.unlink(legacy)
        except OSError:
            pass
    return path


def unpublish(sock_path: str) -> None:
    try:
        os.unlink(slots_path(sock_path))
    except FileNotFoundError:
        pass


def read_slots(sock_path: str) -> Optional[dict]:
    """{"slots": N, "limited_by": ...} of the server on this socket, None without one."""
    try:
        with open(slots_path(sock_path), encoding="ascii") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    if not lines or lines[0] != _FORMAT:
        return None
    fields = dict(line.split("=", 1) for line in lines[1:] if "=" in line)
    try:
        slots = int(fields["slots"])
    except (KeyError, ValueError):
        return None
    return {"slots": slots, "limited_by": fields.get("limited_by", "max_clients")}


def claim(sock_path: str) -> int:
    """Client: the memif interface id to use on `sock_path`, held until this process
    ends. Without a slots file (no server yet) id 0, unheld: connect then reports that
    no server answered. Raises MemifSlotsFull when live clients hold every slot."""
    if sock_path in _held:
        return _held[sock_path][1]  # one EAL per process: it keeps its slot
    info = read_slots(sock_path)
    if info is None:
        return 0
    try:
        fd = os.open(slots_path(sock_path), os.O_RDWR)
    except OSError:
        return 0  # the server stopped meanwhile
    n = info["slots"]
    for i in range(n):
        if _try_lock(fd, i):
            _held[sock_path] = (fd, i)
            return i
    os.close(fd)
    # Both limits, always: which one a user can raise depends on which one was hit.
    if info["limited_by"] == "ports":
        hint = (f"{n} memif slots is the most a server has: DPDK's limit of ports per process "
                f"(RTE_MAX_ETHPORTS {MAX_SLOTS}), so raising the server's --max-clients gives no more; "
                "more local clients can use transport='tcp' (transport='auto' does so by itself)")
    else:
        hint = (f"start the server with a larger --max-clients (now {n}); a server has at most "
                f"{MAX_SLOTS} memif slots, DPDK's limit of ports per process (RTE_MAX_ETHPORTS), and more "
                "local clients than that use transport='tcp'")
    raise MemifSlotsFull(f"the DPDK server on {sock_path} is full: all {n} memif client slots are "
                         f"taken by live local clients; {hint}")


def release(sock_path: str) -> None:
    """Give this process's slot back (tests; a process's EAL keeps its vdev otherwise)."""
    fd, _ = _held.pop(sock_path, (None, None))
    if fd is not None:
        os.close(fd)
