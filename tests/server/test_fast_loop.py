"""The session's receive loop in C++ (server/csrc/fast_loop.h), over DPDK (memif), over
TCP (tcp_link.h) and over TLS (tls_link.h): a real client, the same results with the loop
and without it (REMOTE_ACCEL_SERVER_FAST_LOOP=0), messages it leaves to Python (large writes and reads)
between those it serves, errors of ops it ran reported at the next sync point as Python
reports them, and heartbeats while it runs a long batch. One client process per test
(one EAL per process); and the TCP link's prologues against wire.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from remote_accel._version import WIRE_VERSION
from remote_accel.dataplane import messages as m
from remote_accel.dataplane import wire
from remote_accel.dataplane.wire import MsgType
from remote_accel.errors import MessageTooLarge, ProtocolError
from remote_accel.server import _native
from remote_accel.server.testing import ServerProcess, local_server_certificate

CLIENT_TIMEOUT_S = 240  # EAL start-up is a few seconds; a loaded 2-core machine is slow

PRELUDE = textwrap.dedent("""
    import json, sys, torch
    import remote_accel
    from remote_accel.pytorch_ext import runtime
    if sys.argv[3] == "dpdk":
        remote_accel.init(transport="dpdk", port=0, token=sys.argv[1])
    else:  # TLS: the CA is in REMOTE_ACCEL_TLS_CA
        remote_accel.init(transport="tcp", server=sys.argv[4], token=sys.argv[1])
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
            # 1 MiB each way: longer than the TCP link's read-ahead buffer, so Python reads
            # the write (and a read over 4 KiB is Python's too) between messages the loop serves
            big = torch.randn(512, 512)
            back = (big.to("remote_accel") * 2).cpu()
            rows.append((back[0, :4].tolist(), (big * 2)[0, :4].tolist()))
            assert torch.equal(back, big * 2)
    print(json.dumps({"items": items, "rows": rows, "served": served()}))
""")


_TLS: dict = {}  # the module's certificate for its TLS runs (tls_files)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> None:
    """A CA and its server certificate for 127.0.0.1 (openssl CLI), for _server and _run."""
    _TLS["server_options"], _TLS["ca"] = local_server_certificate(tmp_path_factory.mktemp("pki"))


@pytest.fixture(params=["tcp", pytest.param("tls", marks=pytest.mark.any_torch),
                        pytest.param("dpdk", marks=[pytest.mark.dpdk, pytest.mark.any_torch])])
def transport(request):
    """The conftest's transports and TLS: the TLS link is the TCP link with OpenSSL's reads
    and writes (the TCP run covers the torch side, hence any_torch)."""
    if request.param == "dpdk":
        request.getfixturevalue("needs_dpdk")  # skips where DPDK is missing (fails in CI)
    elif request.param == "tls":
        request.getfixturevalue("tls_files")
    return request.param


def _server(transport: str, **kwargs) -> ServerProcess:
    tls = _TLS["server_options"] if transport == "tls" else ()
    return ServerProcess("--transport", "tcp,dpdk" if transport == "dpdk" else "tcp", *tls,
                         start_timeout=CLIENT_TIMEOUT_S, **kwargs)


def _run(script: str, server: ServerProcess, transport: str, timeout_s: float = 30.0,
         extra: tuple = ()) -> subprocess.CompletedProcess:
    """`script` in a client process of its own; its sys.argv: token, timeout, transport,
    the server's TCP address, then `extra`."""
    host, port = server.tcp
    env = dict(os.environ, **server.client_env())
    if transport == "tls":
        env["REMOTE_ACCEL_TLS_CA"] = _TLS["ca"]
    return subprocess.run([sys.executable, "-c", script, server.token, str(timeout_s), transport, f"{host}:{port}",
                           *extra],
                          env=env, text=True, capture_output=True, timeout=CLIENT_TIMEOUT_S)


