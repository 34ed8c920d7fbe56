"""Make `remote_accel` a torch device: once per process, on the first `init()`."""

from __future__ import annotations

import threading

import torch

from ..errors import RemoteAccelError

_done = False
_checked_up_to = 0  # check_autograd_queues passed for this many devices
_lock = threading.Lock()


def register_device() -> None:
    """Every step may have run before: a registration that `import torch` started (see
    _torch_hook) can stop half way, when torch was imported from inside our own imports,
    and init() then finishes it. PyTorch's calls below refuse to run twice, hence the
    checks."""
    global _done
    with _lock:
        if _done:
            return
        from . import device_module, fallback, printing
        from ._native import load

        native = load()
        if torch._C._get_privateuse1_backend_name() != "remote_accel":
            torch.utils.rename_privateuse1_backend("remote_accel")
        if getattr(torch, "remote_accel", None) is not device_module:
            torch._register_device_module("remote_accel", device_module)
        if not hasattr(torch.Tensor, "is_remote_accel"):
            torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
        fallback.register()
        from . import device_hooks
        from .handles import install_generator_state_hooks

        install_generator_state_hooks()
        device_hooks.install(native)
        from . import profiling

        profiling.install()
        printing.install()
        from .compile import register_backend

        register_backend()
        if torch.distributed.is_available():
            from . import process_group

            process_group.register()  # torch.distributed's backend for the device: raccl
        _start_autograd_device_threads(native)
        _done = True


def _start_autograd_device_threads(native) -> None:
    """PyTorch's autograd engine makes its per-device worker queues once, at the first
    backward of the process, for as many devices as each registered device type reports
    then. Start it now (a CPU backward), with room for every remote_accel device there
    may ever be; if a backward already ran before remote_accel existed, the engine has
    too few queues, and ensure_autograd_queues adds the missing ones."""
    native.set_device_count(native.MAX_DEVICES)
    try:
        with torch.enable_grad():
            leaf = torch.zeros((), requires_grad=True)
            (leaf * 1).backward()
    finally:
        native.set_device_count(1)
    native.ensure_autograd_queues(native.MAX_DEVICES)


def check_autograd_queues(device_count: int) -> None:
    """After init: a backward on the last remote_accel device (queued work, no round
    trip) must find its autograd queue; it has one if every lower index has. A check
    that _start_autograd_device_threads worked on this PyTorch."""
    global _checked_up_to
    if device_count <= _checked_up_to:
        return
    failed: list[BaseException] = []

    def backward() -> None:
        try:
            leaf = torch.zeros((), device=f"remote_accel:{device_count - 1}", requires_grad=True)
            (leaf * 1).backward()
        except BaseException as exc:  # raised in the caller's thread below
            failed.append(exc)

    # In a thread of its own, where autograd is on: init() may run where the caller's
    # thread has it off, since the first use of the device connects (autoload):
    # Module.to() converts its parameters under no_grad, and torch.tensor(x,
    # device="remote_accel") builds its tensor below autograd's dispatch keys, which
    # enable_grad() does not bring back (accelerate's get_max_memory starts so).
    checker = threading.Thread(target=backward, name="remote_accel-autograd-check")
    checker.start()
    checker.join()
    if failed:
        exc = failed[0]
        if not isinstance(exc, RuntimeError) or "device_ready_queues_" not in str(exc):
            raise exc
        raise RemoteAccelError(
            f"PyTorch's autograd engine has no queue for remote_accel:{device_count - 1}, although "
            "remote_accel added its queues when it registered the device (a PyTorch whose engine "
            "works differently?)") from None
    _checked_up_to = device_count


def set_device_count(n: int) -> None:
    from ._native import load

    load().set_device_count(max(n, 1))
