"""Run a job of this folder (a *_job.py script) under torchrun, every rank's device a real
server process; the scripts never import remote_accel: the device comes from the
environment (REMOTE_ACCEL_SERVER, REMOTE_ACCEL_TOKEN), as torchrun users set it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

from remote_accel.server.testing import Client, ServerProcess

HERE = Path(__file__).parent
#: a job that hangs fails its test after this long; every failure case ends in seconds
JOB_TIMEOUT_S = 300


class Job(NamedTuple):
    returncode: int
    lines: list  # every line of the ranks' and torchrun's output

    def starting(self, word: str) -> list:
        return [line.split(" ", 1)[1] if " " in line else "" for line in self.lines if line.split(" ", 1)[0] == word]

    def text(self) -> str:
        return "\n".join(self.lines[-120:])


def torchrun(script: str, ranks: int, servers: Sequence[ServerProcess], *args: str, env: Optional[dict] = None,
             restarts: int = 0) -> Job:
    """`torchrun --standalone --nproc_per_node RANKS script args`, every rank seeing
    `servers` as remote_accel:0.. (each rank takes remote_accel:LOCAL_RANK, or the one
    server there is). With `restarts`: `--max-restarts RESTARTS` on a static rendezvous
    (`--master_port`), where torch's own restarts work (in torch 2.13, a c10d rendezvous's
    second round did not start gloo, with or without remote_accel)."""
    run_env = dict(os.environ, REMOTE_ACCEL_SERVER=",".join(map(address, servers)),
                   REMOTE_ACCEL_TOKEN=",".join(s.token for s in servers), **(env or {}))
    if restarts:
        launch = ["--master_port", str(_free_port()), "--max-restarts", str(restarts)]
    else:
        launch = ["--standalone"]
    with tempfile.TemporaryDirectory(prefix="torchrun-") as logs:
        # each rank's output in a file of its own (--redirects 3): lines of two ranks
        # printed at once do not run into each other
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", *launch, "--nproc_per_node", str(ranks),
                               "--log-dir", logs, "--redirects", "3", str(HERE / script), *args], env=run_env,
                              capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
        ranks_output = []
        for path in sorted(Path(logs).rglob("std*.log"), key=lambda p: (str(p.parent.parent), str(p))):
            ranks_output += path.read_text(errors="replace").splitlines()
    return Job(proc.returncode, ranks_output + (proc.stdout + proc.stderr).splitlines())


def ranks_alone(script: str, ranks: int, servers: Sequence[ServerProcess], *args: str,
                env: Optional[dict] = None) -> list:
    """The ranks of a job started as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR...),
    without its agent, which ends every rank once one fails: to see what the others do.
    Returns each rank's Job."""
    base = dict(os.environ, REMOTE_ACCEL_SERVER=",".join(map(address, servers)),
                REMOTE_ACCEL_TOKEN=",".join(s.token for s in servers), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(_free_port()), WORLD_SIZE=str(ranks), **(env or {}))
    procs = [subprocess.Popen([sys.executable, str(HERE / script), *args], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=dict(base, RANK=str(r), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(ranks)))
             for r in range(ranks)]
    jobs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        jobs.append(Job(proc.returncode, out.splitlines()))
    return jobs


def address(server: ServerProcess) -> str:
    """"HOST:PORT" of the server's TCP listener, plain or TLS."""
    return next(a.split(":", 1)[1] for a in server.addresses if a.startswith(("tcp:", "tls:")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_stats(server: ServerProcess, tls=None) -> dict:
    """The server's figures (a STATS round trip of a client of its own; `tls`: the
    ssl.SSLContext of a TLS server's clients)."""
    host, port = address(server).rsplit(":", 1)
    with Client.tcp(host, int(port), token=server.token, tls=tls) as c:
        return c.stats()
