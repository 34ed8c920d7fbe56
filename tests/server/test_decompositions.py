"""Ops that reach a CPU server with no CPU kernel (no_cpu_kernel_ops.txt, beside this file):
the list is what scripts/list_no_cpu_kernel_ops.py writes for this torch, each op it marks
decomposed resolves to that decomposition, and each decomposition runs on a real server
process (op by op, and inside a graph, replayed and compiled) and gives what a reference
computes: the math the op stands for, or autograd of that math for a backward op.
"""

from __future__ import annotations

import importlib.util
import re
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from remote_accel.dataplane import messages as m
from remote_accel.dataplane.codec import Ext
from remote_accel.server import decompositions, ops
from remote_accel.server.testing import encode_arg
from remote_accel.torch_wire import values as torch_values

LIST = Path(__file__).with_name("no_cpu_kernel_ops.txt")
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "list_no_cpu_kernel_ops.py"
aten = torch.ops.aten


def _script():
    spec = importlib.util.spec_from_file_location("list_no_cpu_kernel_ops", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _listed() -> tuple[str, dict]:
    """(the torch version the list was written with, op -> (status, how or why))."""
    version, rows = "", {}
    for line in LIST.read_text().splitlines():
        if line.startswith("#"):
            found = re.search(r"with torch (\S+);", line)
            version = found.group(1) if found else version
        elif line.strip():
            name, status, detail = line.split(None, 2)
            rows[name] = (status, detail)
    return version, rows


def _release(version: str) -> str:
    return version.split("+")[0]  # 2.13.0+cpu and 2.13.0+cu126 register the same CPU kernels


def _overload(name: str):
    """The OpOverload named, or None where this torch lacks it."""
    op_name, _, overload = name.partition("::")[2].partition(".")
    try:
        return getattr(getattr(aten, op_name), overload or "default")
    except (AttributeError, RuntimeError):
        return None


VERSION, LISTED = _listed()
DECOMPOSED = sorted(name for name, (status, _) in LISTED.items() if status == "decomposed")


def test_the_list_is_what_the_script_writes():
    written = {name: (status, detail) for name, status, detail in _script().rows()}
    if _release(VERSION) == _release(torch.__version__):
        changed = {name: (LISTED.get(name), written.get(name)) for name in LISTED.keys() | written.keys()
                   if LISTED.get(name) != written.get(name)}
        assert not changed, (f"{LIST.name} is out of date (listed, now): {changed}; rewrite it with "
                             f"python {SCRIPT.relative_to(SCRIPT.parents[1])} > tests/server/{LIST.name}")
    else:
        # another torch: ops come and go, and kernels and decompositions appear; what the
        # list says a CPU server serves must still be served where the op still lacks a kernel
        lost = [name for name, (status, _) in LISTED.items()
                if status != "unsupported" and name in written and written[name][0] != status]
        assert not lost, f"torch {torch.__version__} no longer serves {lost} (listed with torch {VERSION})"


@pytest.mark.parametrize("name", DECOMPOSED)
def test_decomposed_ops_resolve_to_their_decomposition(name):
    op = _overload(name)
    if op is None:
        pytest.skip(f"torch {torch.__version__} has no {name}")
    resolved = ops.resolve(name)
    assert resolved.decomposed and resolved.fn is not op
    assert f"{resolved.fn.__module__}.{resolved.fn.__qualname__}" == LISTED[name][1]
    assert str(resolved.schema) == str(op._schema)  # what the executor reads: the named op's


def test_unsupported_ops_keep_the_dispatchers_error():
    for name, (status, _) in LISTED.items():
        op = _overload(name)
        if status == "unsupported" and op is not None:
            assert ops.resolve(name).fn is op, name


def test_ops_are_decomposed_only_where_the_device_lacks_a_kernel():
    softmax = aten._softmax.default  # a decomposition, and a CPU kernel: the kernel runs
    assert decompositions.find(softmax) is not None
    assert decompositions.for_device(softmax, "cpu") is None
    assert ops.resolve("aten::_softmax").fn is softmax
    lstm = aten._thnn_fused_lstm_cell.default
    assert decompositions.for_device(lstm, "cpu") is decompositions.TABLE[lstm]
    if decompositions.has_kernel("aten::_thnn_fused_lstm_cell", "cuda"):  # a CUDA build of torch
        assert decompositions.for_device(lstm, "cuda") is None
        ops.use_device_type("cuda")
        try:
            assert ops.resolve("aten::_thnn_fused_lstm_cell").fn is lstm
        finally:
            ops.use_device_type("cpu")


# -- the RNN cells against autograd of their math ------------------------------------------------
def _lstm_ref(ig, hg, cx, bi, bh):
    gates = ig + hg if bi is None else ig + hg + bi + bh
    i, f, g, o = gates.chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    return o * cy.tanh(), cy, torch.cat((i, f, g, o), 1)


def _gru_ref(ig, hg, hx, bi, bh):
    if bi is not None:
        ig, hg = ig + bi, hg + bh
    ir, iz, in_ = ig.chunk(3, 1)
    hr, hz, hn = hg.chunk(3, 1)
    r, z = (ir + hr).sigmoid(), (iz + hz).sigmoid()
    n = (in_ + r * hn).tanh()
    return (1 - z) * n + z * hx, torch.cat((r, z, n, hx, hn), 1)


def _randn(*shape, dtype=torch.float64, grad=False):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("grads", ["both", "hy", "cy"])
def test_lstm_cell_matches_autograd(bias, grads):
    torch.manual_seed(0)
    ig, hg, cx = _randn(3, 20, grad=True), _randn(3, 20, grad=True), _randn(3, 5, grad=True)
    bi, bh = (_randn(20, grad=True), _randn(20, grad=True)) if bias else (None, None)
    hy, cy, workspace = _lstm_ref(ig, hg, cx, bi, bh)
    with torch.no_grad():
        got = decompositions.TABLE[aten._thnn_fused_lstm_cell.default](ig, hg, cx, bi, bh)
    torch.testing.assert_close(got, (hy, cy, workspace))
    grad_hy = _randn(3, 5) if grads in ("both", "hy") else None
    grad_cy = _randn(3, 5) if grads in ("both", "cy") else None
    pairs = [(t, g) for t, g in ((hy, grad_hy), (cy, grad_cy)) if g is not None]
    inputs = [ig, hg, cx] + ([bi, bh] if bias else [])
    want = torch.autograd.grad([t for t, _ in pairs], inputs, [g for _, g in pairs])
    gates, gcx, gbias = decompositions.TABLE[aten._thnn_fused_lstm_cell_backward_impl.default](
        grad_hy, grad_cy, cx.detach(), cy.detach(), got[2], bias)
    torch.testing.assert_close((gates, gates, gcx), want[:3])
    if bias:
        torch.testing.assert_close((gbias, gbias), want[3:])
    else:
        assert gbias is None


@pytest.mark.parametrize("bias", [True, False])
def test_gru_cell_matches_autograd(bias):
    torch.manual_seed(1)
    ig, hg, hx = _randn(3, 15, grad=True), _randn(3, 15, grad=True), _randn(3, 5, grad=True)
    bi, bh = (_randn(15, grad=True), _randn(15, grad=True)) if bias else (None, None)
    hy, workspace = _gru_ref(ig, hg, hx, bi, bh)
    with torch.no_grad():
        got = decompositions.TABLE[aten._thnn_fused_gru_cell.default](ig, hg, hx, bi, bh)
    torch.testing.assert_close(got, (hy, workspace))  # hn in it with the hidden bias, as CUDA's
    grad = _randn(3, 5)
    inputs = [ig, hg, hx] + ([bi, bh] if bias else [])
    want = torch.autograd.grad(hy, inputs, grad)
    result = decompositions.TABLE[aten._thnn_fused_gru_cell_backward.default](grad, got[1], bias)
    torch.testing.assert_close(result[:len(want)], want)
    assert bias or result[3:] == (None, None)


def test_reduced_precision_cells_compute_in_float32():
    torch.manual_seed(2)
    ig, hg, cx = torch.randn(3, 20), torch.randn(3, 20), torch.randn(3, 5)
    want = decompositions.TABLE[aten._thnn_fused_lstm_cell.default](ig, hg, cx)
    for dtype in (torch.float16, torch.bfloat16):
        got = decompositions.TABLE[aten._thnn_fused_lstm_cell.default](ig.to(dtype), hg.to(dtype), cx.to(dtype))
        assert all(t.dtype == dtype for t in got)
        torch.testing.assert_close([t.float() for t in got], list(want), rtol=2e-2, atol=2e-2)


# -- every decomposition on a real server ---------------------------------------------------------
def _lstm_sample():
    args = tuple(torch.randn(*s) for s in ((3, 16), (3, 16), (3, 4), (16,), (16,)))
    return args, {}, _lstm_ref(*args)


def _gru_sample():
    args = tuple(torch.randn(*s) for s in ((3, 12), (3, 12), (3, 4), (12,), (12,)))
    return args, {}, _gru_ref(*args)


def _masked_scale_sample():
    x, mask = torch.randn(10), torch.rand(10) < 0.5
    return (x, mask, 2.5), {}, (x * mask * 2.5,)


def _lstm_backward_sample():
    ig, hg, cx, bi, bh = _randn(3, 16, dtype=torch.float32, grad=True), _randn(3, 16, dtype=torch.float32), \
        _randn(3, 4, dtype=torch.float32, grad=True), _randn(16, dtype=torch.float32, grad=True), \
        _randn(16, dtype=torch.float32)
    hy, cy, workspace = _lstm_ref(ig, hg, cx, bi, bh)
    grad_hy, grad_cy = torch.randn(3, 4), torch.randn(3, 4)
    want = torch.autograd.grad((hy, cy), (ig, cx, bi), (grad_hy, grad_cy))
    return (grad_hy, grad_cy, cx.detach(), cy.detach(), workspace.detach(), True), {}, want


def _gru_backward_sample():
    ig, hg, hx, bi, bh = (_randn(*s, dtype=torch.float32, grad=True) for s in ((3, 12), (3, 12), (3, 4), (12,), (12,)))
    hy, workspace = _gru_ref(ig, hg, hx, bi, bh)
    grad = torch.randn(3, 4)
    return (grad, workspace.detach(), True), {}, torch.autograd.grad(hy, (ig, hg, hx, bi, bh), grad)


def _out_dtype_sample(op: str, out: bool):
    """mm/bmm/addmm/baddbmm with out_dtype float32 on bfloat16 inputs."""
    batched = op.startswith("b")
    a = torch.randn(*((2,) if batched else ()), 3, 5).bfloat16()
    b = torch.randn(*((2,) if batched else ()), 5, 4).bfloat16()
    want = (a.float() @ b.float())
    args, kwargs = (a, b, torch.float32), {}
    if op in ("addmm", "baddbmm"):
        c = torch.randn(*((2,) if batched else ()), 3, 4).bfloat16()
        args, kwargs, want = (c, *args), {"beta": 0.5, "alpha": 2.0}, 0.5 * c.float() + 2.0 * want
    if out:
        kwargs["out"] = torch.zeros_like(want)
    return args, kwargs, (want,)


def _batch_norm_sample(backward: bool, miopen: bool = False, out: bool = False):
    x, w, b = torch.randn(4, 3, 5), torch.randn(3), torch.randn(3)
    mean, var = torch.zeros(3), torch.ones(3)
    y, save_mean, save_invstd = torch.native_batch_norm(x, w, b, mean.clone(), var.clone(), True, 0.1, 1e-5)
    reserve = torch.empty(0, dtype=torch.uint8)
    if not backward:
        want = (y, save_mean, save_invstd, reserve)
        kwargs = {f"out{i}": torch.zeros_like(t) for i, t in enumerate(want)} if out else {}
        return (x, w, b, mean, var, True, 0.1, 1e-5), kwargs, want
    grad = torch.randn_like(x)
    want = torch.ops.aten.native_batch_norm_backward(grad, x, w, mean, var, save_mean, save_invstd, True, 1e-5,
                                                     [True, True, True])
    return (x, grad, w, mean, var, save_mean, save_invstd, 1e-5) + (() if miopen else (reserve,)), {}, want


def _rms_norm_backward_sample():
    x, w = torch.randn(3, 6, requires_grad=True), torch.randn(6, requires_grad=True)
    grad = torch.randn(3, 6)
    want = torch.autograd.grad(F.rms_norm(x, [6], w, 1e-5), (x, w), grad)
    rstd = aten._fused_rms_norm(x.detach(), [6], w.detach(), 1e-5)[1]
    return (grad, x.detach(), [6], rstd, w.detach(), [True, True]), {}, want


#: op -> () -> (args, kwargs, the expected results); kwargs named out* are out= tensors,
#: and the expected results are then what they hold afterwards.
SAMPLES = {
    "aten::_thnn_fused_lstm_cell": _lstm_sample,
    "aten::_thnn_fused_lstm_cell_backward_impl": _lstm_backward_sample,
    "aten::_thnn_fused_gru_cell": _gru_sample,
    "aten::_thnn_fused_gru_cell_backward": _gru_backward_sample,
    **{f"aten::{op}.{overload}": (lambda op=op, out=overload.endswith("_out"): _out_dtype_sample(op, out))
       for op in ("mm", "bmm", "addmm", "baddbmm") for overload in ("dtype", "dtype_out")},
    "aten::_masked_scale": _masked_scale_sample,
    "aten::_fused_rms_norm_backward": _rms_norm_backward_sample,
    "aten::cudnn_batch_norm": lambda: _batch_norm_sample(False),
    "aten::cudnn_batch_norm.out": lambda: _batch_norm_sample(False, out=True),
    "aten::cudnn_batch_norm_backward": lambda: _batch_norm_sample(True),
    "aten::miopen_batch_norm_backward": lambda: _batch_norm_sample(True, miopen=True),
}
#: decomposed ops checked otherwise: they draw random numbers (see test_fused_dropout)
RANDOM = {"aten::_fused_dropout"}


def test_every_decomposed_op_has_a_sample():
    assert set(DECOMPOSED) - RANDOM <= SAMPLES.keys()


def _run(client, name: str, args: tuple, kwargs: dict, expected: tuple) -> list:
    """Run `name` on the server; its results (or out= tensors) downloaded."""
    upload = lambda v: client.upload(v) if isinstance(v, torch.Tensor) else v  # noqa: E731
    args, kwargs = pytree.tree_map(upload, (args, kwargs))
    written = [ref for key, ref in kwargs.items() if key.startswith("out")]
    if written:  # out= forms: the results alias the out tensors, which the client keeps
        client.run(name, *args, outs=(None,) * len(written), **kwargs)
        return [client.download(ref) for ref in written]
    outs = [None if e is None else client.empty(e.shape, e.dtype) for e in expected]
    client.run(name, *args, outs=tuple(outs), **kwargs)
    return [None if ref is None else client.download(ref) for ref in outs]


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_decompositions_run_on_the_server(client, name):
    if _overload(name) is None:
        pytest.skip(f"torch {torch.__version__} has no {name}")
    torch.manual_seed(3)
    args, kwargs, expected = SAMPLES[name]()
    got = _run(client, name, args, kwargs, expected)
    torch.testing.assert_close(got, list(expected), rtol=1e-5, atol=1e-5)


def test_fused_dropout(client):
    """_fused_dropout draws from the session's default stream; p is the probability to keep."""
    x = torch.randn(1000)
    out, mask = client.empty((1000,)), client.empty((1000,), torch.uint8)
    client.run("aten::_fused_dropout", client.upload(x), 0.6, outs=(out, mask))
    kept = client.download(mask)
    assert set(kept.unique().tolist()) == {0, 1}
    torch.testing.assert_close(client.download(out), x * kept / 0.6)
    # the session's stream moved on: another call draws another mask
    client.run("aten::_fused_dropout", client.upload(x), 0.6, outs=(out, mask))
    assert not torch.equal(client.download(mask), kept)


def _graph_stats(client) -> dict:
    return {k: v for k, v in client.stats().items() if k.startswith("graph")}


def test_decompositions_in_a_graph_replayed_and_compiled(client):
    """A graph naming the LSTM cell and its backward: replayed at once, then compiled by
    the server's compiler thread (Inductor, some seconds on a small CPU)."""
    g = lambda i: Ext(torch_values.GRAPH_VALUE, i)  # noqa: E731
    torch.manual_seed(4)
    inputs = [torch.randn(*s) for s in ((3, 16), (3, 16), (3, 4), (16,), (16,), (3, 4))]
    hy, cy, workspace = _lstm_ref(*inputs[:5])
    grads = decompositions.TABLE[aten._thnn_fused_lstm_cell_backward_impl.default](
        inputs[5], inputs[5], inputs[2], cy, workspace, True)
    want = [hy, *grads]
    nodes = (("aten::_thnn_fused_lstm_cell", tuple(g(i) for i in range(5)), {}),
             ("aten::_thnn_fused_lstm_cell_backward_impl", (g(5), g(5), g(2), g((6, 1)), g((6, 2)), True), {}))
    refs = encode_arg(tuple(client.upload(t) for t in inputs))
    before = _graph_stats(client)
    for call in range(2):
        outs = [client.empty(t.shape) for t in want]
        client.send(m.RunGraph(1, nodes if call == 0 else (), refs,
                               (g((6, 0)), g((7, 0)), g((7, 1)), g((7, 2))) if call == 0 else (),
                               encode_arg(tuple(outs))))
        torch.testing.assert_close([client.download(o) for o in outs], want, rtol=1e-5, atol=1e-6)
        deadline = time.monotonic() + 600
        while call == 0 and time.monotonic() < deadline:
            stats = _graph_stats(client)
            if stats["graph_compiles"] + stats["graph_compile_failures"] > before["graph_compiles"]:
                break
            time.sleep(0.5)
    stats = _graph_stats(client)
    assert stats["graph_compile_failures"] == before["graph_compile_failures"], stats
    assert stats["graph_runs_compiled"] == before["graph_runs_compiled"] + 1, stats
