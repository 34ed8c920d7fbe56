"""raccl where the ranks' sessions are not plain TCP: over TLS (the servers' own
connections to each other then speak TLS too, checked with the CA each rank shares), and
over DPDK (memif) with two ranks sharing one server, which joins the group twice."""

from __future__ import annotations

import re

import pytest

from remote_accel.dataplane.tls import client_context
from remote_accel.server.testing import ServerProcess, local_server_certificate
from torchrun_jobs import server_stats, torchrun

pytestmark = pytest.mark.any_torch  # transports: no torch version changes them


def test_ddp_over_tls_sessions_with_tls_between_the_servers(tmp_path):
    tls, ca = local_server_certificate(tmp_path)
    with ServerProcess(*tls, token="a") as a, ServerProcess(*tls, token="b") as b:
        job = torchrun("ddp_job.py", 2, [a, b], "plain", env={"REMOTE_ACCEL_TLS_CA": ca})
        assert job.returncode == 0, job.text()
        (r0, r1) = job.starting("RESULT")
        assert float(r0.split()[1]) <= 1e-5 and float(r1.split()[1]) <= 1e-5, job.text()
        # the scenario: the gradients went between the two servers, whose only listeners speak TLS
        received = [server_stats(s, client_context(ca))["group_bytes_received"] for s in (a, b)]
        assert all(n > 0 for n in received), received
        # each took the other's group connection over TLS (its listener speaks nothing else)
        assert all(re.search(r"client connected: session \d+, tls:\S+ \(group ", s.log()) for s in (a, b))


@pytest.mark.dpdk
def test_two_ranks_over_memif_on_one_server(needs_dpdk):
    with ServerProcess("--transport", "tcp,dpdk", token="one") as server:
        env = {"REMOTE_ACCEL_TRANSPORT": "dpdk", **server.client_env()}
        job = torchrun("ddp_job.py", 2, [server], "plain", env=env)
        assert job.returncode == 0, job.text()
        results = job.starting("RESULT")
        assert len(results) == 2 and all(float(r.split()[1]) <= 1e-5 for r in results), job.text()
        stats = server_stats(server)
        # the scenario: both ranks came over memif (DPDK sessions), and the one server held
        # both ranks of the group, their data crossing its own TCP listener
        assert stats["group_bytes_received"] > 0 and stats["group_members"] == 0  # both left at the end
        assert "dpdk" in server.log() and server.log().count("client connected") >= 2
