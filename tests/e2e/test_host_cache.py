"""Large `.cpu()` results come from a cache of pre-faulted host blocks (#13): what a user
gets is right, owns its memory for as long as it lives, never shares it with another
live result, and freed results hand their memory back (to the cache, or to the system
beyond its limit and on empty_cache()). A real server process (CPU) over TCP."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.any_torch


MIB = 1 << 20


@pytest.fixture
def cache(remote):
    """A clean cache with the default limit, restored afterwards."""
    limit = torch.remote_accel.host_memory_stats()["limit_bytes"]
    gc.collect()
    torch.remote_accel.empty_cache()
    yield torch.remote_accel.host_memory_stats
    from remote_accel.pytorch_ext import handles

    handles._C.host_cache_empty(limit)


def data(numel: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_results_are_right_and_live_results_never_share_memory(cache):
    sources = [data(2 * MIB // 4, seed) for seed in range(6)]
    remote = [s.to("remote_accel") for s in sources]
    kept = []
    for round_ in range(3):
        results = [r.cpu() for r in remote]
        for src, got in zip(sources, results):
            assert torch.equal(got, src)
        kept.append(results[round_])  # one result of each round stays alive
        alive = {id(t): t for t in kept + results}
        ptrs = [t.data_ptr() for t in alive.values()]
        assert len(set(ptrs)) == len(ptrs)  # no two live tensors on one block
        del results, alive
    # reused blocks were written whole: every result of a later round is exact
    assert cache()["hits"] > 0
    for src, got in zip(sources, kept):
        assert torch.equal(got, src)
    # the kept results still hold their own bytes after their blocks' neighbours were reused
    assert torch.equal(kept[0], sources[0]) and torch.equal(kept[2], sources[2])


def test_a_freed_result_hands_its_block_to_the_next_one(cache):
    x = data(3 * MIB // 4, 1).to("remote_accel")
    first = x.cpu()
    where = first.data_ptr()
    assert cache()["live_bytes"] >= 3 * MIB
    del first
    assert cache()["live_bytes"] == 0 and cache()["cached_bytes"] >= 3 * MIB
    hits = cache()["hits"]
    y = (x * 2).cpu()
    assert y.data_ptr() == where and cache()["hits"] == hits + 1
    assert torch.equal(y, data(3 * MIB // 4, 1) * 2)
    # the user's tensor owns the memory: its bytes survive the remote tensor and more downloads
    del x
    others = [data(3 * MIB // 4, 7).to("remote_accel").cpu() for _ in range(2)]
    assert all(o.data_ptr() != where for o in others)
    assert torch.equal(y, data(3 * MIB // 4, 1) * 2)


def test_memory_goes_back_beyond_the_limit_and_on_empty_cache(cache):
    from remote_accel.pytorch_ext import handles

    handles._C.host_cache_empty(4 * MIB)  # keep at most 4 MiB of free blocks
    x = data(3 * MIB // 4, 2).to("remote_accel")
    results = [x.cpu() for _ in range(3)]  # three blocks of 4 MiB, all live
    assert cache()["live_bytes"] == 3 * 4 * MIB
    released = cache()["released"]
    del results
    stats = cache()
    assert stats["live_bytes"] == 0 and stats["cached_bytes"] == 4 * MIB
    assert stats["released"] == released + 2  # two went back to the system
    torch.remote_accel.empty_cache()
    assert cache()["cached_bytes"] == 0 and cache()["released"] == released + 3


def test_a_full_cache_makes_room_for_the_sizes_in_use(cache):
    """When the free blocks fill the limit, those freed longest ago go back to the system:
    a loop whose results changed size (evaluation after training, a longer batch) is
    served from the cache again after one round, not left missing behind blocks of a
    size nobody asks for any more."""
    from remote_accel.pytorch_ext import handles

    handles._C.host_cache_empty(8 * MIB)  # keep at most 8 MiB of free blocks
    big = data(8 * MIB // 4, 4).to("remote_accel")
    del [big.cpu()][0]  # an 8 MiB block fills the cache
    assert cache()["cached_bytes"] == 8 * MIB
    x = data(2 * MIB // 4, 5).to("remote_accel")
    start = cache()
    for _ in range(4):
        y = x.cpu()  # a 2 MiB block: the cached 8 MiB one is too big to serve it
        assert torch.equal(y, data(2 * MIB // 4, 5))
        del y
    stats = cache()
    assert stats["misses"] == start["misses"] + 1 and stats["hits"] == start["hits"] + 3
    assert stats["released"] == start["released"] + 1  # the 8 MiB block, freed longest ago
    assert stats["cached_bytes"] == 2 * MIB


def test_the_cache_turned_off_still_gives_right_results(cache):
    from remote_accel.pytorch_ext import handles

    handles._C.host_cache_empty(0)
    src = data(2 * MIB // 4, 3)
    before = cache()
    got = src.to("remote_accel").cpu()
    assert torch.equal(got, src)
    after = cache()
    assert after["live_bytes"] == 0 and after["misses"] == before["misses"] and after["hits"] == before["hits"]


@pytest.mark.parametrize("case", ["transposed", "view_with_offset", "dtype", "size_one_dims", "small",
                                  "to_cpu_contiguous_format", "conj"])
def test_every_kind_of_download_is_exact(cache, case):
    base = data(MIB, 4).reshape(1024, 1024)  # 4 MiB
    dev = base.to("remote_accel")
    if case == "transposed":
        got, want = dev.t().cpu(), base.t()
    elif case == "view_with_offset":
        got, want = dev[512:].cpu(), base[512:]
    elif case == "dtype":
        got, want = dev.to("cpu", torch.float64), base.to(torch.float64)
        assert got.dtype == torch.float64
    elif case == "size_one_dims":
        # contiguous, but its size-1 dim has a stride of its own, which .cpu() keeps as on CPU
        want = base.reshape(2, 1, -1).transpose(0, 1)
        got = dev.reshape(2, 1, -1).transpose(0, 1).cpu()
        assert got.stride() == want.clone().stride()
    elif case == "small":
        got, want = dev[:2, :3].cpu(), base[:2, :3]
    elif case == "to_cpu_contiguous_format":
        got, want = dev.to("cpu", memory_format=torch.contiguous_format), base
        assert got.is_contiguous()
    else:
        z = torch.complex(base, -base)
        got, want = z.to("remote_accel").conj().cpu(), z.conj()
        got, want = got.resolve_conj(), want.resolve_conj()
    assert torch.equal(got, want)


def test_a_cached_result_behaves_as_any_cpu_tensor(cache):
    src = data(2 * MIB // 4, 6)
    got = src.to("remote_accel").cpu()
    assert got.device.type == "cpu" and not got.is_pinned()
    array = got.numpy()  # numpy shares the memory and keeps it alive
    array[0] = 42.0
    assert got[0].item() == 42.0
    got.add_(1.0)
    assert torch.equal(got[1:], src[1:] + 1.0)
    assert torch.equal(torch.cat([got, got])[src.numel() + 1:], src[1:] + 1.0)
    # autograd: .cpu() of a remote leaf that requires grad still has its gradient
    w = src.clone().to("remote_accel").requires_grad_()
    (w.cpu() * 2).sum().backward()
    assert torch.equal(w.grad.cpu(), torch.full_like(src, 2.0))
