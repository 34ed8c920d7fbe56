"""torch.Event on the server device's timeline, for one session.

The client's torch.Event.record() sends a one-way Event("record") in order with its ops;
the session notes the moment its device reaches it: a torch.Event with timing on the
session's stream on an accelerator (a CUDA event on CUDA), the clock on a CPU server
(whose kernels have all run by the time the session thread reads the next message). So
elapsed_time() measures the device's own time between two points of the op stream, as
it does on CUDA, without the network's latency in it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Union

import torch

from .device import ComputeDevice

#: events kept per session; the client never says when it drops one, so the oldest go
MAX_EVENTS = 4096


class SessionEvents:
    def __init__(self, device: ComputeDevice):
        self.device = device
        self._events: "OrderedDict[int, Union[torch.Event, int]]" = OrderedDict()

    def record(self, event_id: int) -> None:
        if self.device.accelerator:
            event: Any = torch.Event(device=self.device.device, enable_timing=True)
            event.record()  # on the session thread's current stream: its own (device.bind_thread)
        else:
            event = time.perf_counter_ns()
        self._events[event_id] = event
        self._events.move_to_end(event_id)
        while len(self._events) > MAX_EVENTS:
            self._events.popitem(last=False)

    def _get(self, event_id: int):
        try:
            return self._events[event_id]
        except KeyError:
            raise ValueError(f"event {event_id} was not recorded on this server (or is one of more than "
                             f"{MAX_EVENTS} events recorded since)") from None

    def query(self, event_id: int) -> bool:
        event = self._get(event_id)
        return event.query() if isinstance(event, torch.Event) else True

    def synchronize(self, event_id: int) -> None:
        event = self._get(event_id)
        if isinstance(event, torch.Event):
            event.synchronize()

    def elapsed_ms(self, start_id: int, end_id: int) -> float:
        start, end = self._get(start_id), self._get(end_id)
        if isinstance(start, torch.Event):
            return float(start.elapsed_time(end))
        return (end - start) / 1e6
