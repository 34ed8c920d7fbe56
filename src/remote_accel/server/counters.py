"""What the server counts for its metrics, in plain Python (no Prometheus here).

A session counts per message, never per op: a Batch adds one to `batches` and one
observation to the time histogram, whatever the number of ops in it. Ops are the
executor's own `ops_done`, and bytes the transport's own counters: both are read when
someone asks (a scrape), so they cost the hot path nothing more. Only the session's
thread writes its counters; a scrape reads them from another thread, which the GIL
makes safe for ints (a figure may be one batch behind, never torn).
"""

from __future__ import annotations

import bisect
import time

from . import failure

#: Upper bounds (seconds) of the batch time histogram's buckets: a batch of a few ops
#: takes ~100 us, a full one (256 ops at 45-145 us each) tens of milliseconds.
BATCH_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                 5.0, 10.0)
#: The error kinds a metric reports, always (at 0 too), so that a dashboard's series exist.
ERROR_KINDS = (failure.OP, failure.OOM, failure.BAD_HANDLE, failure.UNKNOWN_OP, failure.PROTOCOL,
               failure.DEVICE_LOST)


def transport_kind(transport) -> str:
    """"tcp" for a TcpTransport or TcpListener, "dpdk" for DPDK's: a label with few values."""
    name = type(transport).__name__.lower()
    for suffix in ("transport", "listener"):
        name = name.removesuffix(suffix)
    return name or "other"


class SessionCounters:
    """One session's figures beyond ops (the executor's) and bytes (the transport's)."""

    __slots__ = ("started", "batches", "batch_seconds", "batch_buckets", "errors")

    def __init__(self):
        self.started = time.time()  # wall clock: exported as a start time, as Prometheus likes
        self.batches = 0
        self.batch_seconds = 0.0
        self.batch_buckets = [0] * (len(BATCH_BUCKETS) + 1)  # the last one: above every bound
        self.errors: dict[str, int] = {}

    def batch(self, seconds: float) -> None:
        self.batches += 1
        self.batch_seconds += seconds
        self.batch_buckets[bisect.bisect_left(BATCH_BUCKETS, seconds)] += 1

    def error(self, exc: BaseException) -> None:
        kind = failure.classify(exc)
        self.errors[kind] = self.errors.get(kind, 0) + 1


class Totals:
    """Figures summed over sessions (those that ended, for the server's lifetime counters)."""

    def __init__(self):
        self.sessions = 0
        self.ops = 0
        self.batches = 0
        self.batch_seconds = 0.0
        self.batch_buckets = [0] * (len(BATCH_BUCKETS) + 1)
        self.errors = dict.fromkeys(ERROR_KINDS, 0)
        self.bytes_received: dict[str, int] = {}
        self.bytes_sent: dict[str, int] = {}

    def add(self, session) -> None:
        """Add one session's figures (a Session: its counters, ops_done, transport)."""
        c = session.counters
        self.sessions += 1
        self.ops += session.ops_done
        self.batches += c.batches
        self.batch_seconds += c.batch_seconds
        self.batch_buckets = [a + b for a, b in zip(self.batch_buckets, c.batch_buckets)]
        for kind, n in list(c.errors.items()):  # list(): the session's thread may add a kind
            self.errors[kind] = self.errors.get(kind, 0) + n
        kind = transport_kind(session.transport)
        received, sent = wire_bytes(session.transport)
        self.bytes_received[kind] = self.bytes_received.get(kind, 0) + received
        self.bytes_sent[kind] = self.bytes_sent.get(kind, 0) + sent

    def copy(self) -> "Totals":
        other = Totals()
        other.__dict__.update({k: v.copy() if isinstance(v, (dict, list)) else v for k, v in self.__dict__.items()})
        return other


def wire_bytes(transport) -> tuple[int, int]:
    """(received, sent) bytes of a transport, headers included; (0, 0) where it keeps none.
    Safe on a closed transport (its counters outlive the connection)."""
    try:
        st = transport.stats()
    except Exception:  # a transport torn down under us: its bytes were counted before
        return 0, 0
    return int(st.get("rx_bytes", 0)), int(st.get("tx_bytes", 0))
