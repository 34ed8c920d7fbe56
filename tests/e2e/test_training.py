"""End to end: a real server process, the real client device over TCP, real models.

Losses of a few training steps on remote_accel must match the same run on local CPU: to
float tolerance on a CPU server (CI), to the tolerance of TF32 convolutions on a GPU
server (the GPU check: PyTorch allows TF32 in cuDNN by default).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn



class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            # no bias before BatchNorm (it cancels it): Adam would amplify its rounding noise
            nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x):
        return self.head(self.features(x))


def _train(model, device, steps=5, opt_cls=torch.optim.SGD, **opt_kwargs):
    torch.manual_seed(0)
    data = torch.randn(steps, 8, 1, 8, 8)
    target = torch.randint(0, 3, (steps, 8))
    model = model.to(device)
    opt = opt_cls(model.parameters(), **opt_kwargs)
    losses = []
    for x, y in zip(data, target):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("opt_cls,kwargs", [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.AdamW, {"lr": 1e-2}),
    (torch.optim.Adam, {"lr": 1e-2, "foreach": True}),
])
def test_cnn_training_matches_cpu(remote, opt_cls, kwargs):
    torch.manual_seed(1)
    model = SmallCNN()
    local_losses, local_model = _train(copy.deepcopy(model), "cpu", opt_cls=opt_cls, **kwargs)
    remote_losses, remote_model = _train(copy.deepcopy(model), "remote_accel", opt_cls=opt_cls, **kwargs)
    rtol, atol = (1e-4, 1e-5) if remote.device == "cpu" else (1e-2, 1e-3)
    assert remote_losses == pytest.approx(local_losses, rel=rtol, abs=atol)
    for (name, p_local), p_remote in zip(local_model.state_dict().items(), remote_model.state_dict().values()):
        assert p_remote.device.type == "remote_accel"
        torch.testing.assert_close(p_remote.cpu(), p_local, rtol=rtol, atol=atol, msg=name)


def test_checkpoint_round_trip(remote, tmp_path):
    model = SmallCNN().to("remote_accel")
    path = tmp_path / "ckpt.pt"
    torch.save(model.state_dict(), path)
    loaded = torch.load(path, map_location="remote_accel")
    for key, value in model.state_dict().items():
        assert loaded[key].device.type == "remote_accel"
        torch.testing.assert_close(loaded[key].cpu(), value.cpu())


def test_tensor_written_is_tensor_read(remote):
    for dtype in (torch.float32, torch.float64, torch.int64, torch.bool, torch.bfloat16, torch.complex64):
        x = (torch.randn(37, 5) * 10).to(dtype)
        assert torch.equal(x.to("remote_accel").cpu(), x)


def test_views_inplace_and_sync_points(remote):
    x = torch.arange(12.0).reshape(3, 4)
    r = x.to("remote_accel")
    r[1].mul_(10)
    x[1].mul_(10)
    r.t()[0].add_(1)
    x.t()[0].add_(1)
    assert torch.equal(r.cpu(), x)
    assert r.sum().item() == x.sum().item()
    assert bool((r > 5).any()) is True
    assert torch.equal(torch.nonzero(r > 20).cpu(), torch.nonzero(x > 20))
    values, indices = r.max(dim=1)
    torch.testing.assert_close(values.cpu(), x.max(dim=1).values)
    assert "remote_accel:0" in repr(r)


def test_manual_seed_reproduces_random_ops(remote):
    torch.manual_seed(5)
    a = torch.randn(100, device="remote_accel").cpu()
    d1 = nn.functional.dropout(torch.ones(100, device="remote_accel"), 0.5).cpu()
    torch.manual_seed(5)
    b = torch.randn(100, device="remote_accel").cpu()
    d2 = nn.functional.dropout(torch.ones(100, device="remote_accel"), 0.5).cpu()
    assert torch.equal(a, b) and torch.equal(d1, d2)


def test_compiled_step_is_one_message_per_graph(remote):
    from remote_accel.pytorch_ext import runtime

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    remote_model = copy.deepcopy(model).to("remote_accel")
    compiled = torch.compile(remote_model, backend="remote_accel")
    x = torch.randn(4, 8)
    out = compiled(x.to("remote_accel"))
    out.sum().backward()
    model(x).sum().backward()
    torch.testing.assert_close(out.cpu(), model(x))
    torch.testing.assert_close(remote_model[0].weight.grad.cpu(), model[0].weight.grad)
    session = runtime.sessions()[0]
    x_remote = x.to("remote_accel")
    session.flush()
    before = dict(session.counters)
    again = compiled(x_remote)  # kept alive, so no free leaves after it either
    session.flush()
    assert session.counters["ops"] == before["ops"]  # no per-op requests
    # the whole forward: one graph call, which leaves at once in a batch of its own
    assert session.counters["batches"] - before["batches"] == 1
    assert session.counters["graphs"] - before["graphs"] == 1
    torch.testing.assert_close(again.cpu(), model(x))


def test_compiled_dropout_follows_manual_seed(remote):
    model = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5)).to("remote_accel")
    compiled = torch.compile(model, backend="remote_accel")
    x = torch.randn(4, 8).to("remote_accel")
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append((compiled(x).cpu(), compiled(x).cpu()))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert not torch.equal(runs[0][0], runs[0][1])  # the stream moves on between calls
