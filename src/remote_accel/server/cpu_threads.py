"""How many CPU threads the server's kernels use (torch's intra-op threads), and how those
threads wait between parallel regions.

By default as many as torch gives a local process on the same host, so that a CPU server
computes what local CPU computes: reductions split over threads add in a different order
with another thread count (ResNet-18's losses moved by 0.7% within 3 training steps with
the server on 1 thread against local CPU on 2; bf16 layer-norm gradients in their last
bit).

`--threads N` (or an OMP_NUM_THREADS the server starts with) sets the count. On a host the
server shares with its clients (memif, loopback TCP) one thread runs small models faster
still, since the client's own thread needs a core too (docs/design/cpu-threads.md).

The pool threads wait as OpenMP waits by default, as in a local process: they spin a
while after a parallel region, then sleep (an OMP_WAIT_POLICY the server starts with
wins). Every MKL GEMM is a parallel region (PyTorch turns MKL's dynamic threading off),
and a step runs hundreds: with passive waits (OMP_WAIT_POLICY=PASSIVE, the default until
2026-11-28) each woke a sleeping thread onto a core the client was using, and the tiny
Transformer's eager step took 14.3-16.6 ms on 2 shared cores against 9.1-9.7 ms with
OpenMP's default and 6.1-7.1 ms locally (three runs each). The spin is bounded, so an
idle server sleeps.

The count is set before torch loads, as OMP_NUM_THREADS: OpenMP reads it once, as every
thread's default, the session threads included (`torch.set_num_threads` changes only the
calling thread and threads that later start an ATen parallel loop; MKL's GEMMs in a
session thread could keep the old count).
"""

from __future__ import annotations

import os
from typing import Optional

#: The environment variable OpenMP (and so torch and MKL) reads its thread count from.
OMP_NUM_THREADS = "OMP_NUM_THREADS"
#: ... and how its threads wait between parallel regions (ACTIVE, PASSIVE; unset: spin, then sleep)
OMP_WAIT_POLICY = "OMP_WAIT_POLICY"
TORCH_DEFAULT = "torch's default, as in a local process"


def choose(requested: Optional[int], environ: Optional[dict] = None) -> tuple:
    """(threads or None for torch's default, where the number comes from): --threads, else
    an OMP_NUM_THREADS the server was started with (a plain positive integer)."""
    environ = os.environ if environ is None else environ
    if requested is not None:
        return requested, "--threads"
    given = environ.get(OMP_NUM_THREADS, "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given), OMP_NUM_THREADS
    return None, TORCH_DEFAULT


def why(source: str) -> str:
    """Where the thread count came from (choose's second value), said for the log."""
    if source == TORCH_DEFAULT:
        return (f"{TORCH_DEFAULT}, so that results equal local CPU's (--threads 1 runs small models faster "
                "on a host shared with clients)")
    return f"as {source} says"


def wait_policy(environ: Optional[dict] = None) -> str:
    """How the kernels' pool threads wait between parallel regions, and why, for the log."""
    environ = os.environ if environ is None else environ
    given = environ.get(OMP_WAIT_POLICY, "").strip()
    if given:
        return f"{OMP_WAIT_POLICY}={given} from the environment"
    return "spin a while, then sleep (OpenMP's default, as in a local process)"


def apply_before_torch(threads: Optional[int]) -> None:
    """Make `threads` every thread's OpenMP default (None: leave torch's); call before torch
    is imported."""
    if threads is not None:
        os.environ[OMP_NUM_THREADS] = str(threads)