def _work(transport: str, fast_loop: str) -> dict:
    env = {"REMOTE_ACCEL_SERVER_FAST_LOOP": fast_loop}
    with _server(transport, env=env) as server:
        proc = _run(WORK, server, transport)
        assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}\n{server.log()}"
        assert server.alive() and "Traceback" not in server.log(), server.log()
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_loop_serves_batches_reads_and_syncs_with_the_results_python_gives(transport):
    fast, slow = _work(transport, "1"), _work(transport, "0")
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


# A training step's small uploads (`x.to(device)`, `t.copy_(cpu)`) leave in the step's
# Batch with their bytes: a CPU server's loop runs such a Batch whole, each WRITE in
# order with the ops around it (an op queued before an upload reads the old bytes).
# A WRITE outside its storage is Python's to report, with the payload the loop kept.
UPLOADS = PRELUDE + textwrap.dedent("""
    from remote_accel.pytorch_ext import handles
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(64, 64, generator=gen).to("remote_accel")
    buf = torch.zeros(64, device="remote_accel")
    rows = []
    for step in range(30):
        x = torch.randn(8, 64, generator=gen)
        y = (x.to("remote_accel") @ w).tanh()  # a fresh storage: ALLOC, WRITE, then ops
        before = buf.sum()  # queued before the upload below: it must see the old bytes
        buf.copy_(torch.full((64,), float(step)))  # a WRITE into a storage ops use
        after = buf * 2
        rows.append([y.sum().item(), before.item(), after.sum().item(), (x @ w.cpu()).tanh().sum().item()])
    # Batches of nothing but uploads, each followed by a SYNC: every one is the loop's
    uploads_before = served()[0]
    for step in range(20):
        up = torch.randn(16, generator=gen).to("remote_accel")
        torch.remote_accel.synchronize()
    upload_batches = served()[0] - uploads_before
    served_before = served()
    # an upload past the end of its storage, queued between two good ones
    small = torch.zeros(4, device="remote_accel")
    sid = handles.announce(small, 0)
    small.copy_(torch.ones(4))
    runtime.session(0).write(sid, 1 << 20, bytes(16))
    small.add_(1)
    try:
        small.sum().item()
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"rows": rows, "error": error, "after_error": small.cpu().tolist(), "uploads": upload_batches,
                      "served": served(), "served_before": served_before}))
""")


def test_batches_with_uploads_run_in_the_loop_in_order_with_python_s_results(transport):
    runs = {}
    for fast_loop in ("1", "0"):
        with _server(transport, env={"REMOTE_ACCEL_SERVER_FAST_LOOP": fast_loop}) as server:
            proc = _run(UPLOADS, server, transport)
            assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}\n{server.log()}"
            assert server.alive(), server.log()
        runs[fast_loop] = json.loads(proc.stdout.strip().splitlines()[-1])
    fast, slow = runs["1"], runs["0"]
    for step, (remote, before, after, local) in enumerate(fast["rows"]):
        assert remote == pytest.approx(local, rel=1e-4, abs=1e-4)
        assert before == (64.0 * (step - 1) if step else 0.0)  # the bytes before this step's upload
        assert after == 64.0 * step * 2
    assert fast["rows"] == slow["rows"]  # bit for bit
    assert fast["uploads"] == 20, fast  # each Batch with an upload ran in the loop
    assert slow["served"] == [0, 0, 0]
    # the bad WRITE: Python's error, told at the next sync point; the session goes on
    assert fast["error"] is not None and "outside storage" in fast["error"], fast["error"]
    assert fast["error"] == slow["error"]
    assert fast["after_error"] == slow["after_error"]


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


def test_an_op_that_fails_in_the_loop_is_reported_at_the_next_sync_point(transport):
    with _server(transport) as server:
        proc = _run(ERRORS, server, transport)
        assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}\n{server.log()}"
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
    # about 9 s, so that a first call slowed by a busy host still leaves well over 3 timeouts
    count = min(500, math.ceil(9.0 / (time.perf_counter() - start)))
    before = served()
    start = time.perf_counter()
    for _ in range(count):  # Batches of planned matmuls, seconds on the server
        b = a @ a
    b.sum().item()
    print(json.dumps({"seconds": time.perf_counter() - start, "before": before, "served": served()}))
