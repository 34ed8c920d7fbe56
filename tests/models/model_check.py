"""Train one model on CPU and the same model on remote_accel; compare what must agree.

A run is 3 AdamW steps: the loss of each step, every parameter's gradient after the first
step, every parameter after the last one, and, for parameters shared by several modules
(tied embeddings), that they are still one Parameter object on the device.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch

R = "remote_accel"
STEPS = 3


def shared_parameter_names(model: torch.nn.Module) -> list[list[str]]:
    """Groups of names that refer to one Parameter object (tied weights)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    return value


def train(model: torch.nn.Module, batches: list, loss_fn: Callable, device: str) -> dict:
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses, first_grads = [], None
    for batch in batches:
        opt.zero_grad()
        loss = loss_fn(model, _to(batch, device))
        loss.backward()
        if first_grads is None:
            first_grads = {n: None if p.grad is None else p.grad.detach().cpu().clone()
                           for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    params = {n: p.detach().cpu() for n, p in model.named_parameters()}
    return {"model": model, "losses": losses, "grads": first_grads, "params": params}


#: Parameters after the steps: Adam divides each gradient by its own running size, so an
#: element whose gradient is near zero turns a rounding difference (another summation
#: order in the server's kernels) into up to a whole step of lr = 1e-3. A wrong gradient
#: moves many elements by that much; a tenth of one step is still far below it.
PARAM_ATOL = 1e-4


def check_training(make_model: Callable[[], torch.nn.Module], batches: list, loss_fn: Callable, *,
                   rtol: float = 1e-4, atol: float = 1e-5, tied: int = 0) -> dict:
    """Train make_model() for len(batches) steps on CPU and on remote_accel; assert they agree
    (losses and first-step gradients to rtol/atol, parameters after the steps to PARAM_ATOL).

    tied: how many groups of shared parameters the model must have (and keep on the device).
    Returns both runs."""
    torch.manual_seed(0)
    cpu_model = make_model()
    groups = shared_parameter_names(cpu_model)
    assert len(groups) == tied, f"expected {tied} groups of tied parameters, the model has {groups}"
    remote_model = copy.deepcopy(cpu_model)
    local = train(cpu_model, batches, loss_fn, "cpu")
    remote = train(remote_model, batches, loss_fn, R)

    # ties survive .to(): the device model still shares those parameters
    assert shared_parameter_names(remote["model"]) == groups
    for names in groups:
        first = remote["model"].get_parameter(names[0])
        assert first.device.type == R
        assert all(remote["model"].get_parameter(n) is first for n in names[1:]), names

    torch.testing.assert_close(remote["losses"], local["losses"], rtol=rtol, atol=atol)
    assert local["grads"].keys() == remote["grads"].keys()
    for name, grad in local["grads"].items():
        if grad is None:
            assert remote["grads"][name] is None, name
        else:
            torch.testing.assert_close(remote["grads"][name], grad, rtol=rtol, atol=atol,
                                       msg=lambda m, name=name: f"first-step gradient of {name}: {m}")
    for name, value in local["params"].items():
        torch.testing.assert_close(remote["params"][name], value, rtol=rtol, atol=max(atol, PARAM_ATOL),
                                   msg=lambda m, name=name: f"{name} after {len(batches)} steps: {m}")
    assert all(torch.isfinite(torch.tensor(local["losses"])))
    return {"local": local, "remote": remote}
