"""What a session's host blocks hold beyond its storages (dataplane/host_blocks.cpp: its
cached free blocks, and each live block's rounding up to 2 MiB) is charged to the
session's memory limit: the server never holds more host memory for a session than its
limit, and a session's cached blocks are unmapped when it needs the room itself."""

from __future__ import annotations

import pytest

from remote_accel.server import native

pytestmark = pytest.mark.any_torch

MIB = 1 << 20
LIMIT = 8 * MIB


def held(ex) -> int:
    """What the server holds for the session: its storages and its blocks' extra."""
    return ex.used() + ex.host_extra()


def alloc(ex, sid: int, nbytes: int) -> None:
    ex.check_fits(nbytes)  # as executor.py does before it allocates
    ex.alloc(sid, nbytes)
    assert held(ex) <= LIMIT


def test_cached_blocks_yield_to_the_sessions_own_storages():
    ex = native.Executor("cpu", LIMIT, None)
    alloc(ex, 1, 6 * MIB)
    ex.free(1)  # its block is kept for reuse: held for this session, so charged to it
    assert ex.used() == 0 and ex.host_extra() == 6 * MIB
    alloc(ex, 2, MIB + 1)  # a new 2 MiB block (6 MiB is too big to serve it), rounding 1 MiB - 1
    assert ex.host_extra() == 6 * MIB + MIB - 1 and held(ex) == LIMIT
    # the room 3 MiB needs is the cached block's: it is unmapped, not kept beside
    alloc(ex, 3, 3 * MIB)  # a 4 MiB block
    assert ex.host_extra() == (MIB - 1) + MIB


def test_a_live_blocks_rounding_counts_against_the_limit():
    ex = native.Executor("cpu", LIMIT, None)
    alloc(ex, 1, 5 * MIB + 1)  # a 6 MiB block: 1 MiB - 1 of it beyond the storage
    assert held(ex) == 6 * MIB
    with pytest.raises(Exception, match="memory limit"):
        ex.check_fits(2 * MIB + MIB // 2)  # fits beside the storage's bytes, not beside its block
    ex.check_fits(2 * MIB)

