"""remote_accel.parallel against three real servers of one CPU thread each.

DataParallel and pipeline give what one device gives with the whole batch (a CPU run of
the same module is the reference), move parameters, gradients and activations only
between servers (the client's byte counters stay at zero during a step), queue every
replica's ops without a round trip, and fail clearly on a bad device list.
"""

from __future__ import annotations

import copy
import logging
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn
from torch.func import functional_call

import remote_accel
import remote_accel.parallel
from remote_accel.parallel import DataParallel, pipeline
from remote_accel.pytorch_ext.pipeline import balanced_split, layer_costs
from remote_accel.server.testing import ServerProcess

N_SERVERS = 3
COUNTERS = ("round_trips", "bytes_up", "bytes_down", "peer_bytes")


@pytest.fixture(scope="module")
def servers():
    procs = []
    try:
        for i in range(N_SERVERS):
            procs.append(ServerProcess("--threads", "1", token=f"token-{i}").start())
        yield procs
    finally:
        for p in procs:
            p.stop()


def _init(procs):
    remote_accel.init(transport="tcp", servers=["%s:%d" % p.tcp for p in procs], tokens=[p.token for p in procs],
                      timeout=30.0)


@pytest.fixture
def session(servers):
    _init(servers)
    try:
        yield servers
    finally:
        remote_accel.shutdown()


def _counters() -> list[dict]:
    return [remote_accel.stats(f"remote_accel:{i}") for i in range(torch.remote_accel.device_count())]


def _delta(before: list[dict], after: list[dict], key: str) -> list[int]:
    return [a[key] - b[key] for b, a in zip(before, after)]


def _transformer() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), nn.Flatten(),
                         nn.Linear(16 * 5, 3))


