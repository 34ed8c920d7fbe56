"""Swapping storages to host memory on a real server process (--device-memory 8M
--swap-space 64M), one request at a time, so that every figure is known: which storage
goes out, that its bytes come back unchanged, and what the counters say."""

from __future__ import annotations

import time

import pytest
import torch

from remote_accel.server.testing import Client

# storages moved to host memory and back by the server's own C++ (csrc/swap.cpp), checked
# byte for byte: nothing a torch version changes
pytestmark = pytest.mark.any_torch

MB = 1 << 20


SERVER_ARGS = ("--device-memory", "8M", "--swap-space", "64M")


def filled(value: int, n: int = 3 * MB) -> torch.Tensor:
    return torch.full((n // 4,), float(value))


def wait_until_alone(c: Client) -> None:
    """Clients of earlier tests are freed when the server sees them go."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = c.stats()
        if stats["server_resident_bytes"] + stats["server_swapped_bytes"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError("earlier clients' storages were not freed")


def test_least_recently_used_goes_out_and_comes_back_unchanged(connect):
    c = connect()
    wait_until_alone(c)
    refs = [c.upload(filled(i)) for i in range(2)]  # 6 MiB of 8
    c.sync()
    assert c.stats()["swap_outs"] == 0
    third = c.upload(filled(2))  # 9 MiB: the oldest goes out
    c.sync()
    stats = c.stats()
    assert stats["swap_outs"] == 1 and stats["swapped_out_bytes"] == 3 * MB
    assert stats["memory_allocated"] == 9 * MB  # the client holds all three
    assert stats["server_resident_bytes"] == 6 * MB and stats["server_swapped_bytes"] == 3 * MB
    # reading the swapped-out one brings it back (and sends the next oldest out)
    assert torch.equal(c.download(refs[0]), filled(0))
    stats = c.stats()
    assert stats["swap_ins"] == 1 and stats["prefetch_misses"] == 1 and stats["swap_outs"] == 2
    assert stats["swapped_out_bytes"] == 3 * MB
    for i, ref in enumerate(refs + [third]):
        assert torch.equal(c.download(ref), filled(i))
    c.free(*(r.sid for r in refs + [third]))
    c.sync()
    stats = c.stats()
    assert stats["swapped_out_bytes"] == 0 and stats["memory_allocated"] == 0
    assert stats["server_swapped_bytes"] == 0 and stats["server_resident_bytes"] == 0


def test_an_op_on_swapped_out_inputs_gives_the_same_result(connect):
    c = connect()
    wait_until_alone(c)
    a, b = c.upload(filled(1)), c.upload(filled(2))
    filler = c.upload(filled(9))  # a goes out
    c.sync()
    assert c.stats()["swapped_out_bytes"] == 3 * MB
    out = c.empty((3 * MB // 4,))
    c.run("aten::add.Tensor", a, b, outs=(out,))  # a comes back first
    c.sync()
    stats = c.stats()
    # a comes back (and on the way may send b out, which comes back too)
    assert stats["swap_ins"] >= 1 and stats["prefetch_misses"] == stats["swap_ins"]
    assert torch.equal(c.download(out), filled(3))
    assert torch.equal(c.download(filler), filled(9))
    c.free(a.sid, b.sid, out.sid, filler.sid)


def test_storages_of_another_client_are_swapped_out_too(connect):
    first, second = connect(), connect()
    wait_until_alone(first)
    held = [first.upload(filled(7)) for _ in range(2)]
    first.sync()
    mine = [second.upload(filled(8)) for _ in range(2)]
    second.sync()
    assert first.stats()["swapped_out_bytes"] > 0  # made room for the second client
    for ref in held:
        assert torch.equal(first.download(ref), filled(7))
    for ref in mine:
        assert torch.equal(second.download(ref), filled(8))


def test_swap_space_full_is_out_of_memory_and_the_session_goes_on(connect):
    c = connect()
    wait_until_alone(c)
    refs = [c.upload(filled(i, 8 * MB)) for i in range(9)]  # 72 MiB: device and swap space hold 72
    with pytest.raises(torch.OutOfMemoryError, match="device memory"):
        c.upload(filled(9, 8 * MB))
        c.sync()
    assert torch.equal(c.download(refs[3]), filled(3, 8 * MB))
    c.free(*(r.sid for r in refs))
    c.sync()
    small = c.upload(filled(5, 4096))
    assert torch.equal(c.download(small), filled(5, 4096))
