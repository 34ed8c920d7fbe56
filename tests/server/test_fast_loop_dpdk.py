"""The DPDK session's receive loop in C++ (server/csrc/fast_loop.h): a real client over
memif, the same results with the loop and without it (REMOTE_ACCEL_SERVER_FAST_LOOP=0),
errors of ops it ran reported at the next sync point as Python reports them, and
heartbeats while it runs a long batch. One client process per test (one EAL per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from remote_accel.server.testing import ServerProcess

pytestmark = pytest.mark.dpdk

try:
    from remote_accel.dataplane import dpdk  # noqa: F401
except ImportError as exc:  # UnavailableError: no DPDK or the shim is not built
    pytest.skip(f"DPDK transport unavailable: {exc}", allow_module_level=True)

CLIENT_TIMEOUT_S = 240  # EAL start-up is a few seconds; a loaded 2-core machine is slow

PRELUDE = textwrap.dedent("""
    import json, sys, torch
    import remote_accel
    from remote_accel.pytorch_ext import runtime
    remote_accel.init(transport="dpdk", port=0, token=sys.argv[1])
    runtime.session(0).timeout = float(sys.argv[2])  # silence a sync accepts (connecting keeps the default)
    served = lambda: runtime.session(0).stats()["fast_loop_served"]
""")

# Planned ops (their second call on is served from C++ plans: Batches of RunPlanned),
# scalars read with .item(), small tensors with .cpu(), and synchronize(): what a
# training step's sync points send. Prints what it read, and what the loop served.
WORK = PRELUDE + textwrap.dedent("""
    torch.manual_seed(0)
    x = torch.randn(64)
    w = torch.randn(64, 64)
    rx, rw = x.to("remote_accel"), w.to("remote_accel")
    items, rows = [], []
    for step in range(40):
        x = torch.tanh(w @ x + 0.5)
        rx = torch.tanh(rw @ rx + 0.5)
        items.append((rx.sum().item(), x.sum().item()))
        rows.append((rx[:4].cpu().tolist(), x[:4].tolist()))
        if step % 10 == 0:
            torch.remote_accel.synchronize()
    print(json.dumps({"items": items, "rows": rows, "served": served()}))
""")


def _run(script: str, server: ServerProcess, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, server.token, str(timeout_s)],
                          env=dict(os.environ, **server.client_env()), text=True, capture_output=True,
                          timeout=CLIENT_TIMEOUT_S)


def _work(fast_loop: str) -> dict:
    env = {"REMOTE_ACCEL_SERVER_FAST_LOOP": fast_loop}
    with ServerProcess("--transport", "tcp,dpdk", start_timeout=CLIENT_TIMEOUT_S, env=env) as server:
        proc = _run(WORK, server)
        assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{server.log()}"
        assert server.alive() and "Traceback" not in server.log(), server.log()
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_loop_serves_batches_reads_and_syncs_with_the_results_python_gives():
    fast, slow = _work("1"), _work("0")
    batches, reads, syncs = fast["served"]
    # every step's chain is a Batch of planned ops, each .item() a READ; the first
    # synchronize() after a read asks the server
    assert batches >= 30 and reads >= 60 and syncs >= 1, fast["served"]
    assert slow["served"] == [0, 0, 0]
    for remote, local in fast["items"]:
        assert remote == pytest.approx(local, rel=1e-4, abs=1e-4)
    for remote, local in fast["rows"]:
        assert remote == pytest.approx(local, rel=1e-4, abs=1e-4)
    assert fast["items"] == slow["items"] and fast["rows"] == slow["rows"]  # bit for bit


ERRORS = PRELUDE + textwrap.dedent("""
    from remote_accel.errors import RemoteOpError
    x = torch.arange(8.0, device="remote_accel")
    good = torch.tensor([1, 2], device="remote_accel")
    wrong = torch.tensor([1, 80], device="remote_accel")  # the server finds index 80 out of range
    x.index_select(0, good).sum().item()  # the first call goes through Python and makes a plan
    before = served()
    # The same op from its plan, in a Batch the C++ loop runs: the failure stops the Batch
    # there, and the next sync point (a READ it would serve) reports it instead.
    bad = x.index_select(0, wrong)
    after = x.index_select(0, good) * 2  # runs: an error does not stop the later ops
    try:
        bad.sum().item()
        raise SystemExit("no error at the sync point")
    except RemoteOpError as exc:
        assert "index out of range" in str(exc), exc
    assert after.sum().item() == 6.0  # the session goes on: the next READ is served again
    assert (x + 1).sum().item() == 36.0
    print(json.dumps({"before": before, "end": served()}))
""")


def test_an_op_that_fails_in_the_loop_is_reported_at_the_next_sync_point():
    with ServerProcess("--transport", "tcp,dpdk", start_timeout=CLIENT_TIMEOUT_S) as server:
        proc = _run(ERRORS, server)
        assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{server.log()}"
        assert server.alive(), server.log()
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["end"][0] > figures["before"][0]  # the failing Batch went through the loop
    assert figures["end"][1] > figures["before"][1]  # and reads after the error were served there


LONG = PRELUDE + textwrap.dedent("""
    import math, time
    a = torch.randn(1500, 1500, device="remote_accel")
    (a @ a).sum().item()  # the first call makes the plan
    start = time.perf_counter()
    (a @ a).sum().item()  # the second tells how long one takes
    count = min(500, math.ceil(6.0 / (time.perf_counter() - start)))
    before = served()
    start = time.perf_counter()
    for _ in range(count):  # Batches of planned matmuls, about 6 s on the server
        b = a @ a
    b.sum().item()
    print(json.dumps({"seconds": time.perf_counter() - start, "before": before, "served": served()}))
""")


def test_a_long_batch_in_the_loop_keeps_sending_heartbeats():
    """The client gives up after 1.5 s of silence; a Batch the loop runs for longer
    must not look like a dead server (the heartbeat thread sees the loop busy)."""
    with ServerProcess("--transport", "tcp,dpdk", start_timeout=CLIENT_TIMEOUT_S) as server:
        proc = _run(LONG, server, timeout_s=1.5)
        assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{server.log()}"
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["seconds"] > 3 * 1.5, figures  # far longer than the silence it accepts
    assert figures["served"][0] > figures["before"][0]  # and the loop ran them
