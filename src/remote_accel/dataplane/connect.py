"""Choosing a transport: explicit argument, then environment, then the best available.

    t = connect()                         # DPDK to the local server if it runs, else TCP
    t = connect("tcp", server="gpu-host:18515")
    lst = listen("dpdk")                  # memif server interfaces, default EAL arguments

Environment: REMOTE_ACCEL_TRANSPORT (auto|tcp|dpdk), REMOTE_ACCEL_SERVER (host:port for
TCP), REMOTE_ACCEL_EAL_ARGS (EAL arguments, shell syntax). Every fallback from DPDK to
TCP is logged with its reason, once per process and reason: at INFO where TCP is simply
what there is (no DPDK server on this host, DPDK not built), as a WARNING where a DPDK
server exists but could not be used (full, or its connect failed): that the user can fix.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from .. import config
from ..errors import ConfigError, DpdkError, PeerGone, UnavailableError
from .transport import Listener, Transport

log = logging.getLogger(__name__)
TRANSPORTS = ("auto", "tcp", "dpdk")
_said: set[str] = set()  # fallback reasons already logged by this process


def _resolve(transport: Optional[str], eal_args) -> tuple[str, Optional[list]]:
    choice = config.transport(transport)
    if choice not in TRANSPORTS:
        raise ConfigError(f"transport must be one of {', '.join(TRANSPORTS)}, not {choice!r}")
    return choice, config.eal_args(eal_args)


def _tcp_connect(server: Optional[str], timeout: float, tls=None, **kwargs) -> Transport:
    from .tcp import TcpTransport

    host, port = config.parse_host_port(server or config.setting(config.ENV_SERVER) or config.DEFAULT_TCP_SERVER)
    if tls is not None:
        from .tls import TlsTransport

        return TlsTransport.connect(host, port, timeout=timeout, tls=tls, **kwargs)
    return TcpTransport.connect(host, port, timeout=timeout, **kwargs)


def connect(transport: Optional[str] = "auto", server: Optional[str] = None, port: int = 0,
            eal_args=None, timeout: float = config.DEFAULT_TIMEOUT_S, **kwargs) -> Transport:
    """A transport to the server. `port` is the DPDK port id; `server` the TCP address.

    "auto" tries DPDK when it is built and a local memif server runs (or EAL arguments
    name a device), else TCP; "dpdk" and "tcp" never fall back. `tls` (an SSLContext,
    `tls.client_context`) makes TCP speak TLS; DPDK links stay plain text.
    """
    choice, eal_args = _resolve(transport, eal_args)
    if choice == "tcp":
        return _tcp_connect(server, timeout, **kwargs)
    if kwargs.get("tls") is not None:
        log.info("TLS applies to TCP only: a DPDK link stays plain text (a trusted L2 fabric)")
    if choice == "dpdk":
        from .dpdk import DpdkTransport

        return DpdkTransport.connect(port=port, eal_args=eal_args, timeout=timeout)
    reason, level = _dpdk_unusable(eal_args), logging.INFO
    if reason is None:
        try:
            from .dpdk import DpdkTransport

            return DpdkTransport.connect(port=port, eal_args=eal_args, timeout=timeout)
        except (PeerGone, DpdkError, ConfigError) as exc:
            reason, level = f"DPDK connect failed: {exc}", logging.WARNING
    if reason not in _said:
        _said.add(reason)
        log.log(level, "transport auto: using TCP, not DPDK (%s)", reason)
    return _tcp_connect(server, timeout, **kwargs)


def _dpdk_unusable(eal_args) -> Optional[str]:
    """Why "auto" should not even try DPDK, or None. Without EAL arguments DPDK means
    the local memif server: it must be listening (checked without starting EAL)."""
    try:
        from . import dpdk  # noqa: F401  (built and loadable?)
    except UnavailableError as exc:
        return str(exc)
    if eal_args:
        return None  # the caller named a device: try it
    from .eal_args import memif_socket_in_use

    if not memif_socket_in_use(config.default_memif_socket()):
        return f"no DPDK server listens on {config.default_memif_socket()}"
    return None


def listen(transport: Optional[str] = "auto", address: Optional[str] = None,
           port: Optional[int] = None, eal_args=None, **kwargs) -> Listener:
    """A listener: TCP on `address` (host:port), or DPDK on `port` (None: every memif
    server interface of the default EAL arguments)."""
    choice, eal_args = _resolve(transport, eal_args)
    if choice in ("dpdk", "auto"):
        try:
            from .dpdk import DpdkListener

            return DpdkListener(None if port is None else [port], eal_args=eal_args, **kwargs)
        except (UnavailableError, DpdkError, ConfigError) as exc:
            if choice == "dpdk":
                raise
            log.warning("transport auto: listening on TCP, not DPDK (%s)", exc)
    from .tcp import TcpListener

    host, tcp_port = config.parse_host_port(address or config.DEFAULT_TCP_SERVER)
    return TcpListener(host, tcp_port)
