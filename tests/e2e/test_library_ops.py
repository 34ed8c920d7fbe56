"""Ops that other libraries register (torchvision::nms, ...) on remote_accel tensors: the
client's fallback sends them like aten ops, a server that serves their namespace runs
them, and one that does not says how to make it.

tests/libs/ra_test_ops.py plays the library on both sides (torchvision itself is covered
by tests/models, in the environment that has it).
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest
import torch

import remote_accel
from remote_accel.errors import RemoteAccelError
from remote_accel.server.testing import ServerProcess

LIBS = str(pathlib.Path(__file__).parents[1] / "libs")
LIB_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [LIBS, os.environ.get("PYTHONPATH")]))}
sys.path.insert(0, LIBS)
import ra_test_ops  # noqa: E402,F401  (registers ra_test:: on this side too)

R = "remote_accel"


def _connect(server: ServerProcess) -> None:
    host, port = server.tcp
    remote_accel.init(transport="tcp", server=f"{host}:{port}", token=server.token)


def test_library_ops_run_on_a_server_that_serves_them():
    with ServerProcess("--op-namespaces", "ra_test=ra_test_ops", env=LIB_ENV) as server:
        _connect(server)
        try:
            x = torch.tensor([[1.0, -2.0], [3.0, -4.0]])
            rx = x.to(R)
            for factor in (2.5, 2.5, -1.0):  # the second call is served from the first one's plan
                y = torch.ops.ra_test.scale(rx, factor)
                assert y.device.type == R and y.shape == x.shape  # from the Meta kernel, no round trip
                assert torch.equal(y.cpu(), x * factor)
            # no Meta kernel (a data-dependent result): the server says the shape
            p = torch.ops.ra_test.positive(rx)
            assert p.shape == (2,) and torch.equal(p.cpu(), torch.tensor([1.0, 3.0]))
            assert torch.equal((torch.ops.ra_test.scale(p, 2.0) + 1).cpu(), torch.tensor([3.0, 7.0]))
        finally:
            remote_accel.shutdown()
        assert "Traceback" not in server.log(), server.log()


def test_a_server_without_the_namespace_says_how_to_allow_it():
    with ServerProcess(env=LIB_ENV) as server:
        _connect(server)
        try:
            x = torch.ones(3, device=R)
            with pytest.raises(RemoteAccelError, match=r"namespace 'ra_test'.*--op-namespaces ra_test"):
                torch.ops.ra_test.scale(x, 2.0).cpu()
            assert torch.equal((x + 1).cpu(), torch.full((3,), 2.0))  # the device goes on working
        finally:
            remote_accel.shutdown()
