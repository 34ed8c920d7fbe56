"""The torch device the server executes on, behind one vendor-neutral face.

Everything goes through `torch.device` and the `torch.accelerator` API, so CUDA (and ROCm,
which presents itself as cuda), XPU and MPS share one code path and a CPU-only host needs
no special case beyond "no streams, no pinned memory".
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from ..errors import ConfigError

log = logging.getLogger(__name__)

#: `--device auto` tries these in order.
AUTO_ORDER = ("cuda", "xpu", "mps")
KNOWN_TYPES = ("cpu",) + AUTO_ORDER
#: How the runtimes word their errors (torch before 2.8 raises them as plain RuntimeError).
_ACCELERATOR_ERROR_TEXT = ("CUDA error", "HIP error", "device-side assert", "UR error")


def _backend_available(kind: str) -> bool:
    if kind == "cpu":
        return True
    if kind == "mps":
        return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()
    module = getattr(torch, kind, None)
    return module is not None and module.is_available()


def _backend_count(kind: str) -> int:
    if kind in ("cpu", "mps"):
        return 1
    return getattr(torch, kind).device_count()


def parse_device(spec: str) -> torch.device:
    """`auto`, `cpu`, `cuda[:N]`, `mps`, `xpu[:N]` -> a present torch.device; ConfigError if absent."""
    spec = spec.strip().lower()
    if spec == "auto":
        for kind in AUTO_ORDER:
            if _backend_available(kind):
                return torch.device(kind, 0)
        return torch.device("cpu")
    kind, _, index_text = spec.partition(":")
    if kind not in KNOWN_TYPES:
        raise ConfigError(f"unknown device {spec!r}: expected auto, cpu, cuda[:N], mps or xpu[:N]")
    if not _backend_available(kind):
        raise ConfigError(f"device {spec!r} is not available on this host (torch {torch.__version__})")
    if kind == "cpu":
        return torch.device("cpu")
    try:
        index = int(index_text) if index_text else 0
    except ValueError:
        raise ConfigError(f"bad device index in {spec!r}") from None
    count = _backend_count(kind)
    if not 0 <= index < count:
        raise ConfigError(f"device {spec!r} does not exist: this host has {count} {kind} device(s)")
    return torch.device(kind, index)


class ComputeDevice:
    """One torch device plus what sessions need from it: streams, staging, memory figures."""

    def __init__(self, device: torch.device):
        self.device = device
        self.type = device.type
        self.index = device.index if device.index is not None else 0
        self.accelerator = device.type != "cpu"
        self.name = str(device)
        self._properties: Optional[dict] = None

    # -- per-session execution context ------------------------------------------------------
    def new_stream(self) -> Optional["torch.Stream"]:
        """A stream of its own for one client, so that clients' work interleaves on the device."""
        if not self.accelerator:
            return None
        try:
            return torch.Stream(device=self.device)
        except (RuntimeError, TypeError) as exc:  # e.g. a backend with a single queue
            log.debug("no separate streams on %s: %s", self.name, exc)
            return None

    def bind_thread(self, stream) -> None:
        """Make `stream` (and this device) current for the calling thread: torch keeps both per thread."""
        if self.accelerator:
            torch.accelerator.set_device_index(self.index)
            if stream is not None:
                torch.accelerator.set_stream(stream)

    def synchronize(self, stream) -> None:
        if stream is not None:
            stream.synchronize()
        elif self.accelerator:
            torch.accelerator.synchronize(self.index)

    def lost(self, exc: BaseException) -> bool:
        """Whether `exc` left the device unusable for the whole process.

        CUDA's sticky errors (a device-side assert such as an index out of range, an
        illegal address) poison the context: every later call fails, and freeing a tensor
        can abort the process. They surface as torch.AcceleratorError (RuntimeError with
        the runtime's message in older torch); a device-wide synchronize tells a sticky
        error (it raises again) from one that was consumed."""
        if not self.accelerator or isinstance(exc, torch.OutOfMemoryError):
            return False
        if not (type(exc).__name__ == "AcceleratorError"
                or isinstance(exc, RuntimeError) and any(t in str(exc) for t in _ACCELERATOR_ERROR_TEXT)):
            return False
        try:
            torch.accelerator.synchronize(self.index)
        except Exception:
            return True
        return False

    def staging(self, nbytes: int) -> torch.Tensor:
        """Host bytes to receive into or send from: pinned where the device supports it, so
        that copies to and from the device are asynchronous DMA. Pinned blocks come from
        torch's caching host allocator, which keeps a block until the copies recorded on it
        finish, so the caller may drop the tensor right after enqueuing its copy."""
        if self.accelerator:
            try:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as exc:
                log.debug("pinned memory unavailable on %s: %s", self.name, exc)
        return torch.empty(nbytes, dtype=torch.uint8)

    # -- memory -------------------------------------------------------------------------------
    def total_memory(self) -> int:
        """Bytes the device holds; the ceiling for any single session without --memory-limit."""
        if self.accelerator:
            try:
                return int(torch.accelerator.get_memory_info(self.index)[1])
            except (RuntimeError, AttributeError, TypeError):
                pass
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return 1 << 40

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device, as torch.cuda.mem_get_info() gives them; on a
        CPU server the host's available and physical memory."""
        if self.accelerator:
            try:
                free, total = torch.accelerator.get_memory_info(self.index)
                return int(free), int(total)
            except (RuntimeError, AttributeError, TypeError):
                pass
        available = _meminfo("MemAvailable")
        total = self.total_memory()
        return (available if available is not None else total), total

    def properties(self) -> dict:
        """What torch.cuda.get_device_properties() tells of a device: name and
        total_memory always; major, minor and multi_processor_count where the device has
        them (None on a CPU server)."""
        if self._properties is not None:
            return dict(self._properties)
        props = {"type": self.type, "name": self.name, "total_memory": self.total_memory(),
                 "major": None, "minor": None, "multi_processor_count": None}
        if self.accelerator:
            try:
                p = torch.get_device_module(self.type).get_device_properties(self.index)
            except (RuntimeError, AttributeError, TypeError) as exc:
                log.debug("no device properties for %s: %s", self.name, exc)
            else:
                props["name"] = str(getattr(p, "name", self.name))
                for key in ("total_memory", "major", "minor", "multi_processor_count"):
                    value = getattr(p, key, None)
                    if isinstance(value, int):
                        props[key] = value
        else:
            props["name"] = _cpu_model() or "cpu"
            props["multi_processor_count"] = os.cpu_count()
        self._properties = props
        return dict(props)

    def memory_allocated(self) -> Optional[int]:
        """The device allocator's own figure (None on CPU, which has no such counter)."""
        if not self.accelerator:
            return None
        try:
            return int(torch.accelerator.memory_allocated(self.index))
        except (RuntimeError, AttributeError, TypeError):
            return None

    def empty_cache(self) -> None:
        if self.accelerator:
            try:
                torch.accelerator.empty_cache()
            except (RuntimeError, AttributeError):
                pass

    # -- random numbers -------------------------------------------------------------------------
    def new_generator(self) -> torch.Generator:
        return torch.Generator(device=self.device)

    def default_generator(self) -> Optional[torch.Generator]:
        """The generator kernels use when given none (shared by every session)."""
        if self.type == "cpu":
            return torch.default_generator
        if self.type == "mps":
            try:
                return torch.mps._get_default_mps_generator()
            except (AttributeError, RuntimeError):
                return None
        module = getattr(torch, self.type, None)
        gens = getattr(module, "default_generators", ())
        return gens[self.index] if self.index < len(gens) else None


def _meminfo(key: str) -> Optional[int]:
    """A /proc/meminfo figure in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name == key:
                    return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cpu_model() -> Optional[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return None
