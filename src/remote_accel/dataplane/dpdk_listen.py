"""Where a DPDK server listens: its ports, each listening in one accept group of the shim,
and the memif slots it publishes for local clients while it listens.

By default a server listens on every memif server interface of its EAL (one per client
slot, memif_slots.py), after starting EAL with server defaults; explicit ports (a ring
pair's, a NIC's) listen as they are. The shim hands over each connection whose handshake
completed on one of them; DpdkListener (dpdk.py) wraps it in a DpdkTransport.
"""

from __future__ import annotations

import errno
from typing import Callable, Optional, Sequence

from ..errors import TransportClosed, TransportTimeout
from . import eal_args as _eal_args
from . import memif_slots
from .dpdk_eal import _check, _groups, _published, dpdk_error, ensure_eal, ffi, lib, port_count, port_name, setup_port


class ListenPorts:
    """The ports of one listener. `options(group)`: the channel options (a cdata struct,
    ChannelOptions.cdata) its connections start with, in that accept group.

    max_clients: the server's limit; its default EAL arguments get
    memif_slots.slots_for(max_clients) memif interfaces (None: DEFAULT_SLOTS), published
    for local clients (memif_slots.py) while the ports listen."""

    def __init__(self, ports: Optional[Sequence[int]], eal_args, options: Callable[[int], object],
                 max_clients: Optional[int] = None):
        slots = memif_slots.slots_for(max_clients) if max_clients else memif_slots.DEFAULT_SLOTS
        args = ensure_eal(eal_args, role="server", memif_slots=slots)
        vdevs = _eal_args.vdev_options(args)
        memif_servers = [p for p in range(port_count()) if vdevs.get(port_name(p), {}).get("role") == "server"]
        if ports is None:  # the memif server interfaces, else every port
            ports = memif_servers or list(range(port_count()))
        if not ports:
            raise dpdk_error(errno.ENODEV, f"no DPDK port to listen on (EAL args: {' '.join(args)})")
        self._group = next(_groups) % 16 or 1
        self._ports = list(ports)
        self._closed = False
        for p in self._ports:
            setup_port(p)
            _check(lib.shim_listen(p, options(self._group)), "listen", p)
        self.address = "dpdk:" + ",".join(port_name(p) for p in self._ports)
        self._sockets = self._publish([p for p in self._ports if p in memif_servers], vdevs, slots)

    @staticmethod
    def _publish(ports: list, vdevs: dict, slots: int) -> list:
        """Tell local clients how many memif slots each socket has (memif_slots.py)."""
        per_socket: dict[str, int] = {}
        for p in ports:
            sock = vdevs[port_name(p)].get("socket")
            if sock:
                per_socket[sock] = per_socket.get(sock, 0) + 1
        for sock, n in per_socket.items():
            limited_by = "max_clients" if n < memif_slots.MAX_SLOTS and n <= slots else "ports"
            memif_slots.publish(sock, n, limited_by)
            _published.add(sock)
        return list(per_socket)

    def accept(self, timeout: Optional[float] = None) -> tuple:
        """(the shim's connection, its port) of the next client. Raises TransportTimeout,
        TransportClosed, DpdkError."""
        if self._closed:
            raise TransportClosed("listener is closed")
        out = ffi.new("struct shim_conn **")
        rc = lib.shim_accept(self._group, -1 if timeout is None else int(timeout * 1e9), out)
        if rc == -errno.ETIMEDOUT:
            raise TransportTimeout(f"no client within {timeout} s")
        if rc == -errno.ESHUTDOWN:
            raise TransportClosed("listener is closed")
        _check(rc, "accept")
        info = ffi.new("struct shim_conn_info *")
        lib.shim_conn_info(out[0], info)
        return out[0], info.port

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for sock in self._sockets:
                memif_slots.unpublish(sock)
                _published.discard(sock)
            for p in self._ports:
                lib.shim_unlisten(p)
            lib.shim_accept_cancel(self._group)
