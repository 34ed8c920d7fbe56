"""EAL command lines for the DPDK transport: defaults, merging with the user's, and
what a port's vdev arguments say about its frame size. Pure Python (no DPDK needed).

Defaults, and why:
- `--no-pci`: otherwise EAL probes (and may grab) the machine's own NIC.
- a unique `--file-prefix` per process: two EALs on one host must not share files.
- `--in-memory` where hugepages are free, else `--no-huge -m 1024` (IOVA as VA); the
  two are mutually exclusive.
- `--lcores 0@(0,1)`: EAL pins the calling thread (Python's main thread) to its main
  lcore; letting lcore 0 float over both CPUs keeps Python's threads unpinned.
- a memif vdev on `config.default_memif_socket()`: role=server with one interface per
  client slot (memif is point-to-point; the server sizes them from --max-clients),
  role=client on the first slot no other local client holds (memif_slots.py).
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
from typing import Iterable, Optional, Sequence

from .. import config
from ..errors import ConfigError
from . import memif_slots

#: memif buffer size: one frame per buffer, never chained (memif 22.11 loses and
#: duplicates frames spread over several buffers). A frame's chunk is bsize less the
#: FRAME_OVERHEAD of dpdk_shim/wire/wire.h (Ethernet, IPv4, UDP, frame header).
#: REMOTE_ACCEL_MEMIF_BSIZE overrides it (both ends should agree; they use the smaller).
MEMIF_BSIZE = config.whole_number("REMOTE_ACCEL_MEMIF_BSIZE")
NO_HUGE_MEMORY_MB = 1024
MIN_FREE_HUGEPAGE_MB = 512
RING_PAIR_MAX_FRAME = 16384  # same mbuf pool as memif

_prefix_counter = itertools.count()


def memif_rsize(bsize: int) -> int:
    """log2 of the memif ring: REMOTE_ACCEL_MEMIF_RING_MB of buffers each way, 256-4096
    buffers. The client's choice is the connection's (a memif server takes the client's
    ring). Big by default: a slot is written again only after the whole ring went round,
    so a ring larger than the last-level cache streams through memory at one steady pace.
    A ring that fits the cache measured fastest while the two processes shared one, and
    slowest (down to a fifth) while they did not, which moves from run to run on a VM
    (docs/design/bulk-transfers.md)."""
    ring_bytes = config.whole_number("REMOTE_ACCEL_MEMIF_RING_MB") << 20
    return max(8, min(12, (ring_bytes // bsize).bit_length() - 1))


def hugepages_free_mb() -> int:
    """Free hugepage memory (MiB) of the default size, 0 when there is none."""
    free = size_kb = 0
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("HugePages_Free:"):
                    free = int(line.split()[1])
                elif line.startswith("Hugepagesize:"):
                    size_kb = int(line.split()[1])
    except OSError:
        return 0
    return free * size_kb // 1024


def split_args(args) -> list[str]:
    """A list as is; a string split like a shell would (for environment variables)."""
    if args is None:
        return []
    if isinstance(args, str):
        return shlex.split(args)
    return [str(a) for a in args]


def _listening_unix_sockets() -> set[str]:
    """Names of the listening Unix sockets of this network namespace ("@name" for the
    abstract ones), from /proc/net/unix."""
    out = set()
    try:
        with open("/proc/net/unix", encoding="utf-8", errors="replace") as f:
            next(f, None)
            for line in f:
                fields = line.split()
                if len(fields) >= 8 and int(fields[3], 16) & 0x10000:  # __SO_ACCEPTCON
                    out.add(fields[7])
    except (OSError, ValueError):
        pass
    return out


def memif_socket_in_use(path: str) -> bool:
    """True if a server listens on this memif socket; a stale file is removed.

    Read from /proc/net/unix, never by connecting: a connection to a memif server's
    control socket that says nothing and closes can make DPDK 22.11's interrupt thread
    panic (epoll_ctl on a closed fd) in the server once clients come and go. memif puts
    its socket in the abstract namespace by default (socket-abstract=yes: no file, and
    nothing left when the server dies); with socket-abstract=no it is a file."""
    listening = _listening_unix_sockets()
    if "@" + path in listening or path in listening:
        return True
    if os.path.exists(path):
        try:
            os.unlink(path)  # left behind by a server that died
        except OSError:
            pass
    return False


def memif_vdev(index: int, role: str, if_id: int, sock_path: str, bsize: int = 0) -> str:
    bsize = bsize or MEMIF_BSIZE
    return (f"--vdev=net_memif{index},role={role},id={if_id},socket={sock_path},"
            f"bsize={bsize},rsize={memif_rsize(bsize)}")


def default_eal_args(role: str = "client", *, socket_path: Optional[str] = None,
                     slots: int = memif_slots.DEFAULT_SLOTS, hugepages: Optional[bool] = None,
                     lcores: str = "0@(0,1)", memif: bool = True) -> list[str]:
    """EAL arguments for a `role` of "client", "server" or "local" (no vdev: ring pairs).

    slots: memif interfaces of a server (clients read the server's count).
    hugepages: None to decide by /proc/meminfo. Raises ConfigError when a server
    already listens on the socket (role server), memif_slots.MemifSlotsFull when live
    local clients hold every slot of the server (client).
    """
    if role not in ("client", "server", "local"):
        raise ConfigError(f"EAL role must be client, server or local, not {role!r}")
    if hugepages is None:
        hugepages = hugepages_free_mb() >= MIN_FREE_HUGEPAGE_MB
    args = ["remote_accel", "--no-pci", "--no-telemetry", f"--lcores={lcores}",
            f"--file-prefix=ra{os.getpid()}_{next(_prefix_counter)}", "--log-level=*:warning"]
    args += ["--in-memory"] if hugepages else ["--no-huge", "-m", str(NO_HUGE_MEMORY_MB)]
    if memif and role != "local":
        sock_path = socket_path or config.default_memif_socket()
        if role == "server":
            if memif_socket_in_use(sock_path):
                raise ConfigError(f"another server already listens on memif socket {sock_path}")
            if not 1 <= slots <= memif_slots.MAX_SLOTS:
                raise ConfigError(f"memif slots must be 1..{memif_slots.MAX_SLOTS}, not {slots}")
            args += [memif_vdev(i, "server", i, sock_path) for i in range(slots)]
        else:
            args.append(memif_vdev(0, "client", memif_slots.claim(sock_path), sock_path))
    return args


# -- merging: the user's arguments replace the defaults they conflict with ------------
_MEMORY = ("--no-huge", "--in-memory", "-m", "--socket-mem", "--huge-dir", "--legacy-mem",
           "--single-file-segments", "--iova-mode")
_DEVICES = ("--vdev", "-a", "--allow", "-b", "--block", "--pci-whitelist", "--pci-blacklist")
_TAKES_VALUE = {"-m", "--socket-mem", "--huge-dir", "--iova-mode", "--vdev", "-a", "--allow", "-b",
                "--block", "-l", "-c", "--lcores", "--file-prefix", "--log-level", "-d", "-n",
                "--proc-type", "--main-lcore", "--base-virtaddr"}


def _options(args: Sequence[str]) -> list[tuple[str, Optional[str]]]:
    """(option, value) pairs; '--opt=v' and '--opt v' both give ('--opt', 'v')."""
    out, it = [], iter(args)
    for a in it:
        if a.startswith("--") and "=" in a:
            k, v = a.split("=", 1)
            out.append((k, v))
        elif a in _TAKES_VALUE:
            out.append((a, next(it, None)))
        else:
            out.append((a, None))
    return out


def _join(pairs: Iterable[tuple[str, Optional[str]]]) -> list[str]:
    out = []
    for k, v in pairs:
        if v is None:
            out.append(k)
        elif k.startswith("--"):
            out.append(f"{k}={v}")
        else:
            out += [k, v]
    return out


def merge_eal_args(defaults: Sequence[str], user: Sequence[str]) -> list[str]:
    """Defaults with the user's EAL options on top: a user device (vdev, PCI address)
    replaces the default memif vdev(s) and --no-pci where it names a PCI device; a
    memory option replaces the memory defaults; --file-prefix, --lcores/-l/-c replace ours.
    """
    user = [u for u in user if u]
    if user and not user[0].startswith("-"):
        user = user[1:]  # a program name
    upairs = _options(user)
    ukeys = {k for k, _ in upairs}
    drop: set[str] = set()
    if ukeys & set(_DEVICES):
        drop.add("--vdev")
    if ukeys & {"-a", "--allow", "--pci-whitelist"}:
        drop.add("--no-pci")
    if ukeys & set(_MEMORY):
        drop.update(_MEMORY)
    if ukeys & {"-l", "-c", "--lcores"}:
        drop.update({"-l", "-c", "--lcores"})
    if "--file-prefix" in ukeys:
        drop.add("--file-prefix")
    base = _options(defaults[1:])
    kept = [(k, v) for k, v in base if k not in drop]
    return [defaults[0] if defaults else "remote_accel"] + _join(kept) + _join(upairs)


def vdev_options(args: Sequence[str]) -> dict[str, dict[str, str]]:
    """{device name: {key: value}} of every --vdev in args."""
    out = {}
    for k, v in _options(args[1:] if args and not args[0].startswith("-") else args):
        if k == "--vdev" and v:
            name, *kvs = v.split(",")
            out[name] = dict(kv.split("=", 1) if "=" in kv else (kv, "") for kv in kvs)
    return out


def _iface_mtu(iface: str) -> int:
    try:
        with open(f"/sys/class/net/{iface}/mtu", encoding="ascii") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1500


def port_frame_sizes(name: str, driver: str, args: Sequence[str]) -> tuple[int, int]:
    """(largest frame a port carries, mbuf data room its PMD needs), from its vdev args:
    memif: bsize (one frame per buffer); af_packet: the interface MTU within framesz
    (and mbufs that hold a whole framesz); ring pairs: large; anything else (a NIC,
    tap): a standard frame."""
    opts = vdev_options(args).get(name, {})
    if driver == "net_memif":
        return int(opts.get("bsize", 2048)), 0
    if driver == "net_af_packet":
        framesz = int(opts.get("framesz", 2048))
        return min(_iface_mtu(opts.get("iface", "")) + 14, framesz - 96), framesz
    if driver == "net_ring":
        return RING_PAIR_MAX_FRAME, 0
    return (9000 if re.match(r"^net_null", driver) else 1514), 0


def split_eal(argv: Sequence[str]) -> tuple[list, list]:
    """DPDK's command-line convention: `[EAL options] -- [app options]`; without `--`,
    every argument is an app option."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return [], argv
