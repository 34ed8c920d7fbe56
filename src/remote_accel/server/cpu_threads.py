"""How many CPU threads the server's kernels use (torch's intra-op threads).

By default as many as torch gives a local process on the same host, so that a CPU server
computes what local CPU computes: reductions split over threads add in a different order
with another thread count (ResNet-18's losses moved by 0.7% within 3 training steps with
the server on 1 thread against local CPU on 2; bf16 layer-norm gradients in their last
bit).

`--threads N` (or an OMP_NUM_THREADS the server starts with) sets the count. On a host the
server shares with its clients (memif, loopback TCP) fewer threads than cores run small
models much faster: the server waits passively (OMP_WAIT_POLICY=PASSIVE, __main__.py), so
every parallel region, MKL's GEMMs included (PyTorch turns MKL's dynamic threading off),
has to wake sleeping pool threads onto cores the client is using. On 2 shared cores the
tiny Transformer's compiled training step took 10.4-12.3 ms with 2 threads and 6.2-6.8 ms
with 1 (docs/design/cpu-threads.md).

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


def apply_before_torch(threads: Optional[int]) -> None:
    """Make `threads` every thread's OpenMP default (None: leave torch's); call before torch
    is imported."""
    if threads is not None:
        os.environ[OMP_NUM_THREADS] = str(threads)
