"""How many CPU threads the server's kernels use (torch's intra-op threads).

Chosen before torch loads: OpenMP reads OMP_NUM_THREADS once, as every thread's default,
the session threads included (`torch.set_num_threads` changes only the calling thread
and threads that later start an ATen parallel loop; MKL's GEMMs in a session thread
could still use the old count).

The default is one core fewer than this process may run on (at most one thread per
physical core, as torch's own default). The server waits passively between kernels
(OMP_WAIT_POLICY=PASSIVE, __main__.py), so every parallel region has to wake sleeping
pool threads; when one of the cores is busy with something else (the server's own
transport threads, or its clients on the same host: memif, loopback TCP), a woken thread
waits for that core too. On 2 shared cores the tiny Transformer's compiled training step
took 10.4-11.0 ms with the kernels on 2 threads and 6.5-6.8 ms on 1 (README, "The
server's CPU threads"). On a large dedicated host the default gives up one core of many.
"""

from __future__ import annotations

import os
from typing import Optional

#: The environment variable OpenMP (and so torch and MKL) reads its thread count from.
OMP_NUM_THREADS = "OMP_NUM_THREADS"


def usable_cpus() -> set:
    """The CPUs this process may run on (its affinity, as `taskset` or a cgroup set it)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def physical_cores(cpus: set) -> int:
    """How many physical cores `cpus` spans (SMT siblings count once); len(cpus) where
    the topology cannot be read."""
    cores = set()
    for cpu in cpus:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{base}/physical_package_id") as f:
                package = f.read().strip()
            with open(f"{base}/core_id") as f:
                core = f.read().strip()
        except OSError:
            return len(cpus)
        cores.add((package, core))
    return len(cores) or len(cpus)


def default_threads(cpus: Optional[set] = None, cores: Optional[int] = None) -> int:
    """One fewer than `cpus` (default: this process's), at least 1, at most `cores` (default:
    the physical cores they span)."""
    cpus = usable_cpus() if cpus is None else cpus
    cores = physical_cores(cpus) if cores is None else cores
    return max(1, min(cores, len(cpus) - 1))


def choose(requested: Optional[int], environ: Optional[dict] = None) -> tuple:
    """(threads, where the number comes from): --threads, else an OMP_NUM_THREADS the
    server was started with (a plain positive integer), else the default."""
    environ = os.environ if environ is None else environ
    if requested is not None:
        return requested, "--threads"
    given = environ.get(OMP_NUM_THREADS, "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given), OMP_NUM_THREADS
    return default_threads(), "default: one core fewer than this process may use"


def apply_before_torch(threads: int) -> None:
    """Make `threads` every thread's OpenMP default; call before torch is imported."""
    os.environ[OMP_NUM_THREADS] = str(threads)
