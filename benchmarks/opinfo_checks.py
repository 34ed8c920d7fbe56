"""One OpInfo entry on remote_accel against CPU: its outputs (any dtype), or its outputs and
the gradients of its inputs (float32). Used by opinfo_report.py.

Each check raises on the first sample that differs from CPU, `NoReference` when the CPU
reference itself raises (there is nothing to compare with), and returns otherwise.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

DEVICE = "remote_accel"


class NoReference(Exception):
    """The CPU reference raised: there is nothing to compare with."""


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def _tolerances(dtype: torch.dtype) -> dict:
    # test_compare_cpu's 1e-3, or the dtype's own (wider) default where it has one: bfloat16
    # keeps 8 bits of mantissa, and a server's kernel may round once more or less than CPU's
    rtol, atol = {torch.bfloat16: (1.6e-2, 1e-3), torch.float16: (1e-3, 1e-3)}.get(dtype, (1e-3, 1e-3))
    return {"rtol": rtol, "atol": atol}


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu")
    return value


def _same_memory_on_cpu(value):
    """A sample's remote tensor as a CPU tensor over a copy of its whole storage, with the
    same strides and offset: ops that look past a view's elements (as_strided of a
    partial view) then see the same memory on both sides, where `.cpu()` would copy the
    view's elements alone. A leaf that requires grad as the original does."""
    if not isinstance(value, torch.Tensor):
        return value
    plain = value.layout == torch.strided and not value.is_conj() and not value.is_neg()
    storage = value.untyped_storage().nbytes() // value.element_size() if plain else 0
    if not plain or not storage or value.device.type == "cpu":
        return value.detach().to("cpu").requires_grad_(value.requires_grad)
    whole = value.detach().as_strided((storage,), (1,), 0).cpu()
    copy = whole.as_strided(value.shape, value.stride(), value.storage_offset()).detach()
    return copy.requires_grad_(value.requires_grad)


def _compare(got, want, dtype: torch.dtype, what: str) -> None:
    got = pytree.tree_map(_to_cpu, got)
    want = pytree.tree_map(_to_cpu, want)
    try:
        torch.testing.assert_close(got, want, equal_nan=True, check_device=False, **_tolerances(dtype))
    except AssertionError as exc:
        raise AssertionError(f"{what}: {exc}") from None


def _samples(op, dtype: torch.dtype, count: int, requires_grad: bool = False):
    for i, sample in enumerate(op.sample_inputs(DEVICE, dtype, requires_grad=requires_grad)):
        if i >= count:
            return
        yield sample


def check_forward(op, samples: int, dtype: torch.dtype = torch.float32) -> None:
    """What PyTorch's TestCommon.test_compare_cpu does for an accelerator, with each sample
    run twice on the device: the second, equal call is served from the plans the first one
    made (in C++, csrc/op_queue.cpp) rather than by Python, and must say the same."""
    for sample in _samples(op, dtype, samples):
        cpu_sample = sample.transform(_same_memory_on_cpu)
        try:
            want = cpu_sample.output_process_fn_grad(op(cpu_sample.input, *cpu_sample.args, **cpu_sample.kwargs))
        except Exception as exc:
            raise NoReference(first_line(exc)) from exc
        for call in ("outputs", "outputs of the second call (served from cached plans)"):
            got = sample.output_process_fn_grad(op(sample.input, *sample.args, **sample.kwargs))
            _compare(got, want, dtype, call)


def _differentiable(value) -> list:
    """The tensors of an output that a backward can start from."""
    return [t for t in pytree.tree_leaves(value)
            if isinstance(t, torch.Tensor) and t.requires_grad and (t.is_floating_point() or t.is_complex())]


def _run_backward(op, sample, grad_seed: int):
    """(outputs, gradients of every input that requires grad) of one sample, with fixed
    pseudo-random output gradients made on CPU (the same bytes for both sides)."""
    call = lambda *args, **kwargs: op.gradcheck_wrapper(op.get_op(), *args, **kwargs)  # noqa: E731
    out = sample.output_process_fn_grad(call(sample.input, *sample.args, **sample.kwargs))
    inputs = [t for t in pytree.tree_leaves((sample.input, sample.args, sample.kwargs))
              if isinstance(t, torch.Tensor) and t.requires_grad]
    outs = _differentiable(out)
    if not inputs or not outs:
        return out, []
    gen = torch.Generator().manual_seed(grad_seed)
    seeds = [torch.randn(o.shape, dtype=o.dtype, generator=gen).to(o.device) for o in outs]
    grads = torch.autograd.grad(outs, inputs, seeds, allow_unused=True)
    return out, list(grads)


def check_gradients(op, samples: int, dtype: torch.dtype = torch.float32) -> None:
    """Outputs and the gradients of every input that requires grad, for the first
    `samples` sample inputs made with requires_grad=True (as PyTorch's gradient tests
    make them), against the same on CPU."""
    for i, sample in enumerate(_samples(op, dtype, samples, requires_grad=True)):
        cpu_sample = sample.transform(_same_memory_on_cpu)
        try:
            want_out, want_grads = _run_backward(op, cpu_sample, i)
        except Exception as exc:
            raise NoReference(first_line(exc)) from exc
        got_out, got_grads = _run_backward(op, sample, i)
        _compare(got_out, want_out, dtype, "outputs")
        if len(got_grads) != len(want_grads):
            raise AssertionError(f"{len(got_grads)} input gradients, CPU has {len(want_grads)}")
        for k, (got, want) in enumerate(zip(got_grads, want_grads)):
            if (got is None) != (want is None):
                raise AssertionError(f"gradient {k}: {'None' if got is None else 'a tensor'}, CPU has "
                                     f"{'None' if want is None else 'a tensor'}")
            _compare(got, want, dtype, f"gradient of input {k}")
