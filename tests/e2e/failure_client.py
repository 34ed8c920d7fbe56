"""A client process for the failure tests: `python failure_client.py SCENARIO TRANSPORT
SERVER TOKEN TIMEOUT RECOVERY` (RECOVERY: on, init()'s default, or off). It prints one
line per event, `name value...`, flushed, so that the test (its parent) can act at the
right moment (SIGINT, SIGSTOP, SIGKILL) and check results. The clock is time.monotonic(),
the same in every process of the machine."""

from __future__ import annotations

import sys
import time

import torch

import remote_accel


def say(*words) -> None:
    print(*words, flush=True)


def long_work(a: torch.Tensor, seconds: float) -> torch.Tensor:
    """Queue at least about `seconds` of server work (a chain of matmuls), without waiting.
    Timed on a chain of three: a single op's time is mostly the round trip."""
    start = time.monotonic()
    ((a @ a) @ a @ a).sum().item()
    one = max((time.monotonic() - start) / 3, 1e-3)
    y = a
    for _ in range(int(seconds / one) + 1):
        y = (y @ a) * 1e-3
    return y


def busy(a, timeout: float) -> None:
    """A sync that waits several times `timeout` for real work succeeds. long_work only
    estimates (a loaded machine moves its yardstick), so the work doubles until one sync
    did wait more than twice `timeout`, what the test checks before the rest."""
    seconds = 4 * timeout
    for _ in range(4):
        y = long_work(a, seconds)
        start = time.monotonic()
        value = y.sum().item()
        waited = time.monotonic() - start
        if waited > 2 * timeout:
            break
        seconds *= 2
    say("waited", waited, value == value)  # a number, not NaN
    try:
        y = long_work(a, seconds)  # what just waited more than 4 times the deadline below
        torch.remote_accel.synchronize(timeout=timeout / 2)
    except remote_accel.RemoteAccelError as exc:
        say("deadline", type(exc).__name__)
    x = torch.arange(4.0, device="remote_accel")
    say("after", (x + 1).cpu().tolist())


def frozen(a, timeout: float) -> None:
    """The parent stops or kills the server while we wait: an error within `timeout`."""
    y = long_work(a, 15)  # longer than the test's wait; the server works on it until it exits
    say("waiting", time.monotonic())
    try:
        y.sum().item()
        say("finished")
    except remote_accel.RemoteAccelError as exc:
        say("error", time.monotonic(), str(exc).splitlines()[0])


def killed(a, timeout: float) -> None:
    """The parent kills the server while we wait and starts it again (recovery on): the
    wait ends with the result, computed again on the server that came back."""
    y = long_work(a, 3).sum()
    say("waiting", time.monotonic())
    before = remote_accel.stats()["recoveries"]
    value = y.item()
    say("finished", time.monotonic(), value == value, remote_accel.stats()["recoveries"] - before)


def interrupted(a, timeout: float) -> None:
    """Ctrl-C during syncs, between errors of queued ops: every later reply is the right one."""
    x = torch.arange(4.0, device="remote_accel")
    y = long_work(a, 4)
    bad = x[torch.tensor([0, 10]).to("remote_accel")]  # fails on the server, reported at a sync
    for what in ("sync", "read"):
        say("waiting", what, time.monotonic())
        try:
            if what == "sync":
                torch.remote_accel.synchronize()
            else:
                (y + 1).cpu()
            say("not-interrupted")
        except KeyboardInterrupt:
            say("interrupted", time.monotonic())
        if what == "sync":  # the interrupted sync's reply carried the index error
            try:
                x.cpu()
                say("late-error none")
            except remote_accel.RemoteAccelError as exc:
                say("late-error", "bounds" in str(exc))
            y = long_work(a, 4)
    del bad
    z = torch.full((3,), 7.0, device="remote_accel")
    say("next", (z * 2).cpu().tolist(), x.cpu().tolist())
    remote_accel.shutdown()
    say("clean")


def stale(a, timeout: float) -> None:
    """Ctrl-C during `.item()`, then errors between scalar reads and synchronize()s: every
    value read is the one asked for, every error surfaces once at the next sync point."""
    x = torch.arange(4.0, device="remote_accel")
    y = long_work(a, 4)
    say("waiting", time.monotonic())
    try:
        y.sum().item()
        say("not-interrupted")
    except KeyboardInterrupt:
        say("interrupted", time.monotonic())
    bad = x[torch.tensor([0, 10]).to("remote_accel")]  # fails on the server
    try:  # the interrupted read's late reply is skipped; this sync hears the error
        torch.remote_accel.synchronize()
        say("first-sync none")
    except remote_accel.RemoteAccelError as exc:
        say("first-sync", "bounds" in str(exc))
    results = []
    for i in range(12):
        if i % 3 == 1:  # an error queued between two reads
            bad = x[torch.tensor([0, 10 + i]).to("remote_accel")]
            try:
                torch.remote_accel.synchronize() if i % 2 else (x * i).sum().item()
                results.append("missed")
            except remote_accel.RemoteAccelError as exc:
                results.append("bounds" in str(exc))
        torch.remote_accel.synchronize()
        torch.remote_accel.synchronize()  # nothing sent since: no error, no round trip needed
        results.append((x + i).sum().item() == 6.0 + 4 * i and (x * i)[3].item() == 3.0 * i)
    del bad
    say("results", *results)
    remote_accel.shutdown()
    say("clean")


def main() -> int:
    scenario, transport, server, token, timeout, recovery = sys.argv[1:7]
    timeout = float(timeout)
    kwargs = {"server": server} if transport == "tcp" else {}
    remote_accel.init(transport=transport, token=token, timeout=timeout, recovery=recovery == "on", **kwargs)
    a = torch.randn(1024, 1024, device="remote_accel")
    say("ready")
    {"busy": busy, "frozen": frozen, "killed": killed, "interrupted": interrupted, "stale": stale}[scenario](a, timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