def _train(model, opt, batches, device, step_check=None) -> list[float]:
    losses = []
    for x, y in batches:
        out = model(x.to(device))
        loss = nn.functional.mse_loss(out, y.to(out.device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step_check is not None:
            step_check()
        losses.append(loss.item())
    return losses


def _assert_close_params(remote: nn.Module, ref: nn.Module, atol=1e-5):
    for (name, p), q in zip(remote.named_parameters(), ref.parameters()):
        assert torch.allclose(p.detach().cpu(), q.detach(), atol=atol, rtol=1e-4), name


@pytest.mark.parametrize("n", [2, 3])
def test_transformer_trains_as_on_one_device_with_the_whole_batch(session, n):
    ref = _transformer()
    model = copy.deepcopy(ref).to("remote_accel:0")
    dp = DataParallel(model, devices=list(range(n)))
    # SGD: attention's key bias gets a gradient of rounding noise only (softmax ignores a
    # shift), which Adam would blow up to full steps, differently in each run
    opt = torch.optim.SGD(dp.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    # 7 samples: uneven chunks over 2 (4, 3) and 3 servers (3, 3, 1)
    batches = [(torch.randn(7, 5, 16, generator=gen), torch.randn(7, 3, generator=gen)) for _ in range(3)]
    losses = _train(dp, opt, batches, "remote_accel:0")
    ref_losses = _train(ref, ref_opt, batches, "cpu")
    assert losses == pytest.approx(ref_losses, rel=1e-4, abs=1e-5)
    _assert_close_params(model, ref)
    assert all(p.device == torch.device("remote_accel:0") for p in model.parameters())


class _CentredOverDim0(nn.Module):
    """A linear layer whose outputs are centred over dimension 0: its result depends on
    which indices of dimension 0 one call sees, so that it tells a split along dimension 1
    (each call sees them all) from one along dimension 0."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 3)

    def forward(self, x):
        h = self.linear(x)
        return h - h.mean(dim=0, keepdim=True)


def test_dim_splits_the_batch_along_that_dimension_and_gathers_it_back(session):
    """DataParallel(dim=1), for a batch laid out along dimension 1 (a sequence-first RNN's):
    the result and gradients of one device with the whole batch; split along dimension 0
    (the default) the same module gives another result."""
    torch.manual_seed(4)
    ref = _CentredOverDim0()
    model = copy.deepcopy(ref).to("remote_accel:0")
    x = torch.randn(5, 6, 8)
    xs = x.to("remote_accel:0")
    out = DataParallel(model, devices=[0, 1, 2], dim=1)(xs)
    expected = ref(x)
    assert out.shape == (5, 6, 3) and out.device == torch.device("remote_accel:0")
    assert torch.allclose(out.cpu(), expected, atol=1e-5)
    out.square().sum().backward()
    expected.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad.cpu(), q.grad, atol=1e-4), name
    with torch.no_grad():
        along_rows = DataParallel(model, devices=[0, 1, 2])(xs).cpu()
    assert not torch.allclose(along_rows, expected.detach(), atol=1e-3)  # the dim asked for was the one used


def _as_nn_dataparallel(module: nn.Module, x: torch.Tensor, n: int) -> torch.Tensor:
    """nn.DataParallel's forward, on CPU: the module runs on the first chunk (its buffers
    updated), replicas with copies of the buffers on the others (their updates dropped)."""
    chunks = x.chunk(n)
    outs = [module(chunks[0])]
    for chunk in chunks[1:]:
        tensors = dict(module.named_parameters())
        tensors.update({name: b.clone() for name, b in module.named_buffers()})
        outs.append(functional_call(module, tensors, (chunk,)))
    return torch.cat(outs)


@pytest.mark.parametrize("n", [2, 3])
def test_cnn_with_batchnorm_as_nn_dataparallel(session, n):
    torch.manual_seed(2)
    ref = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2))
    model = copy.deepcopy(ref).to("remote_accel:0")
    dp = DataParallel(model, devices=list(range(n)))
    # SGD: the conv's bias, right before BatchNorm, gets a gradient of rounding noise only,
    # which Adam would blow up to full steps in either run
    opt = torch.optim.SGD(dp.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        x, y = torch.randn(8, 3, 6, 6, generator=gen), torch.randn(8, 2, generator=gen)
        loss = nn.functional.mse_loss(dp(x.to("remote_accel:0")), y.to("remote_accel:0"))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_loss = nn.functional.mse_loss(_as_nn_dataparallel(ref, x, n), y)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-4, abs=1e-6)
    _assert_close_params(model, ref)
    # replica 0's running statistics land in the module, the others' are dropped
    for (name, b), rb in zip(model.named_buffers(), ref.buffers()):
        assert torch.allclose(b.cpu().to(rb.dtype), rb, atol=1e-6), name
    assert model[1].num_batches_tracked.item() == 2
    # in eval mode each replica uses the running statistics: the whole batch's result
    model.eval()
    ref.eval()
    x = torch.randn(5, 3, 6, 6, generator=gen)
    assert torch.allclose(dp(x.to("remote_accel:0")).cpu(), ref(x), atol=1e-5)


def test_autocast_and_grad_scaler(session):
    torch.manual_seed(8)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = copy.deepcopy(ref).to("remote_accel:0")
    dp = DataParallel(model)
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("remote_accel", init_scale=1024.0)
    x = torch.randn(9, 8, generator=torch.Generator().manual_seed(9))
    with torch.autocast("remote_accel", dtype=torch.bfloat16):
        out = dp(x.to("remote_accel:0"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_out = ref(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out.cpu(), ref_out)
    scaler.scale(out.float().square().mean()).backward()
    scaler.step(opt)  # unscales by a power of two: the same step as without a scaler
    scaler.update()
    ref_out.float().square().mean().backward()
    ref_opt.step()
    assert scaler.get_scale() == 1024.0  # no inf or nan found in the summed gradients
    _assert_close_params(model, ref, atol=1e-4)


def test_torch_compile_around_and_inside(session):
    torch.manual_seed(10)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to("remote_accel:0")
    x = torch.randn(6, 8).to("remote_accel:0")
    dp = DataParallel(model)
    expected = dp(x).cpu()
    # compiled around: DataParallel's forward runs eagerly under Dynamo, the same result.
    # Close, not bit-equal: a server replays a new graph node by node while Inductor compiles
    # it, and a call after the compile finished runs Inductor's code, whose fused bias add
    # may round differently from eager addmm (when is the server's timing)
    torch.testing.assert_close(torch.compile(dp)(x).cpu(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(DataParallel(torch.compile(model), devices=[0])(x).cpu(), expected,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [2, 3])
def test_a_compiled_module_inside_trains_as_on_one_device(session, n):
    """DataParallel(torch.compile(model)): each server runs the compiled replica, forward
    and backward (two replicas' compiled backwards at once in autograd's device threads
    fail in torch with "cannot enter context": DataParallel orders them)."""
    ref = _transformer()
    model = copy.deepcopy(ref).to("remote_accel:0")
    dp = DataParallel(torch.compile(model), devices=list(range(n)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randn(7, 5, 16, generator=gen), torch.randn(7, 3, generator=gen)) for _ in range(3)]
    before = _counters()
    losses = _train(dp, opt, batches, "remote_accel:0")
    assert all(d > 0 for d in _delta(before, _counters(), "round_trips")[:1])
    assert min(s["graphs"] for s in _counters()[:n]) > 0, "every server ran compiled graphs"
    assert losses == pytest.approx(_train(ref, ref_opt, batches, "cpu"), rel=1e-4, abs=1e-5)
    _assert_close_params(model, ref)


def test_frozen_parameters_get_no_gradient(session):
    torch.manual_seed(11)
    ref = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ref[0].weight.requires_grad_(False)
    model = copy.deepcopy(ref).to("remote_accel:0")
    x = torch.randn(7, 8)
    DataParallel(model)(x.to("remote_accel:0")).square().sum().backward()
    ref(x).square().sum().backward()
    assert model[0].weight.grad is None
    for name, p in list(model.named_parameters())[1:]:
        assert torch.allclose(p.grad.cpu(), dict(ref.named_parameters())[name].grad, atol=1e-5), name


def test_no_parameter_or_gradient_byte_passes_the_client(session):
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).to("remote_accel:0")
    dp = DataParallel(model)
    opt = torch.optim.SGD(dp.parameters(), lr=0.01)
    x, y = torch.randn(12, 64).to("remote_accel:0"), torch.randn(12, 64).to("remote_accel:0")
    torch.remote_accel.synchronize(0)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    before = _counters()
    for _ in range(2):
        loss = nn.functional.mse_loss(dp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = _counters()
    # every replica's forward, backward and the step were queued without one round trip
    assert _delta(before, after, "round_trips") == [0] * N_SERVERS
    # and nothing went up or came down: inputs were on server 0 already
    assert _delta(before, after, "bytes_up") == [0] * N_SERVERS
    assert _delta(before, after, "bytes_down") == [0] * N_SERVERS
    # the parameters went out and the gradients came back server to server: per step the
    # tree sends two copies of the parameters from server 0 and sums two gradients into it
    peer = _delta(before, after, "peer_bytes")
    assert peer[0] >= 2 * 2 * param_bytes
    assert peer[1] >= 2 * param_bytes and peer[2] >= 2 * param_bytes
    loss.item()


def test_outputs_of_every_shape_gathered_where_asked(session):
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 2)

        def forward(self, x, scale=1.0, extra=None):
            # a factory without a device lands on the replica's server (the device guard)
            ones = torch.ones(x.shape[0], 1, device=torch.remote_accel.current_device())
            return {"y": self.a(x) * scale, "pair": (x.sum(), ones + extra)}

    torch.manual_seed(5)
    ref = TwoHeads()
    dp = DataParallel(copy.deepcopy(ref).to("remote_accel:0"), output_device="cpu")
    x, extra = torch.randn(5, 4), torch.randn(5, 1)
    out = dp(x, scale=2.0, extra=extra.to("remote_accel:0"))  # inputs on the host: each chunk goes up once
    assert out["y"].device.type == "cpu"
    assert torch.allclose(out["y"], ref.a(x) * 2.0, atol=1e-6)
    assert out["pair"][0].shape == (3,)  # one 0-dim result per replica, stacked as nn.DataParallel does
    assert torch.allclose(out["pair"][0].sum(), x.sum(), atol=1e-5)
    assert torch.allclose(out["pair"][1], extra + 1)
    # a batch smaller than the device list runs on fewer servers
    small = dp(x[:2], extra=extra[:2])
    assert torch.allclose(small["y"], ref.a(x[:2]), atol=1e-6)


def test_copies_from_two_threads_in_opposite_directions_all_arrive(session):
    """Autograd's device threads issue copies at once, 0 -> 1 in one and 1 -> 0 in the
    other; without transfer.copy_direct keeping each copy's two halves together, two of
    them could each wait for the other on the servers (this ran into the copy timeout)."""
    base = torch.arange(1000.0)
    sources = {0: base.to("remote_accel:0"), 1: (-base).to("remote_accel:1")}
    copies: dict = {0: [], 1: []}

    def copy_many(src: int) -> None:
        for _ in range(40):
            copies[src].append(sources[src].to(f"remote_accel:{1 - src}"))

    threads = [threading.Thread(target=copy_many, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)  # a bound for a hang, far above the copies' time
    assert not any(t.is_alive() for t in threads), "the copies' threads hang"
    for i in (0, 1):
        torch.remote_accel.synchronize(i, timeout=120)
    assert all(torch.equal(c.cpu(), base) for c in copies[0])
    assert all(torch.equal(c.cpu(), -base) for c in copies[1])


def test_pipeline_gradients_equal_the_unsplit_module(session):
    torch.manual_seed(6)
    ref = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(5)], nn.Linear(8, 2))
    model = copy.deepcopy(ref).to("remote_accel:0")
    pipe = pipeline(model, chunks=4)
    opt = torch.optim.Adam(pipe.parameters(), lr=0.01)  # made before the stages are placed
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(7)
    batches = [(torch.randn(10, 8, generator=gen), torch.randn(10, 2, generator=gen)) for _ in range(2)]
    losses = _train(pipe, opt, batches, "remote_accel:0")
    assert losses == pytest.approx(_train(ref, ref_opt, batches, "cpu"), rel=1e-5, abs=1e-6)
    _assert_close_params(model, ref)
    assert [len(s) for s in pipe.stages] == [2, 2, 2]  # equal layers, equal bytes: equal stages
    assert [next(s.parameters()).device.index for s in pipe.stages] == [0, 1, 2]
    x = batches[0][0].to("remote_accel:0")
    torch.remote_accel.synchronize(0)
    before = _counters()
    out = pipe(x)
    out.sum().backward()
    after = _counters()
    assert out.device == torch.device("remote_accel:2")
    assert _delta(before, after, "round_trips") == [0] * N_SERVERS
    assert _delta(before, after, "bytes_up") == [0] * N_SERVERS and _delta(before, after, "bytes_down") == [0] * 3


@pytest.mark.any_torch  # the server-list runs above take DataParallel and pipeline through any torch
def test_over_a_ray_pool_as_over_a_server_list():
    # a skip CI turns into a failure: its main venv has Ray; the models venv has none and leaves it out (any_torch)
    ray = pytest.importorskip("ray", reason="remote_accel.ray needs Ray: pip install 'remote_accel[ray]'")
    import remote_accel.ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 << 20,
             configure_logging=False)
    try:
        pool = remote_accel.ray.ServerPool(num_servers=2, resources_per_server={"num_cpus": 1})
        try:
            remote_accel.init(servers=pool, timeout=30.0)
            torch.manual_seed(12)
            ref = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
            dp_model, pipe_model = copy.deepcopy(ref).to("remote_accel:0"), copy.deepcopy(ref).to("remote_accel:0")
            x = torch.randn(6, 8)
            xs = x.to("remote_accel:0")
            torch.remote_accel.synchronize(0)
            before = _counters()
            DataParallel(dp_model)(xs).square().sum().backward()
            pipeline(pipe_model, chunks=3)(xs).square().sum().backward()
            after = _counters()
            assert _delta(before, after, "bytes_up") == [0, 0] and _delta(before, after, "bytes_down") == [0, 0]
            assert all(n > 0 for n in _delta(before, after, "peer_bytes"))
            ref(x).square().sum().backward()
            for model in (dp_model, pipe_model):
                for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                    assert torch.allclose(p.grad.cpu(), q.grad, atol=1e-5), name
        finally:
            remote_accel.shutdown()
            pool.shutdown()
    finally:
        ray.shutdown()


def test_balanced_split_minimises_the_largest_stage():
    assert balanced_split([1, 1, 1, 1, 1, 1], 3) == [0, 2, 4]
    assert balanced_split([4, 4, 1, 1, 1, 1, 4], 3) == [0, 1, 4]  # 4 | 4 1 1 | 1 1 4: at most 6
    assert balanced_split([5, 5], 3) == [0, 1]  # fewer layers than devices: fewer stages


def test_stages_balance_parameter_and_activation_bytes():
    # parameters alone tie (16000 | 0 + 16000), and the split would put the ReLU with the
    # last layer; that layer's wide output (64 x 1000 floats) outweighs the rest
    layers = [nn.Linear(1000, 4, bias=False), nn.ReLU(), nn.Linear(4, 1000, bias=False)]
    costs = layer_costs(layers, torch.ones(64, 1000))
    assert costs == [16000 + 64 * 4 * 4, 64 * 4 * 4, 16000 + 64 * 1000 * 4]
    assert balanced_split([16000, 0, 16000], 2) == [0, 1]
    assert balanced_split(costs, 2) == [0, 2]

    class Branchy(nn.Module):  # reads a value: the meta device cannot run it
        def forward(self, x):
            return x if x.sum().item() > 0 else -x

    assert layer_costs(layers + [Branchy()], torch.ones(64, 1000)) == [16000, 0, 16000, 0]  # parameters alone


def test_bad_device_lists_are_clear_errors(session):
    model = nn.Linear(4, 2).to("remote_accel:0")
    with pytest.raises(ValueError, match="remote_accel device"):
        DataParallel(model, devices=["remote_accel:0", "cpu"])
    with pytest.raises(ValueError, match="remote_accel:7 is not a server of this session, which has 3"):
        DataParallel(model, devices=[0, 7])
    with pytest.raises(ValueError, match="named twice"):
        pipeline(nn.Sequential(model), devices=[1, 1])
    with pytest.raises(ValueError, match=r"on remote_accel:0 \(devices\[0\]\), but weight is on remote_accel:1"):
        DataParallel(nn.Linear(4, 2).to("remote_accel:1"), devices=[0, 1])
    dp = DataParallel(model, devices=[0, 1])
    model.to("cpu")  # moved away after wrapping: the next forward says so
    with pytest.raises(ValueError, match="but weight is on cpu"):
        dp(torch.ones(2, 4))


def test_a_server_that_is_gone_is_named_and_nothing_hangs(servers):
    extra = ServerProcess("--threads", "1", token="token-extra").start()
    try:
        # recovery=False: with recovery a session waits for its server to come back
        # (recovery_timeout); here the server is gone for good
        remote_accel.init(transport="tcp", servers=["%s:%d" % p.tcp for p in (*servers[:2], extra)],
                          tokens=[servers[0].token, servers[1].token, extra.token], timeout=30.0, recovery=False)
        model = nn.Linear(4, 2).to("remote_accel:0")
        dp = DataParallel(model)
        extra.kill()
        with pytest.raises(remote_accel.RemoteAccelError, match="gone"):
            dp(torch.ones(6, 4, device="remote_accel:0")).sum().item()
        with pytest.raises(remote_accel.RemoteAccelError, match="remote_accel:2 cannot be used: .*gone"):
            DataParallel(model)
        # the two servers left still work together
        dp = DataParallel(model, devices=[0, 1])
        assert dp(torch.ones(6, 4, device="remote_accel:0")).shape == (6, 2)
    finally:
        remote_accel.shutdown()
        extra.stop()


# -- recovery (init()'s default) when a server dies: copies between servers hold state no client has
@pytest.fixture(scope="module")
def doomed():
    """A server for the tests that kill it (and start it again on its address)."""
    with ServerProcess("--threads", "1", token="token-doomed") as proc:
        yield proc


def _killed_and_restarted(server: ServerProcess, caplog) -> None:
    """Kill the server of remote_accel:1 and start it again on its address, as a supervisor
    would; its session, fed by copies from server 0, could reconnect but must not replay:
    its next use is a clear error, and the log says why.

    Noticed there first, not by a copy's half: a half that went to the live server while
    the dead one's half failed leaves the live one waiting for the other half, until the
    copy's timeout (server/peer.py PEER_TIMEOUT_S, 2 minutes): the restarted server listens
    where the dead one did, so the live one's probe of it passes."""
    server.kill()
    server.restart()
    with caplog.at_level(logging.ERROR, logger="remote_accel"), \
            pytest.raises(remote_accel.RemoteAccelError, match="is gone"):
        torch.remote_accel.synchronize(1)
    assert "cannot be rebuilt: a direct copy from another server came in" in caplog.text, caplog.text


def test_a_replica_server_that_dies_between_dataparallel_steps_is_a_clear_error_never_other_data(servers, doomed,
                                                                                                  caplog):
    """DataParallel copies the parameters into each replica and the gradients back, server
    to server: a replica's session holds bytes no client has, so it cannot be rebuilt
    until its next snapshot (docs/design/recovery.md). Its use raises, the log says why,
    the next step raises at once, and the model on remote_accel:0 keeps the last step's
    values."""
    remote_accel.init(transport="tcp", servers=["%s:%d" % servers[0].tcp, "%s:%d" % doomed.tcp],
                      tokens=[servers[0].token, doomed.token], timeout=30.0)
    try:
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to("remote_accel:0")
        dp = DataParallel(model, devices=[0, 1])
        opt = torch.optim.SGD(dp.parameters(), lr=0.1)
        batch = [(torch.randn(6, 4), torch.randn(6, 2))]
        _train(dp, opt, batch, "remote_accel:0")
        # the scenario: the replica's parameters came from server 0, server to server
        assert remote_accel.server_stats(1)["peer_copies_received"] > 0
        saved = [p.detach().cpu() for p in model.parameters()]
        _killed_and_restarted(doomed, caplog)
        with pytest.raises(remote_accel.RemoteAccelError, match="is gone"):
            _train(dp, opt, batch, "remote_accel:0")
        assert all(torch.equal(p.detach().cpu(), q) for p, q in zip(model.parameters(), saved))
    finally:
        remote_accel.shutdown()


def test_a_pipeline_stage_s_server_that_dies_between_steps_is_a_clear_error(servers, doomed, caplog):
    """A pipeline's later stage receives its parameters and activations from the stage
    before it, server to server: the same holds for it."""
    remote_accel.init(transport="tcp", servers=["%s:%d" % servers[0].tcp, "%s:%d" % doomed.tcp],
                      tokens=[servers[0].token, doomed.token], timeout=30.0)
    try:
        torch.manual_seed(6)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)]).to("remote_accel:0")
        pipe = pipeline(model, chunks=2)
        x = torch.randn(4, 8)
        first = pipe(x.to("remote_accel:0")).sum().item()
        # the scenario: the second stage lives on the server that dies, fed by copies
        assert [next(s.parameters()).device.index for s in pipe.stages] == [0, 1]
        assert remote_accel.server_stats(1)["peer_copies_received"] > 0
        _killed_and_restarted(doomed, caplog)
        with pytest.raises(remote_accel.RemoteAccelError, match="is gone"):
            pipe(x.to("remote_accel:0")).sum().item()
        with pytest.raises(remote_accel.RemoteAccelError):
            next(pipe.stages[1].parameters()).cpu()  # the dead stage's tensors: an error, never data
        assert first == first  # a number: the step before the death was whole
    finally:
        remote_accel.shutdown()


def test_importable_both_ways():
    assert remote_accel.parallel.DataParallel is DataParallel
    # as an attribute, without importing the submodule first
    code = "import remote_accel; print(remote_accel.parallel.DataParallel.__name__, remote_accel.parallel.pipeline)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("DataParallel <function pipeline"), out.stderr
