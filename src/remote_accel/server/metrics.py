"""The server's Prometheus metrics: one collector that reads the server when scraped.

Nothing is counted for Prometheus on the hot path: a scrape sums what sessions already
keep (executor.ops_done, the transport's byte counters, counters.SessionCounters) over
the live sessions and the totals of ended ones. Labels take few values: `client` is the
session's slot (0..max_clients-1, reused after a client leaves), `transport` is tcp or
dpdk, `kind` an ErrorReply kind. No client names, addresses, tokens or tensor contents.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                    InfoMetricFamily)

from .._version import __version__
from .counters import BATCH_BUCKETS, transport_kind, wire_bytes

if TYPE_CHECKING:
    from .device import ComputeDevice
    from .service import Server

log = logging.getLogger(__name__)


def registry(server: "Server") -> CollectorRegistry:
    """A registry of the server's figures plus its process' (CPU, resident memory, fds)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ServerCollector(server))
    ProcessCollector(registry=reg)
    return reg


class ServerCollector:
    def __init__(self, server: "Server"):
        self.server = server
        self._slots_seen = 0  # slots that ever held a client: their memory gauge stays, at 0

    def collect(self):
        server = self.server
        sessions, totals, listeners = server.snapshot()
        sessions = [s for s in sessions if s.slot >= 0]
        wire = {s: wire_bytes(s.transport) for s in sessions}  # one read of each transport
        # one read of each session's op count too: its C++ executor counts without the
        # GIL, and the total must not lag behind the per-client figures of the same scrape
        ops = {s: s.ops_done for s in sessions}
        device = server.device

        info = InfoMetricFamily("remote_accel_server", "The server's version and torch device.")
        info.add_metric([], {"version": __version__, "device": device.name})
        yield info
        yield GaugeMetricFamily("remote_accel_clients", "Clients connected now (authenticated).",
                                value=len(sessions))
        yield GaugeMetricFamily("remote_accel_max_clients", "Clients the server serves at once (--max-clients).",
                                value=server.max_clients)
        yield GaugeMetricFamily("remote_accel_memory_limit_bytes", "Bytes each client may hold on the device.",
                                value=server.session_limit)
        yield CounterMetricFamily("remote_accel_sessions", "Clients admitted since the server started.",
                                  value=totals.sessions + len(sessions))
        yield CounterMetricFamily("remote_accel_ops", "Ops executed (graph nodes included), every client.",
                                  value=totals.ops + sum(ops.values()))

        batches, seconds, buckets = totals.batches, totals.batch_seconds, list(totals.batch_buckets)
        errors = dict(totals.errors)
        for s in sessions:
            c = s.counters
            batches += c.batches
            seconds += c.batch_seconds
            buckets = [a + b for a, b in zip(buckets, c.batch_buckets)]
            for kind, n in list(c.errors.items()):
                errors[kind] = errors.get(kind, 0) + n
        yield CounterMetricFamily("remote_accel_batches", "Batch messages executed (a client's flush of "
                                                          "queued requests).", value=batches)
        yield _histogram(buckets, seconds)
        family = CounterMetricFamily("remote_accel_op_errors", "Requests that failed on the server, by "
                                                               "ErrorReply kind.", labels=["kind"])
        for kind, n in sorted(errors.items()):
            family.add_metric([kind], n)
        yield family
        yield from _bytes(wire, totals, listeners)
        peer = CounterMetricFamily("remote_accel_peer_bytes", "Tensor bytes copied straight to or from another "
                                                              "server (server-to-server copies), by direction.",
                                   labels=["direction"])
        peer.add_metric(["sent"], server.peer_copies.bytes_sent)
        peer.add_metric(["received"], server.peer_copies.bytes_received)
        yield peer
        yield from self._clients(wire, ops)
        if server.device_error is None:  # a lost CUDA context may abort on any call
            yield from device_figures(device)

    def _clients(self, wire: dict, ops_done: dict):
        by_slot = {s.slot: s for s in wire}
        self._slots_seen = max([self._slots_seen] + [slot + 1 for slot in by_slot])
        memory = GaugeMetricFamily("remote_accel_memory_bytes", "Bytes a client holds on the device; 0 for a "
                                                                "slot no client holds now.", labels=["client"])
        for slot in range(self._slots_seen):
            s = by_slot.get(slot)
            memory.add_metric([str(slot)], s.table.used if s is not None else 0)
        yield memory
        swapped = GaugeMetricFamily("remote_accel_swapped_bytes", "Bytes of a client's tensors swapped out to host "
                                                                  "memory (--swap-space).", labels=["client"])
        for slot in range(self._slots_seen):
            s = by_slot.get(slot)
            swapped.add_metric([str(slot)], s.table.native.swap_stats()["swapped_out_bytes"] if s is not None else 0)
        yield swapped
        info = InfoMetricFamily("remote_accel_client", "A connected client's transport.", labels=["client"])
        start = GaugeMetricFamily("remote_accel_client_start_time_seconds",
                                  "When a connected client connected (Unix time).", labels=["client"])
        ops = CounterMetricFamily("remote_accel_client_ops", "Ops a connected client ran.", labels=["client"])
        received = CounterMetricFamily("remote_accel_client_bytes_received",
                                       "Bytes received from a connected client.", labels=["client"])
        sent = CounterMetricFamily("remote_accel_client_bytes_sent", "Bytes sent to a connected client.",
                                   labels=["client"])
        for slot, s in sorted(by_slot.items()):
            label = [str(slot)]
            info.add_metric(label, {"transport": transport_kind(s.transport)})
            start.add_metric(label, s.counters.started)
            ops.add_metric(label, ops_done[s])
            rx, tx = wire[s]
            received.add_metric(label, rx)
            sent.add_metric(label, tx)
        yield from (info, start, ops, received, sent)


