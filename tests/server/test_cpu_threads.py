"""How many CPU threads the server's kernels use: --threads, OMP_NUM_THREADS, torch's default."""

from __future__ import annotations

import pytest
import torch

import remote_accel
from remote_accel.server import cpu_threads
from remote_accel.server.testing import ServerProcess

pytestmark = pytest.mark.any_torch


def test_the_flag_wins_then_the_environment_then_torchs_default():
    assert cpu_threads.choose(3, {"OMP_NUM_THREADS": "5"}) == (3, "--threads")
    assert cpu_threads.choose(None, {"OMP_NUM_THREADS": "5"}) == (5, "OMP_NUM_THREADS")
    for unusable in ("", "0", "-2", "4,2", "many"):  # not a plain count: torch's default
        assert cpu_threads.choose(None, {"OMP_NUM_THREADS": unusable}) == (None, cpu_threads.TORCH_DEFAULT)


@pytest.mark.parametrize("options, env, expected", [
    ((), {}, None),  # None: torch's default, as this (local) process has it
    (("--threads", "3"), {"OMP_NUM_THREADS": "1"}, 3),
    ((), {"OMP_NUM_THREADS": "1"}, 1),
], ids=["default", "flag", "environment"])
def test_a_server_runs_its_kernels_on_the_threads_it_was_given(monkeypatch, options, env, expected):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with ServerProcess(*options, env=env) as server:
        remote_accel.init(transport="tcp", server="%s:%d" % server.tcp, token=server.token)
        try:
            x = torch.ones(4, device="remote_accel")
            assert (x * 2).sum().item() == 8.0  # the session thread ran kernels
            threads = remote_accel.server_stats()["cpu_threads"]  # as that thread sees them
        finally:
            remote_accel.shutdown()
        with open(server.log_file) as f:
            assert f": {threads} CPU threads," in f.read()  # the start line
    assert threads == (torch.get_num_threads() if expected is None else expected)
