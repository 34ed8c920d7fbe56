"""ra-top [--server HOST:PORT] [--once] [--json]: who uses a remote-accel-server, how much.

Reads the server's metrics endpoint (`remote-accel-server --metrics HOST:PORT`) each
second and shows, like nvidia-smi or top: the device's memory and utilisation (where the
device reports them), the server's op and byte rates, and per client its memory, ops/s,
bytes/s each way, transport and age. Rates are over the last interval; the first frame
waits one interval for them.

Examples:
  ra-top                                  the server's default endpoint, live
  ra-top --server gpu-box:18516 --once    one frame, then exit
  ra-top --once --json | jq .clients      the same figures for scripts
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Optional

from .. import config
from ..errors import ConfigError, RemoteAccelError
from .extras import requires

with requires("ra-top"):
    from prometheus_client.parser import text_string_to_metric_families
    from rich.console import Console, Group
    from rich.live import Live
    from rich.table import Table
    from rich.text import Text

#: A metrics page larger than this is not a remote-accel-server's (a few KiB per client).
MAX_PAGE = 16 << 20


class ScrapeError(RemoteAccelError):
    pass


# -- reading the endpoint ----------------------------------------------------------------------
def url_of(server: str) -> str:
    """HOST:PORT (or HOST, port 18516) -> its /metrics URL; an http:// URL is taken as it is."""
    if server.startswith("http://"):
        return server
    try:
        host, port = config.parse_host_port(server, default_port=config.DEFAULT_METRICS_PORT)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if port == 0:
        raise argparse.ArgumentTypeError(f"bad port in {server!r}: expected 1..65535")
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


