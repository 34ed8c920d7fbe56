"""remote-accel-server [EAL options] -- [options]

Serves remote_accel clients over TCP and/or DPDK, executing their ops on one torch
device. EAL options (DPDK's own, as in dpdk-testpmd) come before `--`; without `--`
every argument is a server option.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
from typing import Optional

from .. import config  # noqa: E402 (after the environment is set)
from .._version import __version__
from ..errors import ConfigError, RemoteAccelError
from ..dataplane.eal_args import split_eal
from . import cpu_threads

log = logging.getLogger("remote_accel.server")

TRANSPORTS = ("tcp", "dpdk")
MAX_PORT_ID = 1023  # RTE_MAX_ETHPORTS in Debian's DPDK 22.11 build


def parse_size(text: str) -> int:
    try:
        return config.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_transports(text: str) -> tuple:
    names = tuple(dict.fromkeys(t.strip().lower() for t in text.split(",") if t.strip()))
    if not names or any(n not in TRANSPORTS for n in names):
        raise argparse.ArgumentTypeError(f"bad transport {text!r}: expected tcp, dpdk or tcp,dpdk")
    return names


def parse_listen(text: str) -> tuple:
    """HOST:PORT, where port 0 picks a free port (config.parse_host_port refuses 0)."""
    host, sep, port = text.rpartition(":")
    try:
        if sep and port == "0" and not host.endswith(":"):
            return config.parse_host_port(host)[0], 0
        return config.parse_host_port(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_metrics(text: str) -> tuple:
    """HOST:PORT or a bare PORT (then on 127.0.0.1: metrics stay local unless told otherwise)."""
    text = text.strip()
    if text.isdigit():
        text = f"{config.DEFAULT_METRICS_HOST}:{text}"
    try:
        host, port = config.parse_host_port(text, default_port=config.DEFAULT_METRICS_PORT)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return host, port


def _int_range(lo: int, hi: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is outside {lo}..{hi}")
        return value

    return parse


def parse_namespaces(text: str) -> Optional[dict]:
    """'auto' -> None (the default libraries that import); 'none' -> {} (aten only);
    'torchvision,mylib=my_pkg.ops' -> {namespace: module whose import registers its ops}."""
    from .ops import MODULE, NAMESPACE

    text = text.strip()
    if text == "auto":
        return None
    if text in ("none", ""):
        return {}
    namespaces = {}
    for item in text.split(","):
        namespace, sep, module = item.strip().partition("=")
        module = module if sep else namespace
        if not NAMESPACE.match(namespace) or not MODULE.match(module):
            raise argparse.ArgumentTypeError(f"bad op namespace {item.strip()!r}: expected NAMESPACE or NAMESPACE=MODULE")
        namespaces[namespace] = module
    return namespaces


_seconds = config.seconds_argument(0.1, 86400)


def build_parser() -> argparse.ArgumentParser:
    from .service import DEFAULT_HEARTBEAT_TIMEOUT_S, DEFAULT_MAX_CLIENTS

    p = argparse.ArgumentParser(
        prog="remote-accel-server", usage="remote-accel-server [EAL options] -- [options]",
        description="Execute remote_accel clients' PyTorch ops on this host's device.",
        epilog="With --transport dpdk and no EAL options, the server is a local memif server on "
               f"{config.default_memif_socket()}, which `remote_accel.init(transport=\"dpdk\", port=0)` "
               "on this host finds by itself. Exit status: 0 after SIGINT/SIGTERM, 2 for bad options, "
               "3 when the device failed for good (a CUDA device-side assert): restart the server then.")
    p.add_argument("--transport", type=parse_transports, default=("tcp",), metavar="tcp|dpdk|tcp,dpdk",
                   help="which clients to serve; tcp,dpdk serves both at once (default: tcp)")
    p.add_argument("--listen", type=parse_listen, default=parse_listen(config.DEFAULT_TCP_SERVER),
                   metavar="HOST:PORT", help="TCP address, port 0..65535, 0 picks a free one "
                                             f"(default: {config.DEFAULT_TCP_SERVER})")
    p.add_argument("--port", type=_int_range(0, MAX_PORT_ID), default=None, metavar="N",
                   help=f"DPDK port id (of those the EAL options create) to serve, 0..{MAX_PORT_ID} "
                        "(default: every memif server port, else every port)")
    p.add_argument("--device", default="auto", metavar="auto|cpu|cuda[:N]|mps|xpu[:N]",
                   help="torch device to execute on; auto picks cuda, then xpu, then mps, else cpu (default: auto)")
    p.add_argument("--token-file", default=None, metavar="PATH",
                   help="file holding the shared token, created (mode 0600) if absent "
                        f"(default: {config.default_token_file()})")
    p.add_argument("--memory-limit", type=parse_size, default=0, metavar="BYTES",
                   help="bytes each client may hold on the device, suffixes K, M, G, T (binary) accepted; "
                        "0: no limit but the device's own memory (default: 0)")
    p.add_argument("--device-memory", type=parse_size, default=0, metavar="BYTES",
                   help="bytes of the device that all clients' tensors together may take, suffixes as "
                        "--memory-limit; 0: all the device has (on a CPU server: the machine's RAM) (default: 0)")
    p.add_argument("--swap-space", type=parse_size, default=0, metavar="BYTES",
                   help="host memory for tensors swapped out when --device-memory is full (pinned on CUDA), "
                        "suffixes as --memory-limit; 0: no swapping, a full device is out of memory (default: 0)")
    p.add_argument("--max-clients", type=_int_range(1, 4096), default=DEFAULT_MAX_CLIENTS, metavar="N",
                   help="clients served at once, over every transport, 1..4096; with --transport dpdk "
                        "and no EAL options also the local memif client slots, at most 32 (DPDK's "
                        f"ports per process) (default: {DEFAULT_MAX_CLIENTS})")
    p.add_argument("--heartbeat-timeout", type=_seconds, default=DEFAULT_HEARTBEAT_TIMEOUT_S, metavar="SECONDS",
                   help="a client that sends nothing for this long is dropped and its memory freed, "
                        f"0.1..86400 (default: {DEFAULT_HEARTBEAT_TIMEOUT_S:.0f})")
    p.add_argument("--tls-cert", default=None, metavar="PATH",
                   help="PEM certificate (chain) for TCP clients: TCP then speaks TLS only; needs --tls-key")
    p.add_argument("--tls-key", default=None, metavar="PATH", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", default=None, metavar="PATH",
                   help="mutual TLS: TCP clients must present a certificate signed by this CA")
    p.add_argument("--insecure", action="store_true",
                   help="allow TCP without TLS on an address that is not loopback (a network you trust)")
    p.add_argument("--metrics", type=parse_metrics, nargs="?", const=parse_metrics(config.DEFAULT_METRICS),
                   default=None, metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics; a bare PORT listens on "
                        f"{config.DEFAULT_METRICS_HOST}, port 0..65535, 0 picks a free one; --metrics alone: "
                        f"{config.DEFAULT_METRICS} (default: off)")
    p.add_argument("--op-namespaces", type=parse_namespaces, default=None, metavar="auto|none|NS[=MODULE],...",
                   help="libraries whose registered ops (NS::op, e.g. torchvision::nms) clients may run besides "
                        "aten; each is imported at start-up (MODULE, default NS) and must import, or the server "
                        "exits with status 2. auto: torchvision where it imports; none: aten only (default: auto)")
    p.add_argument("--threads", type=_int_range(1, 4096), default=None, metavar="N",
                   help="CPU threads for the device's kernels (torch's intra-op threads), 1..4096; an "
                        "OMP_NUM_THREADS the server starts with counts as this. On a host shared with its "
                        "clients fewer threads than cores run small models much faster (default: torch's, as "
                        "in a local process, so that a CPU server computes what local CPU computes)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="(default: info)")
    p.add_argument("--version", action="version", version=f"remote-accel-server {__version__}")
    return p


def check_tls(args) -> Optional[str]:
    """Why these TLS options cannot start a server, or None."""
    if bool(args.tls_cert) != bool(args.tls_key):
        return "--tls-cert and --tls-key go together"
    if args.tls_client_ca and not args.tls_cert:
        return "--tls-client-ca needs --tls-cert and --tls-key (the server's own TLS identity)"
    host = args.listen[0]
    if "tcp" in args.transport and not args.tls_cert and not args.insecure and not is_loopback(host):
        return (f"refusing to serve TCP on {host} without TLS: tokens stay secret (challenge-response), but "
                "tensors and ops would cross the network in clear and could be changed on the way.\n"
                "  Give the server a certificate: --tls-cert server.crt --tls-key server.key, e.g. a self-signed pair:\n"
                "    openssl req -x509 -newkey rsa:2048 -nodes -days 365 -keyout server.key -out server.crt \\\n"
                f"      -subj /CN={host} -addext subjectAltName=DNS:$(hostname),IP:<this host's address>\n"
                "  and give clients the certificate to check it by: remote_accel.init(..., tls_ca=\"server.crt\") "
                "or REMOTE_ACCEL_TLS_CA=server.crt (README, section Security).\n"
                "  Or pass --insecure on a network you trust.")
    return None


def is_loopback(host: str) -> bool:
    """True when every address `host` names is a loopback one (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def open_listeners(args, eal: list) -> list:
    listeners = []
    if "dpdk" in args.transport:
        listeners.append(_dpdk_listener(args.port, eal, args.max_clients))
    elif eal:
        log.warning("EAL options ignored: DPDK is not among the transports (%s)", ",".join(args.transport))
    if args.tls_cert and "tcp" not in args.transport:
        log.warning("TLS options ignored: they apply to TCP, which is not among the transports")
    if "tcp" in args.transport:
        from ..dataplane.tcp import TcpListener
        from ..dataplane.tls import TlsListener, server_context

        host, port = args.listen
        try:
            if args.tls_cert:
                tls = server_context(args.tls_cert, args.tls_key, args.tls_client_ca)
                listeners.append(TlsListener(host, port, tls=tls))
            else:
                listeners.append(TcpListener(host, port))
        except ConfigError:
            for listener in listeners:
                listener.close()
            raise
        except OSError as exc:
            for listener in listeners:
                listener.close()
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return listeners


def open_metrics(address: Optional[tuple]):
    """The metrics endpoint, bound but not serving yet; None without --metrics."""
    if address is None:
        return None
    try:
        from .metrics_http import MetricsServer
    except ImportError as exc:
        raise ConfigError(f"--metrics needs prometheus_client ({exc}): pip install 'remote_accel[server]'") from None
    host, port = address
    try:
        return MetricsServer(host, port)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None


def _say(line: str) -> None:
    """A line for whoever started the server (tests read the addresses from it)."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        pass


def _dpdk_listener(port: Optional[int], eal: list, max_clients: int):
    from ..errors import UnavailableError

    try:
        from ..dataplane.dpdk import DpdkListener
    except ImportError as exc:  # UnavailableError is one: the shim is not built, or DPDK is absent
        raise UnavailableError(f"--transport dpdk is not available here ({exc}); use --transport tcp") from None
    # No --port: every memif server interface of the default EAL arguments (one per client
    # slot, min(max_clients, 32) of them), or every port the user's EAL options create.
    return DpdkListener(ports=None if port is None else [port], eal_args=eal or None, max_clients=max_clients)


def main(argv: Optional[list] = None) -> int:
    eal, options = split_eal(sys.argv[1:] if argv is None else list(argv))
    args = build_parser().parse_args(options)
    why = check_tls(args)
    if why is not None:
        print(f"remote-accel-server: {why}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    intra_op_threads, threads_from = cpu_threads.choose(args.threads)
    cpu_threads.apply_before_torch(intra_op_threads)
    # torch loads only now, so that --help and bad options answer at once.
    import torch

    from . import auth, heap, ops
    from .device import ComputeDevice, parse_device
    from .service import Server

    token_file = args.token_file or config.default_token_file()
    metrics = None
    try:
        namespaces = ops.enable_namespaces(args.op_namespaces)
        device = ComputeDevice(parse_device(args.device))
        token = auth.load_or_create(token_file)
        metrics = open_metrics(args.metrics)
        listeners = open_listeners(args, eal)
    except RemoteAccelError as exc:
        if metrics is not None:
            metrics.close()
        print(f"remote-accel-server: {exc}", file=sys.stderr)
        return 2
    server = Server(device, token, memory_limit=args.memory_limit, max_clients=args.max_clients,
                    heartbeat_timeout=args.heartbeat_timeout, device_memory=args.device_memory,
                    swap_space=args.swap_space, tls_identity=(args.tls_cert, args.tls_key) if args.tls_cert else None)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if intra_op_threads is not None:
        torch.set_num_threads(intra_op_threads)  # where torch was loaded before main() (in-process callers)
    bernoulli = _install_cpu_kernels()
    malloc = heap.keep_freed_memory()
    pool = server.pool.figures()
    # one INFO line a start: what an operator needs to know; the details at DEBUG
    log.info("remote-accel-server %s on %s (%s): %d CPU threads, memory limit per client %d bytes, device memory "
             "%d bytes for all clients, swap space %d bytes, at most %d clients, op namespaces %s", __version__,
             device.name, device.properties()["name"], torch.get_num_threads(), server.session_limit, pool[0],
             pool[1], args.max_clients, ",".join(namespaces))
    if not device.accelerator:  # what a CPU server's speed beside its clients depends on, and why
        log.info("CPU threads: %s; between ops they %s", cpu_threads.why(threads_from), cpu_threads.wait_policy())
    log.debug("token file %s; CPU bernoulli_: %s; %s", token_file, bernoulli, malloc)
    if metrics is not None:
        from .metrics import registry

        metrics.start(registry(server))
        _say(f"serving metrics at {metrics.url}")
    server.serve(*listeners)
    for listener in listeners:
        _say(f"listening on {listener.address}{' (TLS)' if getattr(listener, 'tls', False) else ''}")
    while not stop.wait(0.2):  # short waits: signal handlers run between them
        pass
    log.info("shutting down")
    if metrics is not None:
        metrics.close()
    server.shutdown()
    log.info("stopped")
    return 0


def _install_cpu_kernels() -> str:
    """The server's own CPU kernels, which give torch's numbers faster (csrc/cpu_bernoulli.cpp:
    dropout's masks); REMOTE_ACCEL_SERVER_CPU_BERNOULLI=0 keeps torch's (to compare).
    Returns whose bernoulli_ kernel runs, for the log."""
    if not config.enabled("REMOTE_ACCEL_SERVER_CPU_BERNOULLI"):
        return "torch's kernel (REMOTE_ACCEL_SERVER_CPU_BERNOULLI=0)"
    from . import native

    return native.install_cpu_bernoulli() or "torch's kernel (torch draws with MKL on this CPU)"


if __name__ == "__main__":
    sys.exit(main())
