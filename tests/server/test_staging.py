"""The accelerator code paths (payloads through host staging, copies enqueued on the
session's stream) exercised on a CPU-only host: a server in this process whose device
says it is an accelerator, so every WRITE is staged and every READ copied out."""

from __future__ import annotations

import pytest
import torch

from remote_accel.dataplane import messages as m
from remote_accel.dataplane.tcp import TcpListener
from remote_accel.server.device import ComputeDevice
from remote_accel.server.service import Server
from remote_accel.server.testing import Client, encode_arg


class StagedCpu(ComputeDevice):
    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.accelerator = True  # take the staging paths; streams are no-ops on CPU

    def new_stream(self):
        return None

    def bind_thread(self, stream) -> None:
        pass

    def synchronize(self, stream) -> None:
        pass

    def memory_allocated(self):
        return None

    def empty_cache(self) -> None:
        pass


@pytest.fixture
def staged():
    server = Server(StagedCpu(), "tok", heartbeat_timeout=10)
    listener = TcpListener("127.0.0.1", 0)
    server.serve(listener)
    client = Client.tcp(listener.host, listener.port, token="tok")
    yield client
    client.close()
    server.shutdown()


def test_staged_writes_reads_and_batches(staged):
    c = staged
    x = torch.randn(1000)
    rx = c.upload(x)  # a standalone WRITE: staged, copied when it runs
    assert torch.equal(c.download(rx), x)
    sid = c.new_sid()
    ref = rx._replace(sid=sid)
    out = c.empty((1000,))
    first, second = torch.ones(1000), torch.full((1000,), 3.0)
    c.batch(m.AllocStorage(sid, 4000), m.WriteStorage(sid, 0, 4000),
            m.RunOp("aten::mul.Tensor", encode_arg((ref, rx)), {}, encode_arg((out,))),
            m.WriteStorage(sid, 0, 4000),
            payloads=(first.numpy(), second.numpy()))
    assert torch.equal(c.download(out), x)
    assert torch.equal(c.download(ref), second)
    c.write(12345, b"abcd")  # a bad target: the payload is thrown away, the error kept
    with pytest.raises(Exception, match="bad_handle"):
        c.sync()
    assert c.read(sid, 8, offset=4) == second.numpy().tobytes()[4:12]
