"""torch.profiler with ProfilerActivity.PrivateUse1: each server's timeline beside the client's.

The C++ part (csrc/profiler.cpp) is the kineto activity profiler of the PrivateUse1
backend; kineto starts and stops it with every profiler that asks for PrivateUse1
activities, and it calls start() and stop() here. start() opens a window on every server
(server/profiling.py: its torch.profiler, on that session's thread); stop() closes them
and returns the ops and graphs each server ran for this client (and, on CUDA, their
kernels), moved into this client's Unix time by the clock offset the stop's round trip
gives (as NTP estimates it: the server says when it took the request and when it answered). Events of servers that cannot answer
are left out, with a warning: the user's profiled code never fails for them.
"""

from __future__ import annotations

import logging
import time

from ..errors import RemoteAccelError
from . import runtime
from ._native import load

log = logging.getLogger("remote_accel")


def start() -> None:
    for index, session in enumerate(runtime.sessions()):
        try:
            session.profile("start")
        except RemoteAccelError as exc:
            log.warning("remote_accel: no device events from remote_accel:%d: %s", index, exc)


def stop() -> list:
    """[(name, start ns, end ns, device index, is a device kernel)] in this client's Unix time."""
    events = []
    for index, session in enumerate(runtime.sessions()):
        try:
            session.sync()  # the server idle when the stop comes: it takes it at once
            sent = time.time_ns()
            reply = session.profile("stop")
            # NTP's estimate: the request's and the reply's delays taken as equal
            offset = ((sent - reply.received) + (time.time_ns() - reply.answered)) // 2
        except RemoteAccelError as exc:
            log.warning("remote_accel: no device events from remote_accel:%d: %s", index, exc)
            continue
        events += [(name, begin + offset, end + offset, index, kind == "kernel")
                   for name, begin, end, kind in reply.events]
    return events


def install() -> None:
    load().set_profiler_hooks(start, stop)
