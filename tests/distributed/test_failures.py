"""A process group that goes wrong fails every rank with words, within its timeouts, and
never hangs: ranks that disagree, a reduction the dtype refuses, a rank that never comes,
a server killed under a rank, a rank that dies (torchrun then restarts the job, which
goes on from its own checkpoint)."""

from __future__ import annotations

import os
import signal

import pytest

from torchrun_jobs import ranks_alone, torchrun

pytestmark = pytest.mark.any_torch  # the servers' side: no torch version changes it


@pytest.fixture
def fresh_servers():
    from remote_accel.server.testing import ServerProcess

    with ServerProcess(token="a") as a, ServerProcess(token="b") as b:
        yield [a, b]


def test_bad_input_fails_every_rank_saying_why_and_the_other_groups_go_on(two_servers):
    job = torchrun("bad_input_job.py", 2, two_servers)
    assert job.returncode == 0, job.text()
    assert len(job.starting("done")) == 2, job.text()

    def raised(case: str) -> list:
        return [line for line in job.starting(case) if line.startswith("raised")]

    # each case happened on both ranks (or on the rank that took part), then each says why
    assert len(raised("shapes")) == 2 and all("the ranks disagree" in r and "10 float32" in r and
                                               "11 float32" in r for r in raised("shapes")), job.text()
    assert len(raised("dtype")) == 2 and all("AVG needs a floating-point tensor" in r for r in raised("dtype"))
    # a rank that never reaches the group's first collective: named when the others join
    # it; one that skips a later collective: named by the servers, after the group's timeout (5 s)
    assert len(raised("absent")) == 1 and "rank(s) [1]" in raised("absent")[0], job.text()
    assert len(raised("absent_later")) == 1 and "did not take part" in raised("absent_later")[0], job.text()
    for line in raised("absent") + raised("absent_later"):
        assert float(line.split()[2]) < 60, line  # the group's timeout ended it: no hang
    assert job.starting("default") == ["group works: [3.0, 3.0, 3.0, 3.0]"] * 2, job.text()


def test_a_killed_server_fails_every_rank_with_what_happened(fresh_servers):
    pids = ",".join(str(s.proc.pid) for s in fresh_servers)
    job = torchrun("failure_job.py", 2, fresh_servers, "server_dies", env={"RACCL_TEST_SERVER_PIDS": pids})
    assert len(job.starting("rank")) >= 2, job.text()  # both joined and summed before the kill
    raised = job.starting("raised")
    assert len(raised) == 2, job.text()
    # the rank whose server died hears it from its own session; the other from its server,
    # which lost its connection to the dead one: neither goes on with data it did not get
    assert any("is gone" in r for r in raised) and any("closed its connection" in r for r in raised), job.text()
    assert not fresh_servers[1].alive()


def test_a_frozen_server_fails_every_rank_within_the_timeout(fresh_servers):
    frozen = fresh_servers[1]
    pids = ",".join(str(s.proc.pid) for s in fresh_servers)
    try:
        job = torchrun("failure_job.py", 2, fresh_servers, "server_freezes", env={"RACCL_TEST_SERVER_PIDS": pids})
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)
    raised = job.starting("raised")
    assert len(job.starting("rank")) >= 2 and len(raised) == 2, job.text()  # both joined, then both raised
    # the rank on the frozen server hears its silence; the other from its server, which no
    # longer hears the frozen one's pings: both within the clients' timeout (10 s), not the group's
    assert any("froze" in r and "silent" in r for r in raised), job.text()
    assert any("no message for 10 s" in r for r in raised), job.text()
    assert all(float(r.split()[0]) < 30 for r in raised), raised


def test_a_rank_that_dies_fails_the_others_at_once(two_servers):
    """Started without torchrun's agent, which would end the survivor itself."""
    survivor, dead = ranks_alone("failure_job.py", 2, two_servers, "peer_dies")
    assert dead.returncode == 17 and "dies now" in dead.lines, dead.lines  # the scenario
    (raised,) = [line for line in survivor.lines if line.startswith("raised")]
    assert "rank 1 stopped the group" in raised and "its client is gone" in raised, survivor.lines
    assert float(raised.split()[1]) < 30, raised  # at once, not at the group's timeout


def test_a_rank_that_dies_stops_its_peers_and_torchrun_restarts_the_job_from_its_checkpoint(fresh_servers,
                                                                                            tmp_path):
    job = torchrun("restart_job.py", 2, fresh_servers, str(tmp_path), restarts=1)
    assert job.returncode == 0, job.text()
    steps = job.starting("STEP")
    # the scenario: steps 0-2 in the first attempt, the last rank died at step 3, and the
    # second attempt went on from the checkpoint
    assert steps == ["0 ATTEMPT 0", "1 ATTEMPT 0", "2 ATTEMPT 0", "3 ATTEMPT 1", "4 ATTEMPT 1", "5 ATTEMPT 1"], job.text()
    (final,) = job.starting("FINAL")
    assert float(final) <= 1e-5, job.text()  # as one process trained on the whole batch for every step
