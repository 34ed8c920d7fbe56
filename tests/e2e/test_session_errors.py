"""What a user meets when sessions end, memory runs out, or init() meets the wrong peer,
the wrong token or a process where torch already ran: clear RemoteAccelErrors, as on
CUDA, against real server processes over TCP.

Marked any_torch (the models venv's run leaves them out): the tests of sessions, peers and
tokens alone. Those whose result goes through the device's C++ parts and torch's own
machinery (stale tensors served from plans, the allocator's memory accounting, a backward
before init) run under every torch."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import remote_accel
from remote_accel.errors import RemoteOutOfMemoryError, WrongPeerError
from remote_accel.server.testing import ServerProcess


def _init(server, **kwargs) -> None:
    kwargs.setdefault("timeout", 10)
    remote_accel.init(transport="tcp", server="%s:%d" % server.tcp, token=server.token, **kwargs)


@pytest.fixture
def shut():
    yield
    remote_accel.shutdown()


# -- stale tensors, init after a dead session ------------------------------------------------------
def test_tensors_of_a_closed_session_raise_and_never_read_garbage(shut):
    with ServerProcess() as server:
        _init(server)
        old = torch.arange(4.0, device="remote_accel")
        planned = torch.ones(4, device="remote_accel")
        for _ in range(3):
            planned.add_(1.0)  # the later calls are served from a plan in C++
        assert old.cpu().tolist() == [0.0, 1.0, 2.0, 3.0]
        remote_accel.shutdown()
        _init(server)  # same server, new session
        new = torch.arange(3.0, device="remote_accel")
        for use in (lambda: old.cpu(), lambda: old + 1, lambda: planned.add_(1.0), lambda: old.sum().item()):
            with pytest.raises(remote_accel.RemoteAccelError, match="session that was closed"):
                use()
        assert (new * 2).cpu().tolist() == [0.0, 2.0, 4.0]  # the new session is unaffected


@pytest.mark.any_torch
@pytest.mark.parametrize("recovery", [False, True], ids=["recovery-off", "recovery-on"])
def test_init_after_the_server_died_needs_no_shutdown(shut, recovery):
    with ServerProcess() as first:
        # with recovery the session waits recovery_timeout for a server to come back at
        # that address: none does here, so a short one
        _init(first, timeout=3, recovery=recovery, recovery_timeout=1.0)
        old = torch.ones(2, device="remote_accel")
        first.kill()
        with pytest.raises(remote_accel.RemoteAccelError, match="is gone"):
            (old + 1).cpu()
    with ServerProcess() as second:  # a restarted server
        _init(second)
        assert (torch.ones(2, device="remote_accel") * 3).cpu().tolist() == [3.0, 3.0]
        with pytest.raises(remote_accel.RemoteAccelError, match="session that was closed"):
            old.cpu()


# -- memory as on CUDA -------------------------------------------------------------------------------
def test_allocations_are_counted_at_once_and_refused_by_the_allocating_call(shut):
    with ServerProcess("--memory-limit", "8M") as server:
        _init(server)
        base = torch.remote_accel.memory_allocated()
        x = torch.empty(1 << 19, device="remote_accel")  # 2 MiB, never written
        assert torch.remote_accel.memory_allocated() == base + (2 << 20)
        with pytest.raises(torch.OutOfMemoryError, match="out of memory"):
            torch.empty(2 << 20, device="remote_accel")  # 8 MiB more: the call itself fails
        batch = 2 << 20
        while True:  # what a training script does: halve the batch and retry
            try:
                y = torch.ones(batch, device="remote_accel")
                break
            except torch.OutOfMemoryError:
                batch //= 2
        assert batch == 1 << 20 and y.sum().item() == batch  # 4 MiB fit next to x: the session goes on
        del x, y
        assert torch.remote_accel.memory_allocated() == base
        assert torch.remote_accel.max_memory_allocated() >= base + (6 << 20)


def test_server_side_out_of_memory_is_a_torch_out_of_memory_error(shut):
    """What the client cannot see coming (another process's memory, a device that is
    full) is refused by the server, at the latest at the next sync, as a
    RemoteOutOfMemoryError, which `except torch.OutOfMemoryError` catches."""
    assert issubclass(RemoteOutOfMemoryError, torch.OutOfMemoryError)
    assert issubclass(RemoteOutOfMemoryError, remote_accel.RemoteAccelError)
    with ServerProcess("--memory-limit", "8M") as server:
        _init(server)
        x = torch.ones(4, device="remote_accel")
        # a data-dependent op the server sizes: 16 MiB of results from a 4-element input
        with pytest.raises(torch.OutOfMemoryError) as info:
            x.repeat_interleave(torch.tensor([1 << 20] * 4).to("remote_accel")).cpu()
        assert isinstance(info.value, remote_accel.RemoteAccelError)
        assert (x + 1).cpu().tolist() == [2.0] * 4


# -- the wrong peer --------------------------------------------------------------------------------
class _Peer:
    """A TCP port that is no remote_accel server: silent, HTTP, or an SSH banner."""

    def __init__(self, kind: str):
        self.kind = kind
        if kind == "http":
            self.http = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
            self.port = self.http.server_address[1]
            threading.Thread(target=self.http.serve_forever, daemon=True).start()
            return
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            if self.kind == "ssh":  # as sshd: a banner first, and it drops garbage
                conn.sendall(b"SSH-2.0-OpenSSH_9.2p1 Debian-2+deb12u3\r\n")

    def close(self) -> None:
        if self.kind == "http":
            self.http.shutdown()
            self.http.server_close()
        else:
            self.sock.close()
            for c in self.conns:
                c.close()


@pytest.mark.any_torch
@pytest.mark.parametrize("kind", ["silent", "http", "ssh"])
def test_init_against_a_wrong_peer_says_so_within_the_timeout(kind):
    peer = _Peer(kind)
    try:
        start = time.monotonic()
        with pytest.raises(WrongPeerError, match="is not a remote_accel server"):
            remote_accel.init(transport="tcp", server=f"127.0.0.1:{peer.port}", token="t", timeout=3)
        assert time.monotonic() - start < 3 + 5.0  # the timeout, and a loaded machine
        assert not remote_accel.is_initialized()
    finally:
        peer.close()


# -- tokens ----------------------------------------------------------------------------------------
@pytest.mark.any_torch
def test_a_missing_token_file_is_named_in_the_refusal(tmp_path, monkeypatch):
    with ServerProcess() as server:
        monkeypatch.delenv("REMOTE_ACCEL_TOKEN", raising=False)
        monkeypatch.setenv("REMOTE_ACCEL_RUNTIME_DIR", str(tmp_path))  # holds no token file
        with pytest.raises(remote_accel.errors.AuthError) as info:
            remote_accel.init(transport="tcp", server="%s:%d" % server.tcp, timeout=10)
        text = str(info.value) + " ".join(getattr(info.value, "__notes__", []))
        assert os.path.join(str(tmp_path), "token") in text and "REMOTE_ACCEL_TOKEN" in text, text


# -- before init, and a backward before init ---------------------------------------------------------
BEFORE_INIT = textwrap.dedent("""
    import sys, torch
    leaf = torch.ones(2, requires_grad=True)
    (leaf * 2).sum().backward()  # the autograd engine starts before remote_accel exists
    import remote_accel
    print("available", torch.remote_accel.is_available(), torch.remote_accel.device_count())
    try:
        torch.ones(2, device="remote_accel")
    except remote_accel.RemoteAccelError as exc:
        print("use", "call remote_accel.init(" in str(exc))
    remote_accel.init(transport="tcp", server=sys.argv[1], token=sys.argv[2])
    w = torch.ones(3, device="remote_accel", requires_grad=True)
    (w * 3).sum().backward()
    print("grad", w.grad.cpu().tolist(), torch.remote_accel.is_available())
    remote_accel.shutdown()
""")

IMPORT_FIRST = textwrap.dedent("""
    import remote_accel  # before torch: the device appears when torch is imported
    import torch
    print("available", torch.remote_accel.is_available(), torch.remote_accel.device_count())
""")


def test_before_init_the_device_exists_and_asks_for_init_and_a_backward_does_not_break_it():
    with ServerProcess() as server:
        host, port = server.tcp
        proc = subprocess.run([sys.executable, "-c", BEFORE_INIT, f"{host}:{port}", server.token],
                              capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:3] == ["available False 0", "use True", "grad [3.0, 3.0, 3.0] True"]
    proc = subprocess.run([sys.executable, "-c", IMPORT_FIRST], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "available False 0", proc.stderr
