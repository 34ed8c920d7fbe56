"""An echo/sink peer: the far end for transport conformance tests and benchmarks.

ECHO is answered by ECHO_REPLY with the same meta and payloads, SINK is only counted,
GOODBYE makes the peer close the link. Run it as a process:

    python -m remote_accel.dataplane.echo --transport tcp --listen 127.0.0.1:0

It prints `READY <address>` on stdout once it accepts connections.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading

from ..errors import PeerGone, ProtocolError, TransportClosed, TransportTimeout
from .transport import Listener, Transport
from .wire import MsgType

log = logging.getLogger(__name__)


def serve(transport: Transport, stop: threading.Event | None = None, poll_s: float = 0.5) -> dict:
    """Answer one peer until it says GOODBYE, goes away, or `stop` is set. Returns counters."""
    counts = {"echo": 0, "sink": 0, "sink_bytes": 0, "other": 0}
    try:
        while stop is None or not stop.is_set():
            try:
                msg = transport.recv(timeout=poll_s)
            except TransportTimeout:
                continue
            if msg.type == MsgType.ECHO:
                transport.send(MsgType.ECHO_REPLY, msg.meta, msg.payloads, req_id=msg.req_id, flags=msg.flags)
                counts["echo"] += 1
            elif msg.type == MsgType.SINK:
                counts["sink"] += 1
                counts["sink_bytes"] += sum(memoryview(p).nbytes for p in msg.payloads)
            elif msg.type == MsgType.GOODBYE:
                break
            else:
                counts["other"] += 1
    except (PeerGone, TransportClosed, ProtocolError) as exc:
        log.info("echo peer %s ended: %s", transport.peer, exc)
    finally:
        transport.close()
    return counts


def serve_forever(listener: Listener, stop: threading.Event | None = None) -> None:
    """Accept clients one after another, each served on its own thread."""
    while stop is None or not stop.is_set():
        try:
            transport = listener.accept(timeout=0.5)
        except TransportTimeout:
            continue
        except TransportClosed:
            return
        threading.Thread(target=serve, args=(transport, stop), daemon=True).start()


def _make_listener(args) -> Listener:
    if args.transport == "tcp":
        from ..config import parse_host_port
        from .tcp import TcpListener

        host, port = parse_host_port(args.listen)
        if args.tls_cert:
            from .tls import TlsListener, server_context

            return TlsListener(host, port, tls=server_context(args.tls_cert, args.tls_key))
        return TcpListener(host, port)
    from .connect import listen  # the DPDK listener needs its EAL arguments

    return listen("dpdk", port=args.port, eal_args=args.eal_args)


def main(argv=None) -> int:
    from .eal_args import split_eal

    eal_args, argv = split_eal(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m remote_accel.dataplane.echo", description=__doc__)
    parser.add_argument("--transport", choices=("tcp", "dpdk"), default="tcp")
    parser.add_argument("--listen", default="127.0.0.1:0", help="TCP address (default 127.0.0.1:0, any free port)")
    parser.add_argument("--port", type=int, default=None,
                        help="DPDK port id (default: every memif server interface, else every port); "
                             "EAL options go before '--', e.g. --vdev=net_af_packet0,iface=veth1 --")
    parser.add_argument("--tls-cert", default=None, metavar="PATH", help="TCP over TLS with this certificate")
    parser.add_argument("--tls-key", default=None, metavar="PATH", help="the key of --tls-cert")
    args = parser.parse_args(argv)
    args.eal_args = eal_args or None
    logging.basicConfig(level=logging.INFO, format="echo: %(message)s", stream=sys.stderr)
    listener = _make_listener(args)
    print(f"READY {listener.address}", flush=True)
    try:
        serve_forever(listener)
    except KeyboardInterrupt:
        pass
    finally:
        listener.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
