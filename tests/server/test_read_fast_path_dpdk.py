"""The small-READ fast path over DPDK memif, where payload-free messages take the
transport's own short path to the session's sink: the same bytes and errors as over TCP
(test_read_fast_path.py), in a client process of its own (one EAL per process)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from remote_accel.server.testing import ServerProcess

pytestmark = [pytest.mark.dpdk, pytest.mark.any_torch]

try:
    from remote_accel.dataplane import dpdk  # noqa: F401
except ImportError as exc:  # UnavailableError: no DPDK or the shim is not built
    pytest.skip(f"DPDK transport unavailable: {exc}", allow_module_level=True)

CLIENT_TIMEOUT_S = 180  # EAL start-up is a few seconds; a loaded 2-core machine is slow

CLIENT = textwrap.dedent("""
    import sys, torch
    from remote_accel.dataplane import codec
    from remote_accel.dataplane import messages as m
    from remote_accel.dataplane.dpdk import DpdkTransport
    from remote_accel.errors import ProtocolError, RemoteOpError
    from remote_accel.server.testing import Client, encode_arg

    def raises(call, kind, text):
        try:
            call()
        except (RemoteOpError, ProtocolError) as exc:
            assert getattr(exc, "kind", "protocol") == kind and text in str(exc), (kind, text, exc)
            return
        raise SystemExit(f"no {kind} error: {text}")

    c = Client(DpdkTransport.connect(port=0, timeout=30), sys.argv[1])
    data = torch.arange(16, dtype=torch.float32)
    x = c.upload(data)
    raw = data.numpy().tobytes()
    assert c.read(x.sid, 4, 8) == raw[8:12]
    s = c.empty(())
    c.batch(m.RunOp("aten::sum", encode_arg((x,)), {}, encode_arg((s,)), False))
    assert c.read(s.sid, 4) == data.sum().reshape(1).numpy().tobytes()
    raises(lambda: c.read(999, 4), "bad_handle", "unknown storage 999")
    raises(lambda: c.read(x.sid, 8, 60), "bad_handle", f"outside storage {x.sid} of 64 bytes")
    raises(lambda: c.read(x.sid, 4, -4), "protocol", "bad byte range")
    bad = c.empty((3,))
    c.batch(m.RunOp("aten::add.Tensor", encode_arg((x, c.upload(torch.ones(3)))), {}, encode_arg((bad,)), False))
    raises(lambda: c.read(x.sid, 4), "op", "size of tensor")
    raises(lambda: c.read(bad.sid, 4), "bad_handle", f"unknown storage {bad.sid}")
    c.transport.send(int(m.MsgType.READ), codec.encode((x.sid, 0)), req_id=777)
    msg = c.transport.recv(timeout=30)
    while msg.req_id == 0:  # heartbeats
        msg = c.transport.recv(timeout=30)
    reply = m.decode(msg.type, msg.meta)
    assert msg.req_id == 777 and type(reply) is m.ErrorReply and reply.kind == "protocol", reply
    assert c.read(x.sid, 64) == raw
    print("ok")
""")


def test_small_reads_and_their_errors_over_memif():
    with ServerProcess("--transport", "tcp,dpdk", start_timeout=CLIENT_TIMEOUT_S) as server:
        proc = subprocess.run([sys.executable, "-c", CLIENT, server.token], env=dict(os.environ, **server.client_env()),
                              text=True, capture_output=True, timeout=CLIENT_TIMEOUT_S)
        assert proc.returncode == 0 and proc.stdout.startswith("ok"), f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        assert server.alive() and "Traceback" not in server.log(), server.log()