def scrape(url: str, timeout: float) -> dict:
    """{sample name: [(labels, value)]} of one scrape, with its monotonic time under "_at"."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            page = reply.read(MAX_PAGE + 1)
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ScrapeError(f"cannot read {url}: {getattr(reason, 'strerror', None) or reason}") from None
    if len(page) > MAX_PAGE:
        raise ScrapeError(f"{url} answered more than {MAX_PAGE} bytes: not a remote-accel-server")
    samples: dict = {"_at": time.monotonic()}
    try:
        for family in text_string_to_metric_families(page.decode("utf-8", errors="replace")):
            for s in family.samples:
                samples.setdefault(s.name, []).append((s.labels, s.value))
    except ValueError as exc:
        raise ScrapeError(f"{url} is not Prometheus text: {exc}") from None
    if "remote_accel_clients" not in samples:
        raise ScrapeError(f"{url} has no remote_accel metrics: is it a remote-accel-server's --metrics?")
    return samples


def _value(samples: dict, name: str, default=None, **labels):
    for have, value in samples.get(name, ()):
        if all(have.get(k) == v for k, v in labels.items()):
            return value
    return default


def _total(samples: dict, name: str) -> float:
    return sum(value for _, value in samples.get(name, ()))


def _by(samples: dict, name: str, label: str) -> dict:
    return {labels.get(label): value for labels, value in samples.get(name, ())}


def _rate(now: float, before: Optional[float], seconds: float) -> Optional[float]:
    if before is None or seconds <= 0 or now < before:  # a counter reset: a new client in the slot
        return None
    return (now - before) / seconds


# -- one frame --------------------------------------------------------------------------------------
def frame(url: str, now: dict, before: Optional[dict]) -> dict:
    """The figures of one frame: `now` a scrape, `before` the previous one (for rates)."""
    seconds = now["_at"] - before["_at"] if before else 0.0
    prev = before or {}

    def rate(name: str) -> Optional[float]:
        return _rate(_total(now, name), _total(prev, name) if before else None, seconds)

    infos = now.get("remote_accel_server_info")
    info = infos[0][0] if infos else {}
    device = {
        "name": info.get("device", "?"),
        "memory_allocated_bytes": _value(now, "remote_accel_device_memory_allocated_bytes"),
        "memory_used_bytes": _value(now, "remote_accel_device_memory_used_bytes"),
        "memory_total_bytes": _value(now, "remote_accel_device_memory_total_bytes"),
        "utilization": _value(now, "remote_accel_device_utilization_ratio"),
    }
    clients = []
    transports = {labels["client"]: labels.get("transport", "?") for labels, _ in now.get("remote_accel_client_info", ())}
    memory = _by(now, "remote_accel_memory_bytes", "client")
    starts = _by(now, "remote_accel_client_start_time_seconds", "client")
    old_starts = _by(prev, "remote_accel_client_start_time_seconds", "client")
    for slot, transport in sorted(transports.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0):
        same = before is not None and old_starts.get(slot) == starts.get(slot)  # not a new client in the slot

        def client_rate(name: str) -> Optional[float]:
            old = _value(prev, name, client=slot) if same else None
            return _rate(_value(now, name, 0, client=slot), old, seconds)

        clients.append({
            "client": int(slot) if slot.isdigit() else slot,
            "transport": transport,
            "memory_bytes": int(memory.get(slot, 0)),
            "ops_total": int(_value(now, "remote_accel_client_ops_total", 0, client=slot)),
            "ops_per_s": client_rate("remote_accel_client_ops_total"),
            "bytes_received_per_s": client_rate("remote_accel_client_bytes_received_total"),
            "bytes_sent_per_s": client_rate("remote_accel_client_bytes_sent_total"),
            "age_s": max(0.0, time.time() - starts[slot]) if slot in starts else None,
        })
    return {
        "server": url,
        "version": info.get("version", "?"),
        "device": device,
        "clients_connected": int(_value(now, "remote_accel_clients", 0)),
        "max_clients": int(_value(now, "remote_accel_max_clients", 0)),
        "memory_limit_bytes": int(_value(now, "remote_accel_memory_limit_bytes", 0)),
        "ops_total": int(_total(now, "remote_accel_ops_total")),
        "ops_per_s": rate("remote_accel_ops_total"),
        "batches_per_s": rate("remote_accel_batches_total"),
        "op_errors_total": int(_total(now, "remote_accel_op_errors_total")),
        "bytes_received_per_s": rate("remote_accel_bytes_received_total"),
        "bytes_sent_per_s": rate("remote_accel_bytes_sent_total"),
        "server_cpu_seconds": _value(now, "process_cpu_seconds_total"),
        "server_resident_bytes": _value(now, "process_resident_memory_bytes"),
        "interval_s": round(seconds, 3),
        "clients": clients,
    }


# -- drawing ----------------------------------------------------------------------------------------
def _size(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"


def _per_s(n: Optional[float], bytes_: bool = False) -> str:
    if n is None:
        return "-"
    return f"{_size(n)}/s" if bytes_ else f"{n:,.0f}"


def _age(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def render(f: dict) -> Group:
    d = f["device"]
    memory = "memory " + (f"{_size(d['memory_used_bytes'])} / {_size(d['memory_total_bytes'])}"
                          if d["memory_total_bytes"] is not None else "not reported")
    if d["memory_allocated_bytes"] is not None:
        memory += f" (tensors {_size(d['memory_allocated_bytes'])})"
    util = "-" if d["utilization"] is None else f"{100 * d['utilization']:.0f}%"
    head = Text.assemble(
        ("remote-accel-server ", "bold"), f"{f['version']} at {f['server']}\n",
        ("device ", "bold"), f"{d['name']}  {memory}  util {util}\n",
        ("clients ", "bold"), f"{f['clients_connected']}/{f['max_clients']}  ",
        ("ops/s ", "bold"), f"{_per_s(f['ops_per_s'])}  ",
        ("batches/s ", "bold"), f"{_per_s(f['batches_per_s'])}  ",
        ("rx ", "bold"), f"{_per_s(f['bytes_received_per_s'], True)}  ",
        ("tx ", "bold"), f"{_per_s(f['bytes_sent_per_s'], True)}  ",
        ("errors ", "bold"), f"{f['op_errors_total']}")
    table = Table(box=None, header_style="bold reverse", expand=False, pad_edge=False)
    for name in ("CLIENT", "TRANSPORT", "MEMORY", "OPS/S", "RX/S", "TX/S", "OPS", "AGE"):
        table.add_column(name, justify="left" if name in ("CLIENT", "TRANSPORT") else "right")
    for c in f["clients"]:
        table.add_row(str(c["client"]), c["transport"], _size(c["memory_bytes"]), _per_s(c["ops_per_s"]),
                      _per_s(c["bytes_received_per_s"], True), _per_s(c["bytes_sent_per_s"], True),
                      f"{c['ops_total']:,}", _age(c["age_s"]))
    if not f["clients"]:
        table.add_row("(no clients)", "", "", "", "", "", "", "")
    return Group(head, table)


# -- the command -------------------------------------------------------------------------------------
_interval = config.seconds_argument(0.1, 60)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ra-top", description=__doc__.split("\n\n")[1],
                                epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", type=url_of, default=url_of(config.DEFAULT_METRICS), metavar="HOST:PORT",
                   help="the server's metrics endpoint (its --metrics), port 1..65535, or its http:// URL "
                        f"(default: {config.DEFAULT_METRICS})")
    p.add_argument("--once", action="store_true", help="print one frame and exit (for scripts)")
    p.add_argument("--json", action="store_true",
                   help="JSON instead of a table: one object with --once, else one line per refresh")
    p.add_argument("--interval", type=_interval, default=1.0, metavar="SECONDS",
                   help="refresh period and the window of the rates, 0.1..60 (default: 1)")
    p.add_argument("--timeout", type=_interval, default=5.0, metavar="SECONDS",
                   help="how long one read of the endpoint may take, 0.1..60 (default: 5)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.once:
            before = scrape(args.server, args.timeout)
            time.sleep(args.interval)
            _show(args, frame(args.server, scrape(args.server, args.timeout), before), indent=1)
        else:
            _live(args)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except KeyboardInterrupt:
        pass
    except RemoteAccelError as exc:
        print(f"ra-top: {exc}", file=sys.stderr)
        return 1
    return 0


def _show(args, f: dict, indent=None) -> None:
    if args.json:
        sys.stdout.write(json.dumps(f, indent=indent) + "\n")
    else:
        Console().print(render(f))


def _live(args) -> None:
    """Redraw in place on a terminal (rich Live); elsewhere one frame after another. A
    server that goes away is shown as unreachable, and the view goes on trying."""
    console = Console()
    before = scrape(args.server, args.timeout)  # the first failure ends it: a wrong address says so
    live = Live(console=console, auto_refresh=False, transient=False) if console.is_terminal and not args.json else None
    with live or contextlib.nullcontext():
        while True:
            time.sleep(args.interval)
            try:
                now = scrape(args.server, args.timeout)
            except ScrapeError as exc:
                view, before = Text(f"ra-top: {exc}; retrying", style="bold red"), None
                if args.json:
                    print(f"ra-top: {exc}; retrying", file=sys.stderr)
            else:
                f, before = frame(args.server, now, before), now
                if args.json:
                    sys.stdout.write(json.dumps(f) + "\n")
                    sys.stdout.flush()
                    continue
                view = render(f)
            if live is not None:
                live.update(view, refresh=True)
            elif not args.json:
                console.print(view)


if __name__ == "__main__":
    sys.exit(main())
