"""torch.distributed on remote_accel as users run it: `torchrun` starts the ranks (real
processes, torch's own launcher), each rank's device is a real server process
(torchrun_jobs.py runs the *_job.py scripts of this folder)."""

from __future__ import annotations

import os
import sys

import pytest

from remote_accel.server.testing import ServerProcess

sys.path.insert(0, os.path.dirname(__file__))  # torchrun_jobs, the suite's helper


@pytest.fixture(scope="module")
def two_servers():
    with ServerProcess(token="rank-0-token") as a, ServerProcess(token="rank-1-token") as b:
        yield [a, b]
