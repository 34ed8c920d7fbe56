"""Test helpers: a real server in a subprocess, and a protocol-level client for it.

The client speaks the wire protocol directly (no remote_accel device), so server tests
stay independent of the client device code; tools and end-to-end tests may use it too.

    with ServerProcess() as server, Client.tcp(*server.tcp, token=server.token) as c:
        x = c.upload(torch.randn(3))
        y = c.empty((3,), torch.float32)
        c.run("aten::add.Tensor", x, x, outs=(y,))
        print(c.download(y))
"""

from __future__ import annotations

import itertools
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any, NamedTuple, Optional

import torch
from prometheus_client.parser import text_string_to_metric_families

from ..dataplane import handshake
from ..dataplane import messages as m
from ..dataplane.codec import Ext
from ..dataplane.tcp import TcpTransport
from ..dataplane.tls import TlsTransport
from ..dataplane.transport import Transport
from ..dataplane.wire import MsgType
from ..torch_wire import values as torch_values
from .storage import span_bytes

_LISTENING = re.compile(r"listening on (\S+)")
_METRICS = re.compile(r"serving metrics at (\S+)")


def reference_device(server_device: str) -> str:
    """The local device a remote run is compared with: the server's own kind where this
    host has one too (the GPU check runs client and server on one machine), so that
    random streams and kernels are the same; CPU otherwise."""
    kind = server_device.split(":")[0]
    if kind != "cpu":
        import torch

        module = getattr(torch, kind, None)
        if module is not None and getattr(module, "is_available", lambda: False)():
            return kind
    return "cpu"


