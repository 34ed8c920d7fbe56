#!/usr/bin/env python3
"""List the aten ops that reach a CPU server with no CPU kernel, and what it does with each.

    python scripts/list_no_cpu_kernel_ops.py > tests/server/no_cpu_kernel_ops.txt

An op reaches the server when the client's PrivateUse1 fallback sees it: every op
without a composite kernel (CompositeImplicitAutograd and CompositeExplicitAutograd ones
run on the client, as for any backend). Those without a kernel for CPU tensors (nor
sparse, quantized, nested or mkldnn CPU tensors) are listed, from this torch's
dispatcher: CUDA-only ops (the fused RNN cells), MPS-only ones, and a few that have no
eager kernel at all. Each is marked

- decomposed: ops.resolve gives its decomposition (decompositions.py says where from);
- substituted: ops.SUBSTITUTES runs it another way;
- unsupported: calling it fails with the dispatcher's "Could not run" error, and why
  that is acceptable (or not yet done).

tests/server/test_decompositions.py checks that the checked-in list is what this script
writes for the running torch.
"""

from __future__ import annotations

import re
import sys

import torch

from remote_accel.server import decompositions, ops

#: Why an op without a CPU kernel is not served, by the first pattern its name matches.
REASONS = (
    (r"cudnn|miopen|mps|_cslt_", "a cuDNN/MIOpen/cuSPARSELt/MPS library call: PyTorch picks it for "
                                 "tensors of that device only"),
    (r"attention|_triton_|_fill_mem_eff_dropout_mask_",
     "a fused attention kernel of CUDA: scaled_dot_product_attention on remote_accel takes the kernel "
     "that the server's _fused_sdp_choice picks (a CPU server: its own)"),
    (r"nested|to_padded_tensor", "nested tensors: remote_accel has none"),
    (r"philox", "CUDA's philox random streams"),
    (r"record_stream", "CUDA's caching allocator: no meaning for a CPU server's memory"),
    (r"semi_structured|int4pack|_mixed_dtypes_linear|_scaled_grouped_mm",
     "CUDA-only formats and kernels (2:4 sparsity, int4 packing, mixed-dtype and fp8 grouped products)"),
    (r"^batch_norm_", "SyncBatchNorm's CUDA steps: SyncBatchNorm runs on CUDA tensors only"),
    (r"conv_depthwise", "CUDA's depthwise convolutions: convolution on remote_accel arrives as "
                        "convolution_overrideable"),
    (r"^(max_pool2d_backward|linear_backward|_resize_output_)$",
     "an MPS (or meta-only) helper: other devices compute these gradients and resizes otherwise"),
)


def _overload(name: str) -> torch._ops.OpOverload:
    op_name, _, overload = name.partition("::")[2].partition(".")
    return getattr(getattr(torch.ops.aten, op_name), overload or "default")


def _why(name: str) -> str:
    short = name.partition("::")[2].partition(".")[0]
    for pattern, why in REASONS:
        if re.search(pattern, short):
            return why
    return "no decomposition yet"


def rows() -> list[tuple[str, str, str]]:
    """(op, status, how or why) for each aten op without a CPU kernel, sorted by name."""
    ops.use_device_type("cpu")
    found = []
    for name in sorted(torch._C._dispatch_get_all_op_names()):
        if not name.startswith("aten::") or decompositions.has_kernel(name, "cpu"):
            continue
        try:
            op = _overload(name)
        except (AttributeError, RuntimeError):  # a dispatcher name Python does not expose
            continue
        fn = ops.resolve(name).fn
        if fn is op:
            found.append((name, "unsupported", _why(name)))
        elif fn is ops.SUBSTITUTES.get(name):
            found.append((name, "substituted", f"server/ops.py {fn.__name__}"))
        else:
            found.append((name, "decomposed", f"{fn.__module__}.{fn.__qualname__}"))
    return found


def header() -> str:
    return ("# Aten ops that reach a CPU server with no CPU kernel, and what the server does with each:\n"
            "# op, status (decomposed / substituted / unsupported), how or why.\n"
            f"# Written by scripts/list_no_cpu_kernel_ops.py with torch {torch.__version__}; "
            "tests/server/test_decompositions.py checks it.\n")


def main() -> int:
    out = [header()]
    out += [f"{name:<56} {status:<12} {detail}\n" for name, status, detail in rows()]
    try:
        sys.stdout.write("".join(out))
    except BrokenPipeError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
