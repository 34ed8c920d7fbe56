"""The metrics endpoint: Prometheus text at http://HOST:PORT/metrics, and nothing else.

prometheus_client's own start_http_server is a stdlib ThreadingWSGIServer: a thread per
connection, no timeout and no cap, so a client that opens connections and never
finishes its request (slowloris) piles up threads for ever, and a header may be 64 KiB
a line. A scrape is one small GET, so this server bounds everything a peer controls:
at most MAX_CONNECTIONS at once (more are closed at once), a request head of at most
MAX_REQUEST_HEAD bytes that must arrive within REQUEST_DEADLINE_S, one request per
connection, GET or HEAD of /metrics only. The text itself is prometheus_client's.
"""

from __future__ import annotations

import io
import logging
import socket
import socketserver
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 8
MAX_REQUEST_HEAD = 8 << 10
#: The whole request head must arrive within this long (not per read: a byte every few
#: seconds would otherwise hold a connection for days); also the limit of each send.
REQUEST_DEADLINE_S = 5.0
_REFUSALS = {
    408: b"HTTP/1.0 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    431: b"HTTP/1.0 431 Request Header Fields Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
}


class _Handler(BaseHTTPRequestHandler):
    server: "MetricsServer"
    timeout = REQUEST_DEADLINE_S
    protocol_version = "HTTP/1.0"  # one request per connection: nothing to keep alive
    server_version = "remote-accel-metrics"
    sys_version = ""
    default_request_version = "HTTP/1.0"  # errors for a request line without one get a status line
    error_content_type = "text/plain; charset=utf-8"
    error_message_format = "%(code)d %(message)s: %(explain)s\n"

    def setup(self) -> None:
        super().setup()
        self.refusal: Optional[int] = None
        try:
            head = self._read_head()
        except _Refused as exc:
            self.refusal, head = exc.status, b""
        self.rfile.close()  # the parser reads the bounded head, never the socket
        self.rfile = io.BytesIO(head)

    def _read_head(self) -> bytes:
        sock = self.connection
        deadline = time.monotonic() + REQUEST_DEADLINE_S
        head = bytearray()
        while b"\r\n\r\n" not in head and b"\n\n" not in head:
            if len(head) > MAX_REQUEST_HEAD:
                raise _Refused(431)
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Refused(408)
            sock.settimeout(left)
            try:
                chunk = sock.recv(4096)
            except (socket.timeout, TimeoutError):
                raise _Refused(408) from None
            if not chunk:  # the peer stopped sending: parse what came (nothing: no answer)
                break
            head += chunk
        if len(head) > MAX_REQUEST_HEAD:
            raise _Refused(431)
        sock.settimeout(self.timeout)
        return bytes(head)

    def handle(self) -> None:
        if self.refusal is not None:
            log.debug("metrics: refused %s: %d", self.client_address[0], self.refusal)
            self.wfile.write(_REFUSALS[self.refusal])
            return
        super().handle()

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        if urlsplit(self.path).path != "/metrics":
            self.send_error(404, "Not Found", "the metrics are at /metrics")
            return
        try:
            encoder, content_type = choose_encoder(self.headers.get("Accept"))
            output = encoder(self.server.registry)
        except Exception:  # a bug in collecting: the scrape fails, the server goes on
            log.exception("metrics: collecting failed")
            self.send_error(500, "Internal Server Error")
            return
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(output)))
        self.end_headers()
        if body:
            self.wfile.write(output)

    def log_message(self, format: str, *args) -> None:
        log.debug("metrics: %s %s", self.client_address[0], format % args)


class _Refused(Exception):
    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


class MetricsServer(ThreadingHTTPServer):
    """Binds at once (so a bad address fails before anything else starts); serves after
    start(registry), in threads of its own."""

    daemon_threads = True
    request_queue_size = 64  # socketserver's 5 makes a burst of connections wait for SYN retries

    def __init__(self, host: str, port: int, max_connections: int = MAX_CONNECTIONS):
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
        self.address_family = family
        self.registry: Optional[CollectorRegistry] = None
        self._open = threading.BoundedSemaphore(max_connections)
        self._thread: Optional[threading.Thread] = None
        super().__init__(address[:2], _Handler)

    def server_bind(self) -> None:
        # HTTPServer's own looks the host up in DNS (getfqdn), which can stall for seconds.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"

    def start(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="metrics http", daemon=True)
        self._thread.start()

    def process_request(self, request, client_address) -> None:
        if not self._open.acquire(blocking=False):
            log.debug("metrics: dropping %s: %d connections open", client_address[0], MAX_CONNECTIONS)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._open.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._open.release()

    def handle_error(self, request, client_address) -> None:
        # socketserver prints a traceback to stderr; a peer that hung up is not worth one
        log.debug("metrics: request from %s failed: %r", client_address[0], sys.exc_info()[1])

    def close(self) -> None:
        if self._thread is not None:
            self.shutdown()
            self._thread.join()
        self.server_close()
