"""The client's half of a compiled graph call (pytorch_ext/csrc/graph_call.cpp): the input
references and result handles C++ makes per call, against Python's own encoding and
against CPU results, with a real server process (tests/e2e/conftest.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from remote_accel.dataplane import codec
from remote_accel.pytorch_ext import compile as graph_compile
from remote_accel.pytorch_ext import handles
from remote_accel.torch_wire import values as tv

_C = graph_compile._C


def _python_refs(values) -> bytes:
    return codec.encode(tuple(graph_compile._input_ref(v, 0) for v in values))


def _encode_in_cpp(values) -> bytes:
    return _C.graph_inputs(values, 0, lambda v: codec.encode(graph_compile._input_ref(v, 0)))


@pytest.mark.parametrize("dtype", list(tv.DTYPES.values()), ids=list(tv.DTYPES))
def test_input_references_are_the_bytes_python_encodes(remote, dtype):
    t = torch.empty(6, 10, dtype=dtype, device="remote_accel")
    values = [t, t[1:, 2:7].t(), t[3], 7, None, 2.5, torch.tensor(3.0)]
    encoded = _encode_in_cpp(values)
    assert encoded == _python_refs(values)
    decoded = codec.decode(encoded)
    assert decoded[1].code == tv.TENSOR and decoded[1].value[1] == tv.dtype_name(dtype)
    assert decoded[1].value[2:5] == ((5, 5), (1, 10), 12)  # shape, stride, offset of the view
    # and a graph may return it: C++ knows every dtype the wire names
    (made,), outs = _C.GraphResults([((2, 3), (1, 2), tv.dtype_name(dtype))]).make(0)
    assert made.dtype == dtype and made.stride() == (1, 2)
    assert outs == codec.encode((handles.output_ref(made, 0),))


def test_conjugate_and_negative_views_carry_their_bits(remote):
    z = torch.randn(4, 3, dtype=torch.complex64).to("remote_accel")
    values = [z.conj(), torch._neg_view(z), z]
    encoded = _encode_in_cpp(values)
    assert encoded == _python_refs(values)
    flags = [ref.value[5] for ref in codec.decode(encoded)]
    assert flags == [tv.FLAG_CONJ, tv.FLAG_NEG, 0]


def test_values_of_other_devices_are_refused_as_python_refuses_them(remote):
    with pytest.raises(RuntimeError, match="cannot mix in a tensor on meta"):
        _encode_in_cpp([torch.zeros(4, device="remote_accel"), torch.zeros(4, device="meta")])
    with pytest.raises(TypeError, match="must return bytes"):
        _C.graph_inputs([1], 0, lambda v: "not bytes")
    with pytest.raises(ValueError, match="too large"):
        _encode_in_cpp([torch.zeros(1 << 15)])  # a CPU tensor too large to inline


def test_result_handles_are_fresh_tensors_of_the_promised_layouts(remote):
    specs = [((2, 3), (3, 1), "float32"), None, ((4, 2), (1, 4), "int64"), ((), (), "bool")]
    made = _C.GraphResults(specs)
    results, outs = made.make(0)
    again, _ = made.make(0)
    assert results[1] is None
    decoded = codec.decode(outs)
    assert decoded[1] is None
    for t, spec, ref in zip(results, specs, decoded):
        if spec is None:
            continue
        assert t.device == torch.device("remote_accel", 0)
        assert (tuple(t.shape), t.stride(), tv.dtype_name(t.dtype)) == spec
        assert t.storage_offset() == 0 and t.untyped_storage().nbytes() >= t.numel() * t.element_size()
        assert outs  # the references name these very storages
        assert ref.value[:5] == (handles.announce(t, 0), spec[2], spec[0], spec[1], 0)
    sids = {handles.announce(t, 0) for t in (*results, *again) if t is not None}
    assert len(sids) == 6  # every call makes new storages
    with pytest.raises(ValueError, match="unknown dtype"):
        _C.GraphResults([((1,), (1,), "float99")])
    with pytest.raises(ValueError, match="differ in length"):
        _C.GraphResults([((1, 2), (1,), "float32")])


def test_result_handles_over_the_memory_limit_raise_out_of_memory(remote):
    from remote_accel.pytorch_ext import runtime

    made = _C.GraphResults([((1 << 20,), (1,), "float32")])
    handles.set_memory_limit(0, 1 << 20)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            made.make(0)
    finally:
        handles.set_memory_limit(0, runtime.sessions()[0].welcome.memory_limit)
    results, _ = made.make(0)
    assert results[0].shape == (1 << 20,)


def test_compiled_training_follows_cpu_and_sends_each_graph_once(remote):
    """Forward, backward and AdamW step compiled, several steps: losses and weights as on
    CPU, though only the first call of each graph carries its nodes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))
    remote_model = copy.deepcopy(model).to("remote_accel")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    remote_opt = torch.optim.AdamW(remote_model.parameters(), lr=1e-2, capturable=True)
    compiled = torch.compile(remote_model, backend="remote_accel")
    opt_step = torch.compile(remote_opt.step, backend="remote_accel")
    x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
    xr, yr = x.to("remote_accel"), y.to("remote_accel")
    for _ in range(4):
        opt.zero_grad()
        remote_opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        remote_loss = nn.functional.cross_entropy(compiled(xr), yr)
        remote_loss.backward()
        opt_step()
        torch.testing.assert_close(remote_loss.cpu(), loss)
    for p, q in zip(remote_model.parameters(), model.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_a_graph_whose_inputs_change_shape(remote):
    """dynamic=True: the graph takes the batch size as an input (a plain int on the wire,
    encoded by Python beside the tensors C++ encodes); the result handles, whose layouts a
    graph fixes when it is compiled, follow every shape."""
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU())
    remote_model = copy.deepcopy(model).to("remote_accel")
    compiled = torch.compile(remote_model, backend="remote_accel", dynamic=True)
    for rows in (2, 5, 3, 9):
        x = torch.randn(rows, 4)
        out = compiled(x.to("remote_accel"))
        assert out.shape == (rows, 6)
        torch.testing.assert_close(out.cpu(), model(x))
    torch._dynamo.reset()
