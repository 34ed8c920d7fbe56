"""ra-testpmd [EAL options] -- [options]: measure remote_accel's data plane, testpmd style.

Forward modes:
  txonly  send frames of --txpkts bytes on every port (raw burst API of the DPDK shim)
  rxonly  receive and count frames on every port
  io      forward what each port receives to its pair (0<->1, 2<->3; a lone port to itself)
  echo    ECHO messages of --size bytes, round trips timed (Transport API, DPDK or TCP)
  tensor  --size byte tensors written to and read back from a remote-accel-server

Examples:
  ra-testpmd --vdev=net_null0 -- --forward-mode txonly --duration 5
  ra-testpmd --vdev=net_ring0 -- --forward-mode io --tx-first
  ra-testpmd -- --forward-mode echo --peer server          (local server over memif)
  ra-testpmd -- --forward-mode tensor --size 16M --transport tcp --server 127.0.0.1:18515
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
import threading
import time

from .. import config
from ..errors import ConfigError, RemoteAccelError
from ..dataplane.eal_args import split_eal
from .pmd_stats import PortInfo, Sample, format_final, format_sample, port_json, rates
from .wire_layers import FRAME_HEADER_SIZE, FRAME_OVERHEAD

log = logging.getLogger("ra-testpmd")

RAW_MODES = ("txonly", "rxonly", "io")
MSG_MODES = ("echo", "tensor")
MAX_PORT_ID = 1023
_UNITS = {"": 0, "K": 10, "M": 20, "G": 30}


# -- option parsing --------------------------------------------------------------------------
def _ranged(kind, lo, hi, allow_zero=False):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not (lo <= value <= hi or (allow_zero and value == 0)):
            raise argparse.ArgumentTypeError(f"{text} is outside {lo}..{hi}")
        return value

    return parse


def _size(text: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in _UNITS else ""
    try:
        value = int(t[: len(t) - len(unit)]) << _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: a number of bytes, suffix K, M or G") from None
    if not 0 <= value <= 2 << 30:
        raise argparse.ArgumentTypeError(f"{text} is outside 0..2G bytes")
    return value


def _portlist(text: str) -> list:
    try:
        ports = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad port list {text!r}: expected e.g. 0,1") from None
    if not ports or any(not 0 <= p <= MAX_PORT_ID for p in ports):
        raise argparse.ArgumentTypeError(f"port ids must be in 0..{MAX_PORT_ID}")
    return ports


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ra-testpmd", usage="ra-testpmd [EAL options] -- [options]",
        description="Measure remote_accel's data plane, testpmd style. EAL options (DPDK's own: --vdev, -a, "
                    "--no-huge, -l ...) come before '--'; without '--' every argument is an option below.",
        epilog="\n\n".join(__doc__.split("\n\n")[1:]), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--forward-mode", choices=RAW_MODES + MSG_MODES, default="echo",
                   help="what to measure (default: echo)")
    p.add_argument("--transport", choices=("dpdk", "tcp"), default="dpdk",
                   help="echo/tensor: the link to the peer; txonly/rxonly/io are DPDK only (default: dpdk)")
    p.add_argument("--server", metavar="HOST:PORT", default=config.DEFAULT_TCP_SERVER,
                   help=f"--transport tcp: the peer's address, port 1..65535 (default: {config.DEFAULT_TCP_SERVER})")
    p.add_argument("--port", type=_ranged(int, 0, MAX_PORT_ID), default=0, metavar="N",
                   help=f"echo/tensor over DPDK: the port to the peer, 0..{MAX_PORT_ID} (default: 0, which "
                        "without EAL options is a memif client of the local server)")
    p.add_argument("--portlist", type=_portlist, default=None, metavar="N[,N...]",
                   help="txonly/rxonly/io: ports to use, each 0..1023 (default: every port the EAL options "
                        "create; none: net_null0 for txonly/rxonly, a net_ring pair for io)")
    p.add_argument("--peer", choices=("echo", "server", "local"), default=None,
                   help="echo/tensor: what answers: echo = `python -m remote_accel.dataplane.echo`, "
                        "server = remote-accel-server (HELLO with the token first), local = an echo peer "
                        "in this process over a ring pair or loopback TCP (default: echo for echo mode, "
                        "server for tensor mode)")
    p.add_argument("--token-file", metavar="PATH", default=None,
                   help=f"--peer server: the shared token (default: ${config.ENV_TOKEN}, else "
                        f"{config.default_token_file()})")
    p.add_argument("--txpkts", type=_ranged(int, FRAME_OVERHEAD + 1, 16384), default=128, metavar="BYTES",
                   help=f"txonly/io: frame length with Ethernet, IPv4, UDP and our {FRAME_HEADER_SIZE}-byte header "
                        f"({FRAME_OVERHEAD} bytes) included, {FRAME_OVERHEAD + 1}..16384, at most the port's largest "
                        "frame (default: 128)")
    p.add_argument("--burst", type=_ranged(int, 1, 1024), default=None, metavar="N",
                   help="txonly/io: frames per call into the shim; echo/tensor: requests in flight; 1..1024 "
                        "(default: 32 for txonly/io, 1 for echo/tensor)")
    p.add_argument("--size", type=_size, default=None, metavar="BYTES",
                   help="echo/tensor: payload bytes per request, 0..2G, suffixes K, M, G (binary) "
                        "(default: 64 for echo, 1M for tensor)")
    p.add_argument("--duration", type=_ranged(float, 0.1, 86400), default=10.0, metavar="SECONDS",
                   help="how long to run, 0.1..86400 (default: 10)")
    p.add_argument("--stats-period", type=_ranged(float, 0.1, 3600, allow_zero=True), default=1.0,
                   metavar="SECONDS", help="print statistics this often, 0.1..3600, 0: only at the end; "
                                           "redrawn in place on a terminal (default: 1)")
    p.add_argument("--tx-first", action="store_true", help="io: send one burst on every port first, "
                   "so that a loopback (net_ring0, or a ring pair) has something to forward")
    p.add_argument("--busy-poll", action="store_true",
                   help="echo/tensor over DPDK: never sleep waiting for frames (lowest latency; burns a core)")
    p.add_argument("--verify", action="store_true", help="echo/tensor: check every reply holds the bytes sent")
    p.add_argument("--json", action="store_true",
                   help="one JSON document on stdout at the end (periodic samples inside), no text blocks")
    p.add_argument("-v", "--verbose", action="store_true", help="log what is set up, on stderr")
    return p


# -- runners -------------------------------------------------------------------------------------
def _has_port(eal: list) -> bool:
    return any(a.split("=")[0] in ("--vdev", "-a", "--allow") or a.startswith("--vdev") for a in eal)


def make_raw_runner(args, eal: list):
    from ..dataplane import dpdk
    from ..dataplane.dpdk_eal import dpdk_error
    from .pmd_raw import RawRunner

    dpdk.ensure_eal(eal or None, role="local")
    if args.portlist is not None:
        ports = args.portlist
    elif _has_port(eal) or dpdk.port_count():
        ports = list(range(dpdk.port_count()))
        if not ports:  # a --vdev/-a whose driver made no port (a missing interface, say): say so
            raise dpdk_error(errno.ENODEV, f"no DPDK port: the EAL options made none ({' '.join(eal)}); "
                                           "the EAL's own log above says why")
    elif args.forward_mode == "io":
        ports = list(dpdk.ring_pair(raw=True))
        args.tx_first = True
        log.warning("no port given: io over a net_ring pair in this process, with --tx-first")
    else:
        ports = [dpdk.add_vdev("net_null0")]
        log.warning("no port given: %s on net_null0", args.forward_mode)
    return RawRunner(args.forward_mode, ports, args.txpkts, args.burst or 32, args.tx_first)


def _local_peer(args, eal: list):
    """Our end of a link to an echo peer served by a thread of this process."""
    from ..dataplane import echo

    stop = threading.Event()
    if args.transport == "dpdk":
        from ..dataplane.dpdk import ChannelOptions, DpdkTransport, ensure_eal

        ensure_eal(eal or None, role="local")  # the ring pair needs no memif of the defaults
        ours, theirs = DpdkTransport.pair(options=ChannelOptions(busy_poll=args.busy_poll))
        threading.Thread(target=echo.serve, args=(theirs, stop), daemon=True).start()
    else:
        from ..dataplane.tcp import TcpListener, TcpTransport

        listener = TcpListener("127.0.0.1", 0)
        threading.Thread(target=echo.serve_forever, args=(listener, stop), daemon=True).start()
        ours = TcpTransport.connect("127.0.0.1", listener.port)
    return ours, stop


def _token(args) -> str:
    if args.token_file is None and config.setting(config.ENV_TOKEN):
        return config.setting(config.ENV_TOKEN)
    path = args.token_file or config.default_token_file()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the server's token from {path}: {exc.strerror} "
                          "(--token-file, or the server's own --token-file)") from None


def make_msg_runner(args, eal: list):
    from .pmd_msg import MessageRunner

    peer = args.peer or ("server" if args.forward_mode == "tensor" else "echo")
    size = args.size if args.size is not None else (1 << 20 if args.forward_mode == "tensor" else 64)
    stop = None
    if peer == "local":
        transport, stop = _local_peer(args, eal)
        peer = "echo"
    elif args.transport == "dpdk":
        from ..dataplane.dpdk import ChannelOptions, DpdkTransport

        transport = DpdkTransport.connect(port=args.port, eal_args=eal or None,
                                          options=ChannelOptions(busy_poll=args.busy_poll))
    else:
        from ..dataplane.tcp import TcpTransport

        host, port = config.parse_host_port(args.server)
        transport = TcpTransport.connect(host, port)
    info = PortInfo(args.port if args.transport == "dpdk" else 0, transport.peer, args.transport)
    try:
        return MessageRunner(args.forward_mode, transport, peer, size, args.burst or 1, args.verify,
                             token=_token(args) if peer == "server" else "", port_info=info,
                             on_stop=stop.set if stop is not None else None)
    except BaseException:
        transport.close()
        if stop is not None:
            stop.set()
        raise


# -- the run ---------------------------------------------------------------------------------------
def run(runner, args, out) -> dict:
    """Drive `runner` for --duration, printing periodic blocks; returns the JSON report."""
    tty = out.isatty() and not args.json
    samples: list[Sample] = []
    start = time.monotonic()
    end = start + args.duration
    period = args.stats_period
    last_c, last_t, last_lat = runner.snapshot(), start, 0
    runner.start()
    interrupted = False
    try:
        next_report = start + period if period else end
        while True:
            now = time.monotonic()
            if now >= end:
                break
            runner.poll(min(next_report, end))
            now = time.monotonic()
            if period and now >= next_report:
                c = runner.snapshot()
                lat = runner.latency(since=last_lat)
                sample = Sample(now - start, c, [rates(a - b, now - last_t) for a, b in zip(c, last_c)], lat)
                samples.append(sample)
                if not args.json:
                    out.write(("\033[H\033[2J" if tty else "") + format_sample(runner.info, sample, runner.unit))
                    out.flush()
                last_c, last_t = c, now
                last_lat = runner.latency_count()
                next_report += period
    except KeyboardInterrupt:
        interrupted = True  # like testpmd's quit: stop and print what was measured
    finally:
        seconds = time.monotonic() - start  # traffic time; replies still due are drained after
        runner.stop()
    totals = runner.snapshot()
    latency = runner.latency()
    if not args.json:
        out.write(format_final(runner.info, totals, seconds, latency, runner.unit))
    return {
        "mode": args.forward_mode, "transport": "dpdk" if args.forward_mode in RAW_MODES else args.transport,
        "unit": runner.unit, "duration_s": seconds, "interrupted": interrupted,
        "ports": [port_json(i, c, seconds) for i, c in zip(runner.info, totals)],
        "total": port_json(PortInfo(-1, "all"), sum(totals[1:], totals[0]), seconds),
        "latency_us": latency,
        "samples": [{"elapsed_s": s.elapsed, "rates": s.rates, "latency_us": s.latency} for s in samples],
        **runner.extra(),
    }


def main(argv=None) -> int:
    eal, options = split_eal(sys.argv[1:] if argv is None else list(argv))
    parser = build_parser()
    args = parser.parse_args(options)
    if args.forward_mode in RAW_MODES and args.transport != "dpdk":
        parser.error(f"--forward-mode {args.forward_mode} drives DPDK ports: it has no --transport tcp")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="ra-testpmd: %(message)s")
    try:
        runner = (make_raw_runner if args.forward_mode in RAW_MODES else make_msg_runner)(args, eal)
        report = run(runner, args, sys.stdout)
        if args.json:
            json.dump(report, sys.stdout, indent=1)
            sys.stdout.write("\n")
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (RemoteAccelError, ImportError) as exc:  # UnavailableError (no DPDK) is an ImportError
        print(f"ra-testpmd: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
