"""The server's bernoulli_(p) kernel for CPU tensors (server/csrc/cpu_bernoulli.cpp) draws
what torch's own kernel draws, element for element, and leaves the generator where torch's
would; a real server uses it, and dropout on it equals local CPU's."""

from __future__ import annotations

import pytest
import torch

import remote_accel
from remote_accel.server import native
from remote_accel.server.testing import ServerProcess

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.bool, torch.uint8, torch.int8,
          torch.int32, torch.int64)
# around the engine's 624-word state: each element takes two words, so 311, 312 and 313
# elements end just before, at and after a regeneration
SIZES = (1, 2, 311, 312, 313, 623, 624, 625, 5000, 100_003)
PROBABILITIES = (0.0, 1e-9, 0.1, 0.5, 1 / 3, 0.9, 1 - 1e-9, 1.0)


def _draws(kernel, dtype, size, p, offset, generator=None):
    """kernel's draw after `offset` words of a fresh seed, and the generator state after it."""
    source = generator if generator is not None else torch.default_generator
    source.manual_seed(size + offset)
    torch.randint(0, 2**31, (offset,), generator=source)  # each takes a word of the engine
    out = kernel(torch.empty(size, dtype=dtype), p, generator)
    return out, source.get_state()


def _torch(t, p, generator):
    return t.bernoulli_(p, generator=generator)


def _server(t, p, generator):
    return native.cpu_bernoulli_(t, p, generator)


def test_torch_uses_its_own_kernel_in_this_process():
    assert not native.cpu_bernoulli_installed()  # so _torch below is torch's, not the server's


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_server_kernel_draws_torchs_numbers_and_leaves_its_state(dtype):
    for size in SIZES:
        for p in PROBABILITIES:
            for offset in (0, 1, 5):  # the engine part-way into its state, at odd and even words
                want, want_state = _draws(_torch, dtype, size, p, offset)
                got, got_state = _draws(_server, dtype, size, p, offset)
                assert got.dtype == dtype
                assert torch.equal(got, want), (dtype, size, p, offset)
                assert torch.equal(got_state, want_state), (dtype, size, p, offset)


def test_an_explicit_generator_is_the_one_drawn_from():
    default_before = torch.default_generator.get_state()
    want, want_state = _draws(_torch, torch.float32, 4000, 0.3, 3, torch.Generator().manual_seed(1))
    got, got_state = _draws(_server, torch.float32, 4000, 0.3, 3, torch.Generator().manual_seed(1))
    assert torch.equal(got, want) and torch.equal(got_state, want_state)
    assert torch.equal(torch.default_generator.get_state(), default_before)


def test_what_it_does_not_take_gets_torchs_kernel():
    """Non-contiguous tensors (TensorIterator's order) and torch's errors, as torch has them."""
    torch.manual_seed(4)
    want = torch.empty(40, 30).t().bernoulli_(0.4)
    torch.manual_seed(4)
    got = native.cpu_bernoulli_(torch.empty(40, 30).t(), 0.4)
    assert not got.is_contiguous() and torch.equal(got, want)
    for p in (-0.1, 1.5, float("nan")):
        with pytest.raises(RuntimeError, match="bernoulli_ expects p to be in"):
            native.cpu_bernoulli_(torch.empty(8), p)
    empty = torch.empty(0)
    assert native.cpu_bernoulli_(empty, 0.5) is not None and empty.numel() == 0


def test_a_server_draws_dropout_with_its_kernel_and_local_cpus_numbers():
    with ServerProcess() as server:
        remote_accel.init(transport="tcp", server="%s:%d" % server.tcp, token=server.token)
        try:
            drawn = remote_accel.server_stats()["cpu_bernoulli"]
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(8, 32, 130).to(dtype)  # 33,280 elements: many regenerations
                torch.manual_seed(7)
                local = [torch.nn.functional.dropout(x, 0.1) for _ in range(3)]
                local.append(torch.empty(1000).bernoulli_(0.25))
                torch.manual_seed(7)
                remote_x = x.to("remote_accel")
                remote = [torch.nn.functional.dropout(remote_x, 0.1) for _ in range(3)]
                remote.append(torch.empty(1000, device="remote_accel").bernoulli_(0.25))
                for a, b in zip(remote, local):
                    assert torch.equal(a.cpu(), b)
        finally:
            remote_accel.shutdown()
        with open(server.log_file) as f:
            log = f.read()
    with_mkl_on_intel = torch.backends.mkl.is_available() and "GenuineIntel" in open("/proc/cpuinfo").read()
    assert drawn == ("torch" if with_mkl_on_intel else "server")
    # one INFO line a start (the kernel's choice is at DEBUG, and in server_stats())
    assert sum("remote-accel-server " in line for line in log.splitlines()) == 1


def test_the_environment_keeps_torchs_kernel():
    with ServerProcess(env={"REMOTE_ACCEL_SERVER_CPU_BERNOULLI": "0"}) as server:
        remote_accel.init(transport="tcp", server="%s:%d" % server.tcp, token=server.token)
        try:
            assert remote_accel.server_stats()["cpu_bernoulli"] == "torch"
        finally:
            remote_accel.shutdown()
