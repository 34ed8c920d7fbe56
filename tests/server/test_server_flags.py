"""Documented server settings that no other test sets: `remote-accel-server --version`, and
REMOTE_ACCEL_HOST_CACHE_MB, the MiB of freed host blocks a CPU server keeps for its
sessions' next large storages (dataplane/host_blocks.cpp). No figure of the server
reports that cache, so the test reads what it holds where the kernel counts it: the
server process's resident memory after a large storage is freed (a kept block stays
mapped and faulted in; a released one is unmapped)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np
import pytest

import remote_accel
from remote_accel.server.testing import Client, ServerProcess

pytestmark = pytest.mark.any_torch

MIB = 1 << 20
STORAGE = 64 * MIB  # beyond glibc's largest mmap threshold (32 MiB): without the cache, free() unmaps it


@pytest.mark.parametrize("command", [["remote-accel-server"], ["-m", "remote_accel.server"]],
                         ids=["console-script", "python-m"])
def test_version(command):
    if command[0] == "remote-accel-server":
        command = [str(pathlib.Path(sys.executable).parent / "remote-accel-server")]
    else:
        command = [sys.executable, *command]
    out = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"remote-accel-server {remote_accel.__version__}"


def _resident_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


@pytest.mark.parametrize("cache_mb, kept", [(None, True), ("96", True), ("32", False), ("0", False)],
                         ids=["default", "96-MiB", "32-MiB", "off"])
def test_host_cache_mb_decides_whether_a_freed_block_is_kept(monkeypatch, cache_mb, kept):
    monkeypatch.delenv("REMOTE_ACCEL_HOST_CACHE_MB", raising=False)  # None: the default, 2048 MiB
    env = {"REMOTE_ACCEL_HOST_CACHE_MB": cache_mb} if cache_mb is not None else None
    with ServerProcess(device="cpu", env=env) as server, Client.tcp(*server.tcp, token=server.token) as client:
        client.sync()
        before = _resident_bytes(server.proc.pid)
        data = np.random.default_rng(0).integers(1, 256, STORAGE, dtype=np.uint8)
        for _ in range(2):  # the second storage reuses a kept block, or maps afresh
            sid = client.alloc(STORAGE)
            client.write(sid, data)
            assert client.read(sid, 4096) == data[:4096].tobytes()
            client.sync()
            assert _resident_bytes(server.proc.pid) - before >= STORAGE * 3 // 4  # the storage is resident
            client.free(sid)
            client.sync()
            held = _resident_bytes(server.proc.pid) - before
            if kept:  # within the budget: the block stays with the session for its next storage
                assert held >= STORAGE * 3 // 4, held / MIB
            else:  # no cache, or a block larger than the budget: back to the system
                assert held <= STORAGE // 4, held / MIB
        assert "Traceback" not in server.log(), server.log()