def _histogram(buckets: list, seconds: float) -> HistogramMetricFamily:
    cumulative, acc = [], 0
    for bound, n in zip(BATCH_BUCKETS + (float("inf"),), buckets):
        acc += n
        cumulative.append(("+Inf" if bound == float("inf") else repr(bound), acc))
    family = HistogramMetricFamily("remote_accel_batch_seconds", "Time the server took to execute one Batch "
                                   "message (on an accelerator: to launch its ops).")
    family.add_metric([], cumulative, seconds)
    return family


def _bytes(wire: dict, totals, listeners: list):
    received, sent = dict(totals.bytes_received), dict(totals.bytes_sent)
    for listener in listeners:  # every served transport has a series, 0 before its first client
        kind = transport_kind(listener)
        received.setdefault(kind, 0)
        sent.setdefault(kind, 0)
    for s, (rx, tx) in wire.items():
        kind = transport_kind(s.transport)
        received[kind] = received.get(kind, 0) + rx
        sent[kind] = sent.get(kind, 0) + tx
    for name, values, what in (("remote_accel_bytes_received", received, "received from"),
                               ("remote_accel_bytes_sent", sent, "sent to")):
        family = CounterMetricFamily(name, f"Bytes {what} clients (message headers included), by transport.",
                                     labels=["transport"])
        for kind, n in sorted(values.items()):
            family.add_metric([kind], n)
        yield family


def device_figures(device: "ComputeDevice"):
    """The device's own memory and utilisation, where it reports them (none on CPU)."""
    if not device.accelerator:
        return
    label = [device.name]
    allocated = device.memory_allocated()
    if allocated is not None:
        yield _gauge("remote_accel_device_memory_allocated_bytes", "Bytes torch's allocator holds for this "
                     "server's tensors on the device.", label, allocated)
    free_total = _memory_info(device)
    if free_total is not None:
        free, total = free_total
        yield _gauge("remote_accel_device_memory_total_bytes", "The device's memory.", label, total)
        yield _gauge("remote_accel_device_memory_used_bytes", "The device's memory in use, by any process.",
                     label, total - free)
    utilization = _utilization(device)
    if utilization is not None:
        yield _gauge("remote_accel_device_utilization_ratio", "Share of the last sample period the device was "
                     "busy (0..1, as nvidia-smi's GPU-Util).", label, utilization)


def _gauge(name: str, text: str, label: list, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, text, labels=["device"])
    family.add_metric(label, value)
    return family


def _memory_info(device: "ComputeDevice") -> Optional[tuple[int, int]]:
    try:
        free, total = torch.accelerator.get_memory_info(device.index)
        return int(free), int(total)
    except (RuntimeError, AttributeError, TypeError, ValueError) as exc:
        log.debug("no memory figures for %s: %s", device.name, exc)
        return None


def _utilization(device: "ComputeDevice") -> Optional[float]:
    if device.type != "cuda":
        return None
    try:  # NVML through nvidia-ml-py (amdsmi on ROCm); absent: no such metric
        return torch.cuda.utilization(device.index) / 100.0
    except Exception as exc:  # ModuleNotFoundError, NVMLError, RuntimeError: all mean "not reported"
        log.debug("no utilisation figure for %s: %s", device.name, exc)
        return None
