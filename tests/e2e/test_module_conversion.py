"""`Module.to()` / `.cpu()` / `.remote_accel()` keep every Parameter and its .grad the same
Python object, as on CUDA: shared (tied) weights stay shared, and optimizers made before
the move keep training the model. A real CPU server process over TCP.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn


R = "remote_accel"


class TinyGPT(nn.Module):
    """GPT-2's shape in miniature: the output projection IS the token embedding."""

    def __init__(self, vocab=11, dim=8):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(6, dim)
        self.block = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.register_buffer("positions", torch.arange(6))

    def forward(self, tokens):
        h = self.wte(tokens) + self.wpe(self.positions[: tokens.shape[-1]])
        h = h + self.block(h)
        return self.lm_head(self.ln_f(h))


def _train(model, optimizer, tokens, steps=3):
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_tied_weights_survive_to_and_train_like_cpu(remote):
    torch.manual_seed(0)
    cpu_model = TinyGPT()
    model = copy.deepcopy(cpu_model)
    tokens = torch.randint(0, 11, (3, 6))
    # optimizers made before the move, as many training scripts do
    cpu_opt = torch.optim.AdamW(cpu_model.parameters(), lr=1e-2)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)

    assert model.to(R) is model
    assert model.lm_head.weight is model.wte.weight
    now = list(model.parameters())
    assert len(now) == len(params) and all(a is b for a, b in zip(now, params))
    assert all(p.device.type == R for p in params) and model.positions.device.type == R

    want = _train(cpu_model, cpu_opt, tokens)
    got = _train(model, opt, tokens.to(R))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_parameters_and_grads_keep_identity_both_ways(remote):
    torch.manual_seed(1)
    model = TinyGPT()
    model(torch.randint(0, 11, (2, 5))).sum().backward()
    params = [(p, p.grad) for p in model.parameters()]
    for move in (lambda m: m.to(R), lambda m: m.cpu(), lambda m: m.remote_accel(), lambda m: m.to("cpu")):
        move(model)
        assert model.lm_head.weight is model.wte.weight
        for (p, grad), now in zip(params, model.parameters()):
            assert now is p and now.grad is grad
            assert p.device == grad.device == model.positions.device
    assert model.positions.device.type == "cpu"
    # the values made the round trips unchanged
    torch.manual_seed(1)
    fresh = TinyGPT()
    fresh(torch.randint(0, 11, (2, 5))).sum().backward()
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p.detach(), q.detach()) and torch.equal(p.grad, q.grad)


def test_data_assignment_moves_a_tensor_between_devices(remote):
    # `.data =` across devices is what Module._apply relies on; it is public API too
    p = nn.Parameter(torch.arange(4.0))
    p.data = p.data.to(R)
    assert p.device.type == R and p.requires_grad
    (p * 2).sum().backward()
    assert p.grad.device.type == R and torch.equal(p.grad.cpu(), torch.full((4,), 2.0))
    p.data = torch.ones(3)
    assert p.device.type == "cpu" and torch.equal(p.detach(), torch.ones(3))
