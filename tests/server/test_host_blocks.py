"""Large CPU storages come from cached, pre-faulted host blocks (dataplane/host_blocks.cpp):
uploads into new storages land intact, a freed block serves the same session's next
storage, and never another session's (no client sees another's bytes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.any_torch

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _cpu_only(server):
    if server.device != "cpu":
        pytest.skip("host blocks back CPU storages only")


def _pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 256, nbytes, dtype=np.uint8)


def test_uploads_into_new_storages_round_trip(client):
    for i, n in enumerate((MIB, 3 * MIB + 5, 8 * MIB, MIB - 1)):
        data = _pattern(n, i)
        sid = client.alloc(n)
        client.write(sid, data)
        assert client.read(sid, n) == data.tobytes()
        client.free(sid)
    client.sync()


def test_a_freed_block_never_shows_another_sessions_bytes(connect):
    a, b = connect(), connect()
    n = 4 * MIB
    secret = _pattern(n, 99)
    for _ in range(3):  # freed blocks go back to a's cache
        sid = a.alloc(n)
        a.write(sid, secret)
        a.sync()
        a.free(sid)
    a.sync()
    for _ in range(3):
        sid = b.alloc(n)
        got = np.frombuffer(b.read(sid, n), np.uint8)
        # a new block of b's own is zeroed by the kernel; a's blocks are never handed over
        assert not np.any(got == secret), "a new storage showed another session's bytes"
        b.free(sid)


def test_an_op_that_grows_a_cached_storage_keeps_its_bytes(client):
    t = torch.arange(MIB // 2, dtype=torch.float32)  # 2 MiB: a host block
    ref = client.upload(t)
    client.run("aten::resize_", ref, [MIB])  # moves the bytes to a larger allocation
    grown = ref._replace(shape=(MIB,), stride=(1,))
    assert torch.equal(client.download(grown)[: MIB // 2], t)