""")


def test_a_long_batch_in_the_loop_keeps_sending_heartbeats(transport):
    """The client gives up after 1.5 s of silence; a Batch the loop runs for longer
    must not look like a dead server (the heartbeat thread sees the loop busy)."""
    with _server(transport) as server:
        proc = _run(LONG, server, transport, timeout_s=1.5)
        assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}\n{server.log()}"
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["seconds"] > 3 * 1.5, figures  # far longer than the silence it accepts
    assert figures["served"][0] > figures["before"][0]  # and the loop ran them



# A new memif connection's first round trips touch fresh pages of the shared region:
# without the shim's prefault at connect and accept, each round trip took ~5 minor page
# faults on each side (and twice as long) for the first ~500 of them.
FIRST_TRIPS = PRELUDE + textwrap.dedent("""
    def minor_faults(pid):
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[7])

    server = int(sys.argv[5])
    x = torch.randn(16, device="remote_accel")
    x.sum().item()
    client_before, server_before = minor_faults("self"), minor_faults(server)
    for _ in range(500):
        x.sum().item()
    print(json.dumps({"client": minor_faults("self") - client_before, "server": minor_faults(server) - server_before}))
""")


@pytest.mark.dpdk
def test_a_new_memif_connection_takes_no_page_fault_per_round_trip(needs_dpdk):
    with _server("dpdk") as server:
        proc = _run(FIRST_TRIPS, server, "dpdk", extra=(str(server.proc.pid),))
        assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}\n{server.log()}"
    faults = json.loads(proc.stdout.strip().splitlines()[-1])
    # a few from Python and torch's own allocations; a fault per trip would be 500
    assert faults["client"] < 100 and faults["server"] < 100, faults

# -- the TCP link's prologues (tcp_link.cpp) against wire.py's ----------------------------
_WIRE = (ord("R"), ord("A"), WIRE_VERSION, wire.DEFAULT_LIMITS.max_meta, wire.DEFAULT_LIMITS.max_payloads,
         wire.DEFAULT_LIMITS.max_payload_total)


@pytest.mark.parametrize("meta, payload", [(b"", None), (m.encode(m.Pong(0)), None), (b"\x91\x10", 16),
                                           (bytes(range(256)) * 9, 1 << 33)])
def test_the_tcp_link_encodes_prologues_as_wire_py_does(meta, payload):
    lengths = [] if payload is None else [payload]
    expected = wire.encode_prologue(MsgType.DATA, meta, lengths, req_id=0xDEADBEEF)
    assert _native.wire_encode(_WIRE, int(MsgType.DATA), 0xDEADBEEF, meta, payload) == expected


def test_the_tcp_link_checks_prologues_as_wire_py_does():
    meta = m.encode(m.Pong(7))
    good = wire.encode_prologue(MsgType.SYNC, meta, [], req_id=9)
    status, msg_type, req_id, meta_len, msg_len = _native.wire_check(_WIRE, good)
    assert (status, msg_type, req_id, meta_len, msg_len) == (0, MsgType.SYNC, 9, len(meta), len(good))
    with_payload = wire.encode_prologue(MsgType.WRITE, meta, [5, 6])
    assert _native.wire_check(_WIRE, with_payload)[0] == 0
    assert _native.wire_check(_WIRE, with_payload)[4] == len(with_payload) + 11  # the payloads follow
    # anything wire.py refuses, the link leaves to it (status 1): each byte flipped, a
    # prologue cut short, a meta over the limit
    for i in range(len(good)):
        damaged = bytearray(good)
        damaged[i] ^= 0x40
        assert _native.wire_check(_WIRE, bytes(damaged))[0] == 1, i
        with pytest.raises((ProtocolError, MessageTooLarge)):  # and wire.py refuses it too
            wire.decode_prologue(bytes(damaged))
    assert _native.wire_check(_WIRE, good[:-1])[0] == 1
    small = (*_WIRE[:3], 4, *_WIRE[4:])
    assert _native.wire_check(small, good)[0] == 1
