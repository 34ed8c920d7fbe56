"""Ops of other libraries (torchvision::nms, ...): served by namespace, as the server's
configuration (--op-namespaces) allows, with a clear error for the rest.

tests/libs/ra_test_ops.py plays the library: a real module registering `ra_test::` ops
with a CPU kernel, imported by the server at start-up from its configuration.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from remote_accel.errors import RemoteOpError
from remote_accel.server.__main__ import build_parser, parse_namespaces
from remote_accel.server.testing import Client, Ref, ServerProcess

LIBS = str(pathlib.Path(__file__).parents[1] / "libs")
LIB_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [LIBS, os.environ.get("PYTHONPATH")]))}
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


def test_namespace_option():
    assert build_parser().parse_args([]).op_namespaces is None  # auto: torchvision where it imports
    assert parse_namespaces("auto") is None
    assert parse_namespaces("none") == {}
    assert parse_namespaces("torchvision, ra_test=ra_test_ops") == {"torchvision": "torchvision",
                                                                    "ra_test": "ra_test_ops"}
    for bad in ("os.path", "a b", "x=", "x=..y", "x=os;rm", "::"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_namespaces(bad)


def test_a_library_that_does_not_import_stops_the_server(tmp_path):
    out = subprocess.run([sys.executable, "-m", "remote_accel.server", "--op-namespaces", "ra_missing",
                          "--device", "cpu", "--listen", "127.0.0.1:0", "--token-file", str(tmp_path / "t")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "op namespace 'ra_missing': importing ra_missing failed" in out.stderr, out.stderr


@pytest.fixture(scope="module")
def lib_server():
    with ServerProcess("--op-namespaces", "ra_test=ra_test_ops", env=LIB_ENV) as server:
        yield server
        assert "Traceback" not in server.log(), server.log()


def test_enabled_namespace_runs_its_ops(lib_server):
    with Client.tcp(*lib_server.tcp, token=lib_server.token) as c:
        x = torch.tensor([1.0, -2.0, 3.0])
        rx, out = c.upload(x), c.empty((3,))
        c.run("ra_test::scale", rx, 2.5, outs=(out,))
        assert torch.equal(c.download(out), x * 2.5)
        # a data-dependent op: the server says the result's shape
        sid = c.new_sid()
        ((nbytes, dtype, shape, stride, offset),) = c.run_reply("ra_test::positive", rx, outs=(sid,))
        assert torch.equal(c.download(Ref(sid, torch.float32, shape, stride, offset)), torch.tensor([1.0, 3.0]))
        c.run("aten::add.Tensor", rx, rx, outs=(out,))  # aten stays served
        assert torch.equal(c.download(out), x + x)


def test_namespace_not_enabled_is_refused_with_the_option_to_enable_it(lib_server):
    with Client.tcp(*lib_server.tcp, token=lib_server.token) as c:
        x = c.upload(torch.rand(4, 4))
        with pytest.raises(RemoteOpError, match=r"unknown_op.*'torchvision'.*does not serve \(it serves aten, "
                                                r"ra_test\): start it with --op-namespaces torchvision"):
            c.run_reply("torchvision::nms", x, torch.rand(4), 0.5, outs=(c.new_sid(),))
        # names from the wire are never imported: a module's name is just an unknown namespace
        with pytest.raises(RemoteOpError, match=r"namespace 'os'"):
            c.run_reply("os::system", "true", outs=())
        c.ping()  # the session survives


def test_default_server_does_not_serve_other_libraries():
    with ServerProcess(env=LIB_ENV) as server, Client.tcp(*server.tcp, token=server.token) as c:
        x = c.upload(torch.ones(2))
        with pytest.raises(RemoteOpError, match=r"namespace 'ra_test'.*--op-namespaces ra_test"):
            c.run_reply("ra_test::scale", x, 2.0, outs=(c.new_sid(),))


def _boxes(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g) * 50
    boxes = torch.cat([xy, xy + 5 + torch.rand(n, 2, generator=g) * 20], dim=1)
    return boxes, torch.rand(n, generator=g)


def test_torchvision_ops_follow_the_servers_install():
    """torchvision is served by default where it imports; where it does not, its ops say so."""
    boxes, scores = _boxes(40)
    with ServerProcess() as server, Client.tcp(*server.tcp, token=server.token) as c:
        args = (c.upload(boxes), c.upload(scores), 0.3)
        if HAS_TORCHVISION:
            import torchvision

            sid = c.new_sid()
            ((nbytes, dtype, shape, stride, offset),) = c.run_reply("torchvision::nms", *args, outs=(sid,))
            kept = c.download(Ref(sid, torch.int64, shape, stride, offset))
            expected = torchvision.ops.nms(boxes, scores, 0.3)
            assert dtype == "int64" and 0 < len(expected) < len(boxes)
            assert torch.equal(kept, expected)
        else:
            with pytest.raises(RemoteOpError, match=r"needs torchvision on the server, which cannot load it "
                                                    r"\(importing torchvision failed: .*\): install torchvision"):
                c.run_reply("torchvision::nms", *args, outs=(c.new_sid(),))
        assert ("op namespaces aten,torchvision" if HAS_TORCHVISION else "op namespaces aten") in server.log()


def test_none_serves_aten_only():
    with ServerProcess("--op-namespaces", "none") as server, Client.tcp(*server.tcp, token=server.token) as c:
        x = c.upload(torch.rand(3, 4))
        with pytest.raises(RemoteOpError, match=r"does not serve \(it serves aten\)"):
            c.run_reply("torchvision::nms", x, torch.rand(3), 0.5, outs=(c.new_sid(),))
