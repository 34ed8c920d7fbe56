"""What the C++ device asks Python, because only the server knows: torch.Event's record,
query, synchronize and elapsed_time (events on the server device's timeline, see
server/events.py), torch.accelerator.synchronize(), the device's free and total memory
(torch.accelerator.get_memory_info) and empty_cache(). device.cpp's guard and
allocator.cpp's DeviceAllocator call these methods through csrc/module.cpp's
set_device_hooks."""

from __future__ import annotations

from . import runtime


class DeviceHooks:
    def record_event(self, device: int, event_id: int) -> None:
        runtime.session(device).record_event(event_id)

    def query_event(self, device: int, event_id: int) -> bool:
        return bool(runtime.session(device).event("query", event_id))

    def synchronize_event(self, device: int, event_id: int) -> None:
        runtime.session(device).event("synchronize", event_id)

    def elapsed_ms(self, device: int, start: int, end: int) -> float:
        return float(runtime.session(device).event("elapsed", start, end))

    def synchronize_device(self, device: int) -> None:
        runtime.session(device).sync()

    def memory_info(self, device: int) -> tuple:
        from .device_module import mem_get_info

        return mem_get_info(device)

    def empty_cache(self) -> None:
        from .device_module import empty_cache

        empty_cache()


def install(native) -> None:
    native.set_device_hooks(DeviceHooks())
