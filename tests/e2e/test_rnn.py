"""Recurrent layers on remote_accel against CPU: outputs, final states and the gradients of
inputs, initial states and every parameter. A real server process over TCP.

On remote_accel (as on CUDA) aten's LSTM and GRU cells call the fused ops
`_thnn_fused_lstm_cell` / `_thnn_fused_gru_cell` and their backward ops, which have no CPU
kernel: a CPU server runs its decompositions of them (server/decompositions.py). The
plain RNN cells are ordinary aten ops and are checked alongside.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils import _pytree as pytree

R = "remote_accel"
# the server computes the gates in another order than CPU's cells (the fused op adds
# the biases after the products), so results differ by rounding only
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.float64: {"rtol": 1e-12, "atol": 1e-12}}


def _floats(value) -> list:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _step(module: nn.Module, build) -> tuple:
    """module(*args) and backward from a fixed weighting of every output; build(leaf) ->
    (args, the input leaves whose gradients are compared)."""
    args, leaves = build(lambda t: t.detach().to(next(module.parameters()).device).requires_grad_())
    outputs = _floats(module(*args))
    loss = sum((t * torch.linspace(-1, 1, t.numel(), dtype=t.dtype, device=t.device).reshape(t.shape)).sum()
               for t in outputs)
    loss.backward()
    return outputs, [t.grad for t in leaves], [p.grad for p in module.parameters()]


def _compare(cpu: nn.Module, build, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
    cpu.zero_grad()
    dev = copy.deepcopy(cpu).to(R)
    torch.manual_seed(seed)
    want = _step(cpu, build)
    # twice: the second call is served from the plans the first made (csrc/op_queue.cpp)
    for _ in range(2):
        dev.zero_grad()
        torch.manual_seed(seed)
        got = pytree.tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, _step(dev, build))
        torch.testing.assert_close(got, want, **TOL[dtype])


def _input_only(x: torch.Tensor):
    """build() for a call with the input alone (zero initial states)."""

    def build(leaf):
        lx = leaf(x)
        return (lx,), [lx]

    return build


def _states(cls, layers: int, batch: int, hidden: int, proj: int = 0, bidirectional: bool = False):
    """Random initial states of the shape `cls` takes (h0, or (h0, c0) for an LSTM)."""
    d = 2 if bidirectional else 1
    h0 = torch.randn(layers * d, batch, proj or hidden)
    return (h0, torch.randn(layers * d, batch, hidden)) if cls is nn.LSTM else h0


LAYERS = [
    pytest.param(nn.LSTM, {}, id="lstm"),
    pytest.param(nn.LSTM, {"proj_size": 3}, id="lstm-proj"),
    pytest.param(nn.LSTM, {"bias": False}, id="lstm-nobias"),
    pytest.param(nn.GRU, {}, id="gru"),
    pytest.param(nn.GRU, {"bias": False}, id="gru-nobias"),
    pytest.param(nn.RNN, {"nonlinearity": "tanh"}, id="rnn-tanh"),
    pytest.param(nn.RNN, {"nonlinearity": "relu"}, id="rnn-relu"),
]


@pytest.mark.parametrize("cls, kwargs", LAYERS)
@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["seq-first", "batch-first"])
def test_layers_match_cpu(remote, cls, kwargs, bidirectional, batch_first):
    torch.manual_seed(0)
    cpu = cls(5, 6, num_layers=2, bidirectional=bidirectional, batch_first=batch_first, **kwargs)
    x = torch.randn(3, 4, 5) if batch_first else torch.randn(4, 3, 5)
    h0 = _states(cls, 2, 3, 6, kwargs.get("proj_size", 0), bidirectional)

    def build(leaf):
        lx, lh = leaf(x), pytree.tree_map(leaf, h0)
        return (lx, lh), [lx, *pytree.tree_leaves(lh)]

    _compare(cpu, build)


@pytest.mark.parametrize("cls, kwargs", [LAYERS[0], LAYERS[3]])
def test_zero_initial_states_and_float64(remote, cls, kwargs):
    torch.manual_seed(1)
    cpu = cls(4, 5, num_layers=2, **kwargs).double()
    x = torch.randn(6, 2, 4, dtype=torch.float64)
    _compare(cpu, _input_only(x), dtype=torch.float64)


@pytest.mark.parametrize("cls, kwargs", [LAYERS[0], LAYERS[1], LAYERS[3], LAYERS[5]])
@pytest.mark.parametrize("enforce_sorted", [True, False], ids=["sorted", "unsorted"])
def test_packed_sequences_match_cpu(remote, cls, kwargs, enforce_sorted):
    torch.manual_seed(2)
    cpu = cls(5, 6, num_layers=2, bidirectional=True, batch_first=True, **kwargs)
    x = torch.randn(4, 7, 5)
    lengths = [7, 5, 5, 2] if enforce_sorted else [5, 7, 2, 5]

    def build(leaf):
        lx = leaf(x)
        return (pack_padded_sequence(lx, lengths, batch_first=True, enforce_sorted=enforce_sorted),), [lx]

    _compare(cpu, build)

    # what a user reads back: the padded output
    dev = copy.deepcopy(cpu).to(R)
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=enforce_sorted)
    want, want_lengths = pad_packed_sequence(cpu(packed)[0], batch_first=True)
    got, got_lengths = pad_packed_sequence(dev(pack_padded_sequence(x.to(R), lengths, batch_first=True,
                                                                    enforce_sorted=enforce_sorted))[0],
                                           batch_first=True)
    torch.testing.assert_close(got.cpu(), want, **TOL[torch.float32])
    assert got_lengths.tolist() == want_lengths.tolist()


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
def test_dropout_between_layers(remote, cls):
    torch.manual_seed(3)
    cpu = cls(5, 6, num_layers=3, dropout=0.4)
    build = _input_only(torch.randn(4, 3, 5))
    cpu.eval()  # no dropout
    _compare(cpu, build)
    cpu.train()
    if remote.device.split(":")[0] == "cpu":
        # a CPU server draws the masks with CPU's kernel from the same seeded stream
        _compare(cpu, build, seed=11)
    else:  # another device draws other numbers: the masks differ, the gradients still exist
        dev = copy.deepcopy(cpu).to(R)
        outputs, inputs, params = _step(dev, build)
        assert all(torch.isfinite(t.cpu()).all() for t in [*outputs, *inputs, *params])


@pytest.mark.parametrize("cls, bias", [
    (nn.LSTMCell, True), (nn.LSTMCell, False),
    (nn.GRUCell, True), (nn.GRUCell, False), (nn.RNNCell, True), (nn.RNNCell, False),
])
def test_cells_match_cpu(remote, cls, bias):
    torch.manual_seed(4)
    cpu = cls(5, 6, bias=bias)
    x, h = torch.randn(3, 5), torch.randn(3, 6)
    state = (h, torch.randn(3, 6)) if cls is nn.LSTMCell else h

    def build(leaf):
        lx, ls = leaf(x), pytree.tree_map(leaf, state)
        return (lx, ls), [lx, *pytree.tree_leaves(ls)]

    _compare(cpu, build)


def test_inference_without_autograd(remote):
    """Under no_grad the fused forward ops run alone: no workspace is kept for a backward."""
    torch.manual_seed(5)
    cpu = nn.LSTM(5, 6, num_layers=2, bidirectional=True)
    dev = copy.deepcopy(cpu).to(R)
    x = torch.randn(4, 3, 5)
    with torch.no_grad():
        want = cpu(x)
        got = dev(x.to(R))
    torch.testing.assert_close(pytree.tree_map(lambda t: t.cpu(), got), want, **TOL[torch.float32])
