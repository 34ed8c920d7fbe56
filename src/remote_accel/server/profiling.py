"""A client's torch.profiler window on the server: the server's own timeline of each op
and graph it ran for that session (pytorch_ext/profiling.py shows them as the device's
events beside the client's CPU events).

torch's profiler is process-wide: one session profiles at a time (another is refused
until it stops), and the events kept are those of that session's thread, found by a
marker recorded there when the window opens. On CUDA the kernels (device time) are kept
too; on CPU an op's execution on the session thread is the device's time.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from .failure import OP, Failure

_lock = threading.Lock()
_owner: Optional[int] = None  # the session number profiling now
MAX_EVENTS = 1 << 20
_MARKER = "remote_accel::profile_window"


class SessionProfiler:
    def __init__(self, number: int, device_type: str):
        self.number = number
        self.device_type = device_type
        self._prof: Optional[torch.profiler.profile] = None

    def start(self) -> None:
        global _owner
        with _lock:
            if _owner is not None and _owner != self.number:
                raise Failure(OP, f"another client (session {_owner}) is profiling this server; try again later")
            _owner = self.number
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities)
        self._prof.__enter__()
        with torch.profiler.record_function(_MARKER):
            pass

    def stop(self) -> tuple:
        """(name, start ns, end ns, kind) of the window's top-level ops ("op") and device
        kernels ("kernel"), in the server's Unix time."""
        global _owner
        prof, self._prof = self._prof, None
        if prof is None:
            return ()
        try:
            prof.__exit__(None, None, None)
            return _session_events(prof)
        finally:
            with _lock:
                _owner = None

    def close(self) -> None:
        if self._prof is not None:
            self.stop()


def _session_events(prof) -> tuple:
    events = prof.events()
    start = prof.profiler.kineto_results.trace_start_ns()
    thread = next((e.thread for e in events if e.name == _MARKER), None)
    out = []
    for e in events:
        if e.name == _MARKER:
            continue
        if e.device_type == torch.autograd.DeviceType.CPU:
            if e.cpu_parent is not None or e.thread != thread:
                continue
            kind = "op"
        else:
            kind = "kernel"
        out.append((e.name, start + int(e.time_range.start * 1000), start + int(e.time_range.end * 1000), kind))
        if len(out) >= MAX_EVENTS:
            break
    return tuple(out)
