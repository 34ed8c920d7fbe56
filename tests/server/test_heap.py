"""The server's malloc keeps what its session threads free (server/heap.py): checked on
glibc's own chunk headers in processes of their own, and in a real server's log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from remote_accel.server import heap
from remote_accel.server.testing import ServerProcess

pytestmark = [pytest.mark.any_torch,
              pytest.mark.skipif(os.confstr("CS_GNU_LIBC_VERSION") is None, reason="glibc's malloc only")]

# A fresh thread mallocs 8 MiB (below glibc's 32 MiB bound, above its first 128 KiB mmap
# threshold), writes it and frees it: is the chunk mmapped (glibc's IS_MMAPPED bit in the
# size word before it), and how much did the process's RSS fall at the free?
_PROBE = textwrap.dedent("""
    import ctypes, json, os, sys, threading
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    IS_MMAPPED = 0x2

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def probe(out):
        chunk = libc.malloc(8 << 20)
        out["mmapped"] = bool(ctypes.c_size_t.from_address(chunk - 8).value & IS_MMAPPED)
        ctypes.memset(chunk, 1, 8 << 20)
        before = rss()
        libc.free(chunk)
        out["returned_mib"] = (before - rss()) / (1 << 20)

    if sys.argv[1] == "server":
        from remote_accel.server import heap
        heap.keep_freed_memory()
    out = {}
    thread = threading.Thread(target=probe, args=(out,))
    thread.start()
    thread.join()
    print(json.dumps(out))
""")


def _probe(setting: str, env: dict | None = None) -> dict:
    environ = {k: v for k, v in os.environ.items() if k not in heap.GLIBC_VARIABLES and k != heap.GLIBC_TUNABLES}
    done = subprocess.run([sys.executable, "-c", _PROBE, setting], env={**environ, **(env or {})},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_freed_chunks_stay_with_the_server_instead_of_going_back_to_the_kernel():
    plain = _probe("plain")
    assert plain["mmapped"] and plain["returned_mib"] >= 7  # glibc's default: refaulted next time
    server = _probe("server")
    assert not server["mmapped"]  # from the heap...
    assert server["returned_mib"] < 1  # ...and its pages stay for the next allocation


def test_the_operators_own_malloc_settings_win():
    assert heap.operator_choice({"MALLOC_TRIM_THRESHOLD_": "0"}) == "MALLOC_TRIM_THRESHOLD_"
    assert heap.operator_choice({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}) == "GLIBC_TUNABLES"
    assert heap.operator_choice({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}) is None
    assert heap.operator_choice({}) is None
    # an operator's 64 KiB mmap threshold stays: the 8 MiB chunk is still mmapped
    assert _probe("server", {"MALLOC_MMAP_THRESHOLD_": "65536"})["mmapped"]


def test_a_server_says_how_its_malloc_keeps_memory():
    with ServerProcess("--log-level", "debug") as server:
        assert f"malloc keeps up to {heap.KEEP_FREE >> 20} MiB free a heap" in server.log()
