"""PyTorch's OpInfo database (fp32) on remote_accel against CPU results: a report.

    python benchmarks/opinfo_report.py [--device cpu|cuda] [--samples K] [--limit N] [--json]

Starts a server (on CPU unless --device says otherwise), and for each op_db entry that supports float32 does what PyTorch's
own `TestCommon.test_compare_cpu` does for an accelerator: makes the first K sample
inputs on the device, copies them to CPU, runs the op on both and compares (atol and
rtol 1e-3). Each sample runs twice on the device: the second call is served from the
plans the first made (the C++ fallback's path), and must match as well. Entries that test skips on every device (random or uninitialised outputs)
are excluded, and so are entries whose CPU reference itself raises (CUDA-only
jiterator ops): both are listed. On a GPU server, PyTorch's marks for that device type
apply too, and entries without float32 support on that device are listed apart (they
are not the server's to run). Prints the pass rate and every failure with its cause.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import warnings

import torch

import remote_accel
from remote_accel.server.testing import ServerProcess

DEVICE = "remote_accel"


def _compare_cpu_marks(op, server_type: str) -> tuple[str | None, bool]:
    """How TestCommon.test_compare_cpu treats this entry on every device, and on the
    server's device type: (the reason it skips it or None, whether it expects it to fail)."""
    from torch.testing._internal.opinfo.core import DecorateInfo

    expected_failure = False
    for info in op.decorators:
        if not isinstance(info, DecorateInfo):
            continue
        if info.device_type is not None and (server_type == "cpu" or info.device_type != server_type):
            continue
        if info.test_name != "test_compare_cpu" or info.cls_name not in (None, "TestCommon"):
            continue
        if info.dtypes is not None and torch.float32 not in info.dtypes:
            continue
        for decorator in info.decorators:
            try:
                marked = decorator(lambda self: None)
            except Exception:  # not a plain test decorator (tolerance overrides...)
                continue
            if getattr(marked, "__unittest_skip__", False):
                return marked.__unittest_skip_why__, False
            expected_failure |= bool(getattr(marked, "__unittest_expecting_failure__", False))
    return None, expected_failure


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu")
    return value


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


class _NoReference(Exception):
    """The CPU reference raised: there is nothing to compare with."""


def check_entry(op, samples: int) -> None:
    """Raise on the first sample whose remote result differs from CPU's."""
    for i, sample in enumerate(op.sample_inputs(DEVICE, torch.float32)):
        if i >= samples:
            break
        cpu_sample = sample.transform(_to_cpu)
        try:
            want = cpu_sample.output_process_fn_grad(op(cpu_sample.input, *cpu_sample.args, **cpu_sample.kwargs))
        except Exception as exc:
            raise _NoReference(_first_line(exc)) from exc
        for call in ("first", "second"):
            # the second, equal call is served from the plans the first one made (in C++,
            # csrc/op_queue.cpp) rather than by Python: it must say the same
            got = sample.output_process_fn_grad(op(sample.input, *sample.args, **sample.kwargs))
            got = torch.utils._pytree.tree_map(_to_cpu, got)
            try:
                torch.testing.assert_close(got, want, equal_nan=True, check_device=False, atol=1e-3, rtol=1e-3)
            except AssertionError as exc:
                if call == "first":
                    raise
                raise AssertionError(f"the second call (served from cached plans) differs: {exc}") from exc


def entry_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=os.environ.get("REMOTE_ACCEL_TEST_DEVICE", "cpu"),
                        help="the server's device (default: cpu, or $REMOTE_ACCEL_TEST_DEVICE)")
    parser.add_argument("--limit", type=int, default=0, help="only the first N entries (default: all)")
    parser.add_argument("--samples", type=int, default=2, help="sample inputs per entry (default: 2)")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from torch.testing._internal.common_methods_invocations import op_db

    entries = [op for op in op_db if torch.float32 in op.supported_dtypes("cpu")]
    if args.limit:
        entries = entries[: args.limit]
    server_type = args.device.split(":")[0]
    failures, skipped, no_reference, unsupported = (collections.OrderedDict() for _ in range(4))
    if server_type != "cpu":
        for op in entries:
            if torch.float32 not in op.supported_dtypes(server_type):
                unsupported[entry_name(op)] = f"no float32 {server_type} kernel in PyTorch"
        entries = [op for op in entries if entry_name(op) not in unsupported]
    with ServerProcess(device=args.device) as server:
        address = "%s:%d" % server.tcp

        def connect():
            remote_accel.init(transport="tcp", server=address, token=server.token, timeout=60)

        connect()
        from remote_accel.pytorch_ext.handles import _C

        served_from_plans = 0  # op calls the C++ fallback served without Python
        for op in entries:
            name = entry_name(op)
            reason, expected_failure = _compare_cpu_marks(op, server_type)
            if reason is not None:
                skipped[name] = reason
                continue
            torch.manual_seed(0)
            served = _C.plan_stats()[1]
            try:
                check_entry(op, args.samples)
            except _NoReference as exc:
                no_reference[name] = str(exc)
            except Exception as exc:  # the report lists every cause
                failures[name] = _first_line(exc) + (
                    " (PyTorch expects this entry to fail on every accelerator)" if expected_failure else "")
            served_from_plans += _C.plan_stats()[1] - served
            if not remote_accel.pytorch_ext.runtime.sessions()[0].alive:
                remote_accel.shutdown()
                connect()
        remote_accel.shutdown()
    compared = len(entries) - len(skipped) - len(no_reference)
    passed = compared - len(failures)
    report = {
        "entries": len(entries), "compared": compared, "passed": passed,
        "pass_rate": passed / compared if compared else 0.0,
        "failures": failures, "skipped": skipped, "no_cpu_reference": no_reference,
        "unsupported_on_server": unsupported, "server_device": args.device,
        "samples_per_entry": args.samples, "torch": torch.__version__,
        "calls_served_from_plans": served_from_plans,
    }
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
        return 0
    print(f"OpInfo fp32 on remote_accel (server on {args.device}) vs CPU (torch {torch.__version__}, "
          f"{args.samples} samples per entry):")
    print(f"  {passed}/{compared} compared entries match ({100 * report['pass_rate']:.1f}%); "
          f"{len(entries)} entries, {len(skipped)} skipped as PyTorch's test_compare_cpu skips them, "
          f"{len(no_reference)} without a CPU reference, {len(unsupported)} without a kernel on {server_type}; "
          f"every sample ran twice, {served_from_plans} op calls served from cached plans")
    for title, items in (("FAIL", failures), ("NO CPU REFERENCE", no_reference), ("SKIPPED", skipped),
                         ("UNSUPPORTED ON SERVER", unsupported)):
        for name, cause in items.items():
            print(f"  {title} {name}: {cause}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
