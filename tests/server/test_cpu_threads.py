"""How many CPU threads the server's kernels use: --threads, OMP_NUM_THREADS, the default."""

from __future__ import annotations

import pytest
import torch

import remote_accel
from remote_accel.server import cpu_threads
from remote_accel.server.testing import ServerProcess


def test_the_default_leaves_a_core_and_takes_one_thread_per_physical_core():
    assert cpu_threads.default_threads({0}, cores=1) == 1
    assert cpu_threads.default_threads({0, 1}, cores=1) == 1  # two SMT siblings
    assert cpu_threads.default_threads({0, 1}, cores=2) == 1
    assert cpu_threads.default_threads(set(range(4)), cores=4) == 3
    assert cpu_threads.default_threads(set(range(16)), cores=8) == 8  # SMT: no more than the cores
    cpus = cpu_threads.usable_cpus()
    assert 1 <= cpu_threads.physical_cores(cpus) <= len(cpus)


def test_the_flag_wins_then_the_environment_then_the_default():
    assert cpu_threads.choose(3, {"OMP_NUM_THREADS": "5"}) == (3, "--threads")
    assert cpu_threads.choose(None, {"OMP_NUM_THREADS": "5"}) == (5, "OMP_NUM_THREADS")
    for unusable in ("", "0", "-2", "4,2", "many"):  # not a plain count: the default
        assert cpu_threads.choose(None, {"OMP_NUM_THREADS": unusable})[0] == cpu_threads.default_threads()


@pytest.mark.parametrize("options, env, expected", [
    ((), {}, None),  # None: the default for this machine
    (("--threads", "3"), {"OMP_NUM_THREADS": "1"}, 3),
    ((), {"OMP_NUM_THREADS": "2"}, 2),
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
            assert f"{threads} CPU threads for the kernels" in f.read()
    assert threads == (cpu_threads.default_threads() if expected is None else expected)
