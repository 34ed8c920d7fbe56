"""raccl's collectives against gloo's on the same CPU tensors: three ranks under torchrun,
each on a server of its own, so that trees are uneven and rings have three chunks."""

from __future__ import annotations

import pytest

from remote_accel.server.testing import ServerProcess
from torchrun_jobs import server_stats, torchrun


@pytest.fixture(scope="module")
def three_servers():
    with ServerProcess(token="t0") as a, ServerProcess(token="t1") as b, ServerProcess(token="t2") as c:
        yield [a, b, c]


def test_every_collective_gives_gloo_s_results_and_moves_between_servers(three_servers):
    before = [server_stats(s) for s in three_servers]
    job = torchrun("collectives_job.py", 3, three_servers)
    assert job.returncode == 0, job.text()
    done = job.starting("done")
    assert len(done) == 3, job.text()  # every rank ran every check
    checks = sum(int(d.split()[0]) for d in done)
    oks = job.starting("ok")
    assert not job.starting("MISMATCH"), job.text()
    assert len(oks) == checks and checks >= 140, job.text()
    # the scenario: the data went server to server (each server sent and received some),
    # and every rank joined its group on its own server
    after = [server_stats(s) for s in three_servers]
    for b, a in zip(before, after):
        assert a["group_bytes_sent"] > b["group_bytes_sent"] and a["group_bytes_received"] > b["group_bytes_received"]
        assert a["group_collectives"] - b["group_collectives"] >= 50

