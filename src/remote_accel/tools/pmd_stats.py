"""Counters, rates and latency of an ra-testpmd run, and their testpmd-like rendering."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

PERCENTILES = (50.0, 99.0, 99.9)


@dataclass
class Counters:
    """Cumulative counts of one port (raw modes: frames; message modes: messages)."""

    rx_packets: int = 0
    rx_dropped: int = 0
    rx_bytes: int = 0  # whole frames or messages, headers included
    rx_payload: int = 0  # what the application carried: chunk or message payload bytes
    tx_packets: int = 0
    tx_dropped: int = 0
    tx_bytes: int = 0
    tx_payload: int = 0

    def __sub__(self, other: "Counters") -> "Counters":
        return Counters(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def __add__(self, other: "Counters") -> "Counters":
        return Counters(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


class Latency:
    """Round-trip times in nanoseconds, kept whole for exact percentiles."""

    def __init__(self) -> None:
        self._ns: list[int] = []

    def add(self, ns: int) -> None:
        self._ns.append(ns)  # list.append is atomic under the GIL: receiver threads may share one

    def __len__(self) -> int:
        return len(self._ns)

    def summary(self, since: int = 0) -> Optional[dict]:
        """{p50, p99, p99.9, min, max, mean} in microseconds over samples[since:], or None."""
        ns = np.asarray(self._ns[since:], dtype=np.float64)
        if ns.size == 0:
            return None
        out = {f"p{p:g}": float(np.percentile(ns, p)) / 1e3 for p in PERCENTILES}
        out.update(min=float(ns.min()) / 1e3, max=float(ns.max()) / 1e3, mean=float(ns.mean()) / 1e3,
                   samples=int(ns.size))
        return out


@dataclass
class PortInfo:
    port: int
    name: str
    driver: str = ""


@dataclass
class Sample:
    """Counters of every port at one instant, and the rates since the previous sample."""

    elapsed: float
    counters: list
    rates: list = field(default_factory=list)
    latency: Optional[dict] = None


def rates(delta: Counters, seconds: float) -> dict:
    s = max(seconds, 1e-9)
    return {
        "rx_pps": delta.rx_packets / s, "tx_pps": delta.tx_packets / s,
        "rx_gbit_s": delta.rx_bytes * 8 / s / 1e9, "tx_gbit_s": delta.tx_bytes * 8 / s / 1e9,
        "rx_payload_gb_s": delta.rx_payload / s / 1e9, "tx_payload_gb_s": delta.tx_payload / s / 1e9,
    }


def port_json(info: PortInfo, total: Counters, seconds: float) -> dict:
    out = {"port": info.port, "name": info.name, "driver": info.driver}
    out.update(dataclasses.asdict(total))
    out.update(rx_total=total.rx_packets + total.rx_dropped, tx_total=total.tx_packets + total.tx_dropped)
    out.update(rates(total, seconds))
    return out


# -- text -------------------------------------------------------------------------------
def _line(*cells: tuple) -> str:
    return "  " + "".join(f"{label + ':':<13}{value:<14}" for label, value in cells).rstrip()


def _num(x: float) -> str:
    return f"{x:.0f}"


def _rate(x: float) -> str:
    return f"{x:.3f}" if x >= 0.1 or x == 0 else f"{x:.2g}"


def _block(title: str, c: Counters, r: dict, fill: str, unit: str) -> list[str]:
    head = f" {title} "
    lines = [f"  {head:{fill}^76}"]
    lines.append(_line((f"RX-{unit}", c.rx_packets), ("RX-dropped", c.rx_dropped),
                       ("RX-total", c.rx_packets + c.rx_dropped)))
    lines.append(_line((f"TX-{unit}", c.tx_packets), ("TX-dropped", c.tx_dropped),
                       ("TX-total", c.tx_packets + c.tx_dropped)))
    lines.append(_line(("Rx-pps", _num(r["rx_pps"])), ("Rx-Gbit/s", _rate(r["rx_gbit_s"])),
                       ("Rx-payload", _rate(r["rx_payload_gb_s"]) + " GB/s")))
    lines.append(_line(("Tx-pps", _num(r["tx_pps"])), ("Tx-Gbit/s", _rate(r["tx_gbit_s"])),
                       ("Tx-payload", _rate(r["tx_payload_gb_s"]) + " GB/s")))
    lines.append("  " + fill * 76)
    return lines


def latency_line(lat: Optional[dict]) -> str:
    if not lat:
        return "  Round trip (us): no samples"
    return (f"  Round trip (us): p50 {lat['p50']:.1f}  p99 {lat['p99']:.1f}  p99.9 {lat['p99.9']:.1f}  "
            f"min {lat['min']:.1f}  max {lat['max']:.1f}  ({lat['samples']} samples)")


def format_sample(ports: list, sample: Sample, unit: str) -> str:
    """A periodic block: per port, the totals so far and the rates since the last one."""
    lines = []
    for info, c, r in zip(ports, sample.counters, sample.rates):
        lines += _block(f"Port {info.port} ({info.name}) at {sample.elapsed:.1f} s", c, r, "#", unit)
    if sample.latency is not None or unit == "msgs":
        lines.append(latency_line(sample.latency))
    return "\n".join(lines) + "\n"


def format_final(ports: list, totals: list, seconds: float, latency: Optional[dict], unit: str) -> str:
    """testpmd's closing report: forward statistics per port, then accumulated."""
    lines = []
    for info, c in zip(ports, totals):
        lines += _block(f"Forward statistics for port {info.port} ({info.name})", c, rates(c, seconds), "-", unit)
    overall = sum(totals, Counters())
    lines += _block(f"Accumulated forward statistics for all ports over {seconds:.2f} s", overall,
                    rates(overall, seconds), "+", unit)
    if latency is not None or unit == "msgs":
        lines.append(latency_line(latency))
    return "\n".join(lines) + "\n"
