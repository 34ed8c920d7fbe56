"""How long a TCP receiver polls its socket before it blocks, adapted to how long the
peer's messages actually take to come.

A receiver that blocks in the kernel pays a wake-up when the reply lands: on a VM whose
idle cores halt (cpuidle haltpoll) a cross-core wake-up costs ~20 us each way, which made
a 64-byte round trip over loopback ~50 us where ~7 us is possible. A receiver that has
just sent a request (or just answered one) therefore first polls the socket without
blocking for a short window, yielding the core between polls so that a peer or a
thread on the same core runs at once, and only then blocks as before. A transport that
stays silent for longer than the window blocks: an idle connection burns nothing.

The window adapts (as the DPDK doorbells' spin does, in C): a message that came just
after the window closed doubles it (up to the maximum), a wait much longer than the
maximum (the peer was computing, or the user's code did something else) halves it, down
to a floor that still catches immediate answers. So a server that streams one-way work,
or a client whose syncs wait for long kernels, spends a few microseconds per wait, and a
ping-pong of small requests polls for as long as a reply takes.

Polling pays only while this thread keeps its core. Where other work shares the cores
(two busy processes on a 2-core host), a yield hands the core to that work for a whole
scheduler slice (3-4 ms on Linux 6.x), and a thread that yielded is not woken early when
its message lands, as a blocked one is: a 40 us sync took 4 ms. So a yield that returns
later than the whole window means the core is contended: the receiver stops polling and
blocks, and does not poll again for a while (1 ms, doubling while it goes on, up to a
second; a poll that catches its message resets it).

REMOTE_ACCEL_TCP_POLL_US sets the maximum window in microseconds (0: never poll, block
at once as before).
"""

from __future__ import annotations

from .. import config


ENV_POLL_US = "REMOTE_ACCEL_TCP_POLL_US"
#: Measured on a loaded 2-core VM (benchmarks/bench_device.py --sync-only): long enough
#: for a server to answer a small sync request (execute, reply) within it.
DEFAULT_POLL_US = 200
MAX_POLL_US = 100_000
#: The floor of an adapted window, as a fraction of the maximum: a reply already on its
#: way is still caught without a kernel wake-up.
_FLOOR_DIVISOR = 16
#: A wait longer than this many maximum windows means polling was pointless for it.
_LONG_WAIT_WINDOWS = 8
#: How long a receiver that lost its core in a yield blocks at once: the first pause,
#: and the longest one (the pause doubles while the core stays contended).
_CONTENDED_PAUSE_NS = 1_000_000
_CONTENDED_PAUSE_MAX_NS = 1_000_000_000


def poll_us_from_env() -> int:
    """The maximum poll window from REMOTE_ACCEL_TCP_POLL_US (default DEFAULT_POLL_US).
    Raises ValueError naming the variable for anything but an integer 0..MAX_POLL_US."""
    text = config.setting(ENV_POLL_US)
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_POLL_US:
        raise ValueError(f"{ENV_POLL_US}={text!r}: expected microseconds, an integer from 0 (never poll) "
                         f"to {MAX_POLL_US}")
    return value


class PollWindow:
    """The adaptive window of one receiver (one transport: one thread receives)."""

    __slots__ = ("max_ns", "floor_ns", "ns", "paused_until_ns", "pause_ns")

    def __init__(self, max_us: int):
        if not 0 <= max_us <= MAX_POLL_US:
            raise ValueError(f"poll window {max_us} us is outside 0..{MAX_POLL_US}")
        self.max_ns = max_us * 1000
        self.floor_ns = self.max_ns // _FLOOR_DIVISOR
        self.ns = self.max_ns
        self.paused_until_ns = 0  # no polling before this (monotonic ns): the core is contended
        self.pause_ns = _CONTENDED_PAUSE_NS

    def window_at(self, now_ns: int) -> int:
        """The window of a wait that starts at `now_ns` (0 while polling is paused)."""
        return 0 if now_ns < self.paused_until_ns else self.ns

    def yielded(self, took_ns: int, now_ns: int) -> bool:
        """A yield that returned at `now_ns` took `took_ns`. True when it lost the core
        (it outlasted the whole window): polling pauses then, each pause in a row twice
        as long as the one before."""
        if took_ns <= self.max_ns:
            return False
        self.paused_until_ns = now_ns + self.pause_ns
        self.pause_ns = min(_CONTENDED_PAUSE_MAX_NS, 2 * self.pause_ns)
        return True

    def waited(self, ns: int) -> None:
        """A wait that outlasted the window found its message after `ns` nanoseconds."""
        if ns <= 2 * self.max_ns:
            self.ns = min(self.max_ns, 2 * self.ns)  # a near miss: a longer window catches it
        elif ns >= _LONG_WAIT_WINDOWS * self.max_ns:
            self.ns = max(self.floor_ns, self.ns // 2)  # polling was wasted on this one

    def caught(self) -> None:
        """A message came while polling: the window works; regrow a shrunken one slowly."""
        self.pause_ns = _CONTENDED_PAUSE_NS
        if self.ns < self.max_ns:
            self.ns = min(self.max_ns, self.ns + self.floor_ns)