class ServerProcess:
    """`python -m remote_accel.server` on 127.0.0.1 with a free port and a private token.

    Its runtime folder (REMOTE_ACCEL_RUNTIME_DIR: the default memif socket and the memif
    client slots' lock files) is private too, so DPDK clients started with
    `env=server.client_env()` find this server and no other."""

    def __init__(self, *options: str, device: Optional[str] = None, eal: tuple = (),
                 token: str = "test-token", start_timeout: float = 180.0, env: Optional[dict] = None):
        # REMOTE_ACCEL_TEST_DEVICE=cuda runs every test's server (and the benchmarks') on a GPU.
        self.device = device or os.environ.get("REMOTE_ACCEL_TEST_DEVICE", "cpu")
        self._dir = tempfile.TemporaryDirectory(prefix="ra-server-")
        self.token = token
        self.token_file = os.path.join(self._dir.name, "token")
        with open(os.open(self.token_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(token)
        self.log_file = os.path.join(self._dir.name, "server.log")
        self.args = [sys.executable, "-m", "remote_accel.server", *eal, "--", "--listen", "127.0.0.1:0",
                     "--device", self.device, "--token-file", self.token_file, *options]
        self.addresses: list[str] = []
        self.metrics_url: Optional[str] = None  # with --metrics: http://HOST:PORT/metrics
        self._start_timeout = start_timeout
        self.runtime_dir = self._dir.name
        self._env = dict(os.environ, **self.client_env(), **(env or {}))
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> "ServerProcess":
        with open(self.log_file, "wb") as log:
            self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=log, env=self._env)
        deadline = time.monotonic() + self._start_timeout
        pending = b""
        expected = 2 if "tcp,dpdk" in self.args else 1
        while len(self.addresses) < expected:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                self.kill()
                raise RuntimeError(f"server did not start (rc {self.proc.returncode}):\n{self.log()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 0.5))
            if ready:
                pending += os.read(self.proc.stdout.fileno(), 4096)
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    text = line.decode(errors="replace")
                    match = _LISTENING.search(text)
                    if match:
                        self.addresses.append(match.group(1))
                    match = _METRICS.search(text)  # printed before the listeners' lines
                    if match:
                        self.metrics_url = match.group(1)
        return self

    def client_env(self) -> dict:
        """Environment variables for a client process of this server."""
        from .. import config

        return {config.ENV_RUNTIME_DIR: self.runtime_dir}

    @property
    def tcp(self) -> tuple[str, int]:
        for address in self.addresses:
            if address.startswith("tcp:"):
                host, _, port = address[4:].rpartition(":")
                return host, int(port)
        raise LookupError("the server has no TCP listener")

    def log(self) -> str:
        with open(self.log_file, errors="replace") as f:
            return f.read()

    def stop(self, timeout: float = 20.0) -> Optional[int]:
        """SIGTERM, then SIGKILL if it does not exit in time; returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc.stdout.close()
        return self.proc.returncode

    def restart(self) -> "ServerProcess":
        """Start again on the same addresses, as a supervisor (systemd's Restart=) would, after
        it died or was killed (the old process is killed first if it still runs)."""
        self.kill()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        if self.addresses and "--listen" in self.args:
            host, port = self.tcp
            self.args[self.args.index("--listen") + 1] = f"{host}:{port}"
        self.addresses = []
        return self.start()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self._dir.cleanup()


def wait_for(predicate, what: str, timeout: float = 60.0, every: float = 0.02):
    """Poll `predicate()` until it returns something true, and return that; an
    AssertionError naming `what` after `timeout` seconds. For a test that waits on an event
    (a counter, a log line, a socket's state) instead of sleeping for a fixed time: the
    deadline is generous, since on a loaded machine only the event says when to go on."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:g} s for {what}")
        time.sleep(every)


class TcpSocket(NamedTuple):
    """One IPv4 TCP socket of this host, as the kernel sees it (/proc/net/tcp)."""

    local_port: int
    remote_port: int
    state: str  # "ESTABLISHED", "CLOSE_WAIT", ... (TCP_STATES)
    tx_queue: int  # bytes sent and not yet acknowledged by the peer
    rx_queue: int  # bytes received and not yet read by the process that owns it


TCP_STATES = {1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2", 6: "TIME_WAIT",
              7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN", 11: "CLOSING"}


def tcp_sockets(port: int) -> list[TcpSocket]:
    """This host's IPv4 TCP sockets with `port` at either end (Linux's /proc/net/tcp): what
    a test can see of a connection that no counter of ours shows (a server that has read
    every byte sent to it, a peer that closed its end)."""
    out = []
    with open("/proc/net/tcp") as f:
        next(f)  # the header line
        for line in f:
            fields = line.split()
            local, remote = (int(a.rpartition(":")[2], 16) for a in fields[1:3])
            if port not in (local, remote):
                continue
            tx, rx = (int(q, 16) for q in fields[4].split(":"))
            out.append(TcpSocket(local, remote, TCP_STATES.get(int(fields[3], 16), fields[3]), tx, rx))
    return out


def unread_bytes(sock) -> Optional[int]:
    """Bytes sent on connected socket `sock` that the peer's process has not read yet (in
    flight or waiting in its receive queue, both ends on this host); None once the peer's
    end is gone or closed."""
    ours, theirs = sock.getsockname()[1], sock.getpeername()[1]
    sockets = tcp_sockets(ours)
    peer = [s for s in sockets if s.local_port == theirs and s.remote_port == ours and s.state == "ESTABLISHED"]
    if not peer:
        return None
    return sum(s.tx_queue for s in sockets if s.local_port == ours and s.remote_port == theirs) + peer[0].rx_queue


class Supervisor:
    """Restarts a ServerProcess whenever it exits, as systemd's Restart=on-failure does;
    `exits` holds each exited process's status and `logs` its log (a restart starts a new one)."""

    def __init__(self, server: ServerProcess):
        self.server = server
        self.restarts = 0
        self.exits: list[int] = []
        self.logs: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            if not self.server.alive():
                self.exits.append(self.server.proc.returncode)
                self.logs.append(self.server.log())
                self.server.restart()
                self.restarts += 1

    def __enter__(self) -> "Supervisor":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class Scrape(dict):
    """One scrape of a metrics endpoint: {sample name: [(labels, value)]}."""

    def value(self, name: str, **labels) -> float:
        """The sum of `name`'s samples whose labels include `labels` (0 when there are none)."""
        return sum(v for have, v in self.get(name, ()) if all(have.get(k) == str(x) for k, x in labels.items()))

    def labels(self, name: str, label: str) -> dict:
        """{value of `label`: sample value} of `name`'s samples."""
        return {have.get(label): v for have, v in self.get(name, ())}


def scrape(url: str, timeout: float = 30.0) -> Scrape:
    """GET a Prometheus endpoint (ServerProcess.metrics_url) and parse it with prometheus_client."""
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        text = reply.read().decode()
    out = Scrape()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


class Ref(NamedTuple):
    """A tensor on the server: a view of storage `sid`."""

    sid: int
    dtype: torch.dtype
    shape: tuple
    stride: tuple
    offset: int = 0
    flags: int = 0

    @property
    def ext(self) -> Ext:
        return Ext(torch_values.TENSOR, (self.sid, torch_values.dtype_name(self.dtype), tuple(self.shape),
                                         tuple(self.stride), self.offset, self.flags))

    def view(self, shape, stride=None, offset: int = 0) -> "Ref":
        return self._replace(shape=tuple(shape), stride=tuple(stride or contiguous_stride(shape)), offset=offset)


def contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for size in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def encode_arg(v: Any) -> Any:
    """Refs as TENSOR values, CPU tensors inline, torch enums and scalars as torch_values does."""
    if isinstance(v, Ref):
        return v.ext
    if type(v) is Ext:
        return v
    if type(v) in (list, tuple):
        return type(v)(encode_arg(x) for x in v)
    if type(v) is dict:
        return {k: encode_arg(x) for k, x in v.items()}
    if isinstance(v, torch.Tensor):
        return torch_values.inline_cpu_tensor(v)
    return torch_values.encode_value(v, torch_values.inline_cpu_tensor)


class Client:
    def __init__(self, transport: Transport, token: Optional[str] = None, *, timeout: float = 30.0):
        self.transport = transport
        self.timeout = timeout
        self._req = itertools.count(1)
        self._sid = itertools.count(1)
        self.welcome: Optional[m.Welcome] = None
        if token is not None:
            try:
                self.welcome = handshake.client_handshake(transport, token, f"testing {os.getpid()}", timeout)
            except BaseException:
                transport.close()
                raise

    @classmethod
    def tcp(cls, host: str, port: int, token: Optional[str] = None, *, tls=None, **kwargs) -> "Client":
        """`tls`: an ssl.SSLContext (`dataplane.tls.client_context`) for a TLS server."""
        if tls is not None:
            return cls(TlsTransport.connect(host, port, tls=tls), token, **kwargs)
        return cls(TcpTransport.connect(host, port), token, **kwargs)

    # -- messages -------------------------------------------------------------------------
    def send(self, msg, payloads=()) -> int:
        req_id = next(self._req)
        self.transport.send(msg.TYPE, m.encode(msg), payloads, req_id=req_id)
        return req_id

    def recv(self, timeout: Optional[float] = None) -> tuple[Any, list]:
        while True:
            msg = self.transport.recv(timeout=self.timeout if timeout is None else timeout)
            # request id 0: the server's heartbeat while it works, not an answer
            if not (msg.type == MsgType.PONG and msg.req_id == 0):
                return m.decode(msg.type, msg.meta), msg.payloads

    def request(self, msg, payloads=(), timeout: Optional[float] = None) -> tuple[Any, list]:
        """Send and wait for the answer; an ErrorReply raises (kind in `.kind`)."""
        self.send(msg, payloads)
        reply, data = self.recv(timeout)
        if type(reply) is m.ErrorReply:
            raise handshake.remote_error(reply)
        return reply, data

    # -- storage --------------------------------------------------------------------------------
    def new_sid(self) -> int:
        return next(self._sid)

    def alloc(self, nbytes: int, sid: Optional[int] = None) -> int:
        sid = self.new_sid() if sid is None else sid
        self.send(m.AllocStorage(sid, nbytes))
        return sid

    def write(self, sid: int, data, offset: int = 0) -> None:
        view = memoryview(data).cast("B")
        self.send(m.WriteStorage(sid, offset, view.nbytes), (view,))

    def read(self, sid: int, nbytes: int, offset: int = 0) -> bytes:
        reply, data = self.request(m.ReadStorage(sid, offset, nbytes))
        return bytes(data[0])

    def free(self, *sids: int) -> None:
        self.send(m.FreeStorage(tuple(sids)))

    def upload(self, t: torch.Tensor) -> Ref:
        c = t.detach().contiguous()
        sid = self.alloc(c.nbytes)
        if c.nbytes:
            self.write(sid, c.view(-1).view(torch.uint8).numpy())
        return Ref(sid, c.dtype, tuple(c.shape), contiguous_stride(c.shape))

    def empty(self, shape, dtype: torch.dtype = torch.float32, stride=None) -> Ref:
        """A reference to a storage id that does not exist yet: for outs of an op."""
        return Ref(self.new_sid(), dtype, tuple(shape), tuple(stride or contiguous_stride(shape)))

    def download(self, ref: Ref) -> torch.Tensor:
        nbytes = span_bytes(ref.shape, ref.stride, ref.offset, ref.dtype.itemsize)
        raw = bytearray(self.read(ref.sid, nbytes)) or bytearray(1)
        flat = torch.frombuffer(raw, dtype=torch.uint8)[:nbytes].view(ref.dtype)
        return flat.as_strided(ref.shape, ref.stride, ref.offset).clone()

    # -- compute ----------------------------------------------------------------------------------
    def run(self, op: str, *args, outs=(), **kwargs) -> None:
        self.send(m.RunOp(op, encode_arg(args), encode_arg(kwargs), encode_arg(tuple(outs)), False))

    def run_reply(self, op: str, *args, outs=(), **kwargs) -> tuple:
        reply, _ = self.request(m.RunOp(op, encode_arg(args), encode_arg(kwargs), tuple(outs), True))
        return reply.results

    def batch(self, *requests, payloads=()) -> None:
        self.send(m.Batch(tuple(m.batch_item(r) for r in requests)), payloads)

    def sync(self) -> int:
        return self.request(m.Sync())[0].ops_done

    def stats(self) -> dict:
        return self.request(m.Stats())[0].values

    def ping(self, nonce: int = 7) -> int:
        return self.request(m.Ping(nonce))[0].nonce

    def goodbye(self) -> None:
        self.send(m.Goodbye())

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- certificates for TLS tests and benchmarks, as an admin's small CA would make them ---------------
def openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=120)


def make_ca(folder, name: str) -> str:
    """A self-signed CA in `folder`: NAME.crt and NAME.key; returns the certificate's path."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-keyout", f"{name}.key",
            "-out", f"{name}.crt", "-subj", f"/CN=test {name}", cwd=folder)
    return os.path.join(str(folder), f"{name}.crt")


def make_leaf(folder, name: str, ca: str, san: str) -> tuple[str, str]:
    """A certificate for `san` ("IP:127.0.0.1,DNS:localhost") signed by CA `ca` (a name
    make_ca made in the same folder); returns (certificate, key) paths."""
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}", cwd=folder)
    with open(os.path.join(str(folder), f"{name}.ext"), "w") as f:
        f.write(f"subjectAltName={san}\n")
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-days", "2", "-out", f"{name}.crt", "-extfile", f"{name}.ext", cwd=folder)
    return os.path.join(str(folder), f"{name}.crt"), os.path.join(str(folder), f"{name}.key")


def local_server_certificate(folder) -> tuple[tuple[str, ...], str]:
    """A CA and its certificate for a server on this host (127.0.0.1, localhost) in
    `folder`: (the server's options `--tls-cert C --tls-key K`, the CA a client checks it with)."""
    ca = make_ca(folder, "ca")
    cert, key = make_leaf(folder, "server", "ca", "IP:127.0.0.1,DNS:localhost")
    return ("--tls-cert", cert, "--tls-key", key), ca
