"""End to end: the server compiles the graphs of `torch.compile(backend="remote_accel")`.

A real server process compiles with Inductor (g++ on a CPU server) in its compiler
thread; until a graph is compiled it is replayed, so every result is checked both
before and after. Graphs are tiny and few (each compile takes seconds on a small CPU).
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn as nn

import remote_accel
from remote_accel.pytorch_ext import runtime
from remote_accel.server.testing import ServerProcess

#: How long a test waits for the server's compiler thread (a loaded 2-core CI machine).
COMPILE_WAIT_S = 900


def _graph_stats() -> dict:
    return {k: v for k, v in runtime.sessions()[0].stats().items() if k.startswith("graph")}


def _wait_for_compiles(n: int) -> dict:
    """Stats once the server has compiled (or given up on) `n` graphs or recompilations."""
    deadline = time.monotonic() + COMPILE_WAIT_S
    while True:
        stats = _graph_stats()
        if stats["graph_compiles"] + stats["graph_compile_failures"] >= n or time.monotonic() > deadline:
            return stats
        time.sleep(0.5)


@pytest.fixture
def remote(request):
    env = getattr(request, "param", None)
    with ServerProcess(env=env) as server:
        host, port = server.tcp
        # The server's compiler thread shares its GIL with the session: on a loaded 2-core
        # machine a sync may wait longer than the default 10 s while a graph compiles.
        remote_accel.init(transport="tcp", server=f"{host}:{port}", token=server.token, timeout=120)
        torch._dynamo.reset()
        yield server
        remote_accel.shutdown()
        torch._dynamo.reset()


_TABLE = [i / 4096.0 for i in range(4096)]


class WithConstants(nn.Module):
    """Tensors made in forward: Dynamo lifts them as graph constants (get_attr)."""

    def forward(self, x):
        scale = torch.tensor(1.5)  # a CPU scalar: inlined on the wire at every call
        weights = torch.tensor([0.5, -1.0, 2.0, 3.0], device=x.device)
        table = torch.tensor(_TABLE, device=x.device).reshape(-1, 4)
        return torch.relu(x * weights) * scale + table[: x.shape[0]]


@torch.no_grad()
def test_graph_with_constants_compiles_and_a_rerun_compiles_nothing(remote):
    x = torch.randn(6, 4)
    expected = WithConstants()(x)
    compiled = torch.compile(WithConstants(), backend="remote_accel")
    xr = x.to("remote_accel")
    torch.testing.assert_close(compiled(xr).cpu(), expected)  # replayed while the server compiles
    stats = _wait_for_compiles(1)
    assert stats["graphs_compiled"] == 1 and stats["graph_compile_failures"] == 0, stats
    torch.testing.assert_close(compiled(xr).cpu(), expected)
    assert _graph_stats()["graph_runs_compiled"] == stats["graph_runs_compiled"] + 1

    # A new program run (graphs numbered anew) sends the same graph: the server's cache has it.
    torch._dynamo.reset()
    again = torch.compile(WithConstants(), backend="remote_accel")
    torch.testing.assert_close(again(xr).cpu(), expected)
    after = _graph_stats()
    assert after["graph_cache_hits"] == stats["graph_cache_hits"] + 1
    assert after["graph_compiles"] == stats["graph_compiles"]  # nothing compiled again
    assert after["graph_runs_compiled"] == stats["graph_runs_compiled"] + 2


class Pointwise(nn.Module):
    """No shapes in its graph: one graph whatever the batch, so the server sees new shapes."""

    def forward(self, x):
        return torch.relu(x) * 2.0 + torch.sigmoid(x)


@torch.no_grad()
def test_new_shapes_recompile_then_go_dynamic(remote):
    model = Pointwise()
    # static graphs on the client: each shape is its own graph id, with the same nodes
    compiled = torch.compile(model, backend="remote_accel", dynamic=False)
    compiles = 0
    for rows in (3, 5, 7, 9):
        x = torch.randn(rows, 4)
        torch.testing.assert_close(compiled(x.to("remote_accel")).cpu(), model(x))
        if rows <= 7:  # static, static, then one dynamic compilation that 9 rows reuses
            compiles += 1
            stats = _wait_for_compiles(compiles)
            assert stats["graph_compiles"] == compiles, stats
        torch.testing.assert_close(compiled(x.to("remote_accel")).cpu(), model(x))
    stats = _graph_stats()
    assert stats["graphs_compiled"] == 1 and stats["graph_compiles"] == 3, stats
    assert stats["graph_compile_failures"] == 0
    assert stats["graph_cache_hits"] == 3  # one wire graph per shape, one compiled graph


def test_a_transformer_trains_compiled_through_changing_batch_sizes(remote):
    """A DataLoader's short last batch: Dynamo marks the batch dimension dynamic, and the
    graphs then compute sizes with Python's operators on SymInts (a view's batch * heads),
    which compile.py turns into the sizes at hand, one graph per batch size."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), nn.Flatten(),
                        nn.Linear(16 * 5, 3))
    model = copy.deepcopy(ref).to("remote_accel")
    compiled = torch.compile(model)  # the default backend, as a user writes it
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)
    for rows in (7, 4, 3, 7, 4):
        x, y = torch.randn(rows, 5, 16), torch.randn(rows, 3)
        loss = nn.functional.mse_loss(compiled(x.to("remote_accel")), y.to("remote_accel"))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_loss = nn.functional.mse_loss(ref(x), y)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-4, abs=1e-6), rows
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("remote", [{"CXX": "/bin/false", "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}],
                         indirect=True, ids=["no-cxx"])
def test_failed_compile_falls_back_to_replay(remote):
    """A server whose C++ compiler is broken still gives the right results, and says why once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    with torch.no_grad():
        expected = model(x)
        compiled = torch.compile(model.to("remote_accel"), backend="remote_accel")
        first = compiled(x.to("remote_accel")).cpu()
        stats = _wait_for_compiles(1)
        assert stats["graph_compile_failures"] == 1 and stats["graph_compiles"] == 0, stats
        for _ in range(2):
            torch.testing.assert_close(compiled(x.to("remote_accel")).cpu(), expected)
    torch.testing.assert_close(first, expected)
    assert _graph_stats()["graph_runs_replayed"] == 3
    with open(remote.log_file) as f:
        assert f.read().count("failed to compile and is replayed") == 1


@pytest.mark.parametrize("capturable", [True, False])
def test_compiled_optimizer_step_writes_its_state_on_the_server(remote, capturable):
    """A compiled AdamW step is an inference graph that mutates its inputs: with its step
    counts on the device (capturable) the server writes parameters and state in place
    (replayed, then compiled) and the client sends no copy per tensor; with CPU step
    counts their new values come back to the client. Either way the parameters follow
    CPU's step for step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    remote_model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    remote_model.load_state_dict(model.state_dict())
    remote_model.to("remote_accel")
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    remote_opt = torch.optim.AdamW(remote_model.parameters(), lr=0.05, capturable=capturable)
    step = torch.compile(remote_opt.step, backend="remote_accel")
    x, y = torch.randn(5, 6), torch.randn(5, 3)
    session = runtime.sessions()[0]
    calls: list = []

    def train(n: int) -> None:
        for _ in range(n):
            for m, o, xs, ys in ((model, opt, x, y), (remote_model, remote_opt, x.to("remote_accel"),
                                                       y.to("remote_accel"))):
                o.zero_grad()
                nn.functional.mse_loss(m(xs), ys).backward()
            opt.step()
            session.flush()
            ops = session.counters["ops"]
            step()
            session.flush()
            if capturable and remote_opt.state and calls:  # the first call makes the state, eagerly
                assert session.counters["ops"] - ops < 4  # not one copy_ per parameter and state tensor
            calls.append(1)
            for p, q in zip(model.parameters(), remote_model.parameters()):
                torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=1e-4, atol=1e-5)

    train(2)  # replayed while the server compiles
    stats = _wait_for_compiles(1)
    assert stats["graph_compile_failures"] == 0, stats
    before = _graph_stats()["graph_runs_compiled"]
    train(2)
    assert _graph_stats()["graph_runs_compiled"] > before
