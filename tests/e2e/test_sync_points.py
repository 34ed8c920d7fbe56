"""Sync points read what they are asked for (#20): `.item()` of every dtype and of views,
and a synchronize() that answers locally only when nothing was sent since the last one.
A real server process (CPU) over TCP."""

from __future__ import annotations

import pytest
import torch

import remote_accel
from remote_accel.pytorch_ext import runtime

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_item_reads_the_element_of_views_and_reductions(remote, dtype):
    cpu = torch.arange(6).reshape(2, 3).to(dtype)
    dev = cpu.to("remote_accel")
    picks = (lambda t: t[1, 2], lambda t: t.t()[2, 0], lambda t: t[1:, 2:], lambda t: t[0, :1],
             lambda t: t.any() if dtype == torch.bool else t.sum())
    for pick in picks:
        assert pick(dev).item() == pick(cpu).item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_item_gives_the_exact_value_and_python_type_of_a_cpu_item(remote, dtype):
    torch.manual_seed(1)
    cpu = (torch.randn(5, dtype=torch.complex128) * 100).to(dtype) if dtype.is_complex else \
        (torch.randn(5, dtype=torch.float64) * 100).to(dtype)
    dev = cpu.to("remote_accel")
    for i in range(5):
        want, got = cpu[i].item(), dev[i].item()
        assert type(got) is type(want) and got == want, (dtype, i, got, want)
    assert dev[-1].item() == cpu[-1].item()  # a storage offset, read right


@pytest.mark.parametrize("dtype", (torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn), ids=str)
def test_item_of_dtypes_the_cpp_kernel_leaves_to_the_general_path(remote, dtype):
    cpu = torch.tensor([3, 7], dtype=torch.int64).to(dtype)
    got, want = cpu.to("remote_accel")[1].item(), cpu[1].item()
    assert type(got) is type(want) and got == want


def test_item_of_lazily_conjugated_or_negated_scalars(remote):
    z = torch.tensor([1 + 2j], device="remote_accel")
    assert z.conj().item() == 1 - 2j
    assert z.conj().neg().item() == -1 + 2j


def test_item_of_many_elements_raises_torchs_error(remote):
    with pytest.raises(RuntimeError, match="3 elements cannot be converted to Scalar"):
        torch.ones(3, device="remote_accel").item()
    assert torch.ones(1, device="remote_accel").item() == 1.0  # the session goes on


def test_an_idle_synchronize_asks_nothing_but_queued_work_still_reports_its_error(remote):
    session = runtime.session(0)
    x = torch.arange(4.0, device="remote_accel")
    torch.remote_accel.synchronize()
    trips = session.counters["round_trips"]
    for _ in range(3):
        torch.remote_accel.synchronize()
    assert session.counters["round_trips"] == trips  # nothing was sent: no round trip
    bad = x[torch.tensor([0, 10]).to("remote_accel")]  # fails on the server
    with pytest.raises(remote_accel.RemoteAccelError, match="bounds"):
        torch.remote_accel.synchronize()
    del bad
    x.add_(1.0)
    torch.remote_accel.synchronize()
    assert session.counters["round_trips"] == trips + 2
    assert x.cpu().tolist() == [1.0, 2.0, 3.0, 4.0]
