"""PyTorch's OpInfo database on remote_accel against CPU results: a report.

    python benchmarks/opinfo_report.py [--device cpu|cuda] [--samples K] [--limit N] [--ops NAME,...]
        [--grad] [--grad-samples K] [--dtypes float64,bfloat16,...|all] [--json|--markdown]

Starts a server (on CPU unless --device says otherwise), and for each op_db entry that supports float32 does what PyTorch's
own `TestCommon.test_compare_cpu` does for an accelerator: makes the first K sample
inputs on the device, copies them to CPU, runs the op on both and compares (atol and
rtol 1e-3). Each sample runs twice on the device: the second call is served from the
plans the first made (the C++ fallback's path), and must match as well. Entries that test skips on every device (random or uninitialised outputs)
are excluded, and so are entries whose CPU reference itself raises (CUDA-only
jiterator ops): both are listed. On a GPU server, PyTorch's marks for that device type
apply too, and entries without float32 support on that device are listed apart (they
are not the server's to run).

--grad adds every entry that supports autograd at float32: the first K samples made with
requires_grad=True, their outputs and the gradients of every input (for fixed output
gradients) against CPU's. --dtypes repeats the forward sweep at other dtypes (each entry
that supports the dtype on CPU; bfloat16 compares with rtol 1.6e-2). Prints the pass
rates and every failure with its cause.
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

from opinfo_checks import NoReference, check_forward, check_gradients, first_line

#: what --dtypes all measures besides float32
OTHER_DTYPES = ("float64", "bfloat16", "float16", "int64", "bool", "complex64")


def _compare_cpu_marks(op, server_type: str, dtype: torch.dtype) -> tuple[str | None, bool]:
    """How TestCommon.test_compare_cpu treats this entry at `dtype` on every device, and on
    the server's device type: (the reason it skips it or None, whether it expects it to fail)."""
    from torch.testing._internal.opinfo.core import DecorateInfo

    expected_failure = False
    for info in op.decorators:
        if not isinstance(info, DecorateInfo):
            continue
        if info.device_type is not None and (server_type == "cpu" or info.device_type != server_type):
            continue
        if info.test_name != "test_compare_cpu" or info.cls_name not in (None, "TestCommon"):
            continue
        if info.dtypes is not None and dtype not in info.dtypes:
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


def entry_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")




def _sweep(entries, check, dtype: torch.dtype, server_type: str, backward: bool, connect) -> dict:
    """Run `check(op)` for every entry that supports `dtype` on CPU: one report section."""
    failures, skipped, no_reference, unsupported = (collections.OrderedDict() for _ in range(4))
    supported = (lambda op, d: op.supported_backward_dtypes(d)) if backward else (lambda op, d: op.supported_dtypes(d))
    entries = [op for op in entries if dtype in supported(op, "cpu")]
    for op in entries:
        name = entry_name(op)
        if server_type != "cpu" and dtype not in supported(op, server_type):
            unsupported[name] = f"no {str(dtype)[6:]} {server_type} kernel in PyTorch"
            continue
        # random or uninitialised outputs compare with nothing, with or without gradients
        reason, expected_failure = _compare_cpu_marks(op, server_type, dtype)
        if reason is not None:
            skipped[name] = reason
            continue
        torch.manual_seed(0)
        try:
            check(op)
        except NoReference as exc:
            no_reference[name] = str(exc)
        except Exception as exc:  # the report lists every cause
            failures[name] = first_line(exc) + (
                " (PyTorch expects this entry to fail on every accelerator)" if expected_failure else "")
        if not remote_accel.pytorch_ext.runtime.sessions()[0].alive:
            remote_accel.shutdown()
            connect()
    compared = len(entries) - len(skipped) - len(no_reference) - len(unsupported)
    passed = compared - len(failures)
    return {
        "entries": len(entries), "compared": compared, "passed": passed,
        "pass_rate": passed / compared if compared else 0.0,
        "failures": failures, "skipped": skipped, "no_cpu_reference": no_reference,
        "unsupported_on_server": unsupported,
    }


def _dtypes(text: str) -> list:
    names = OTHER_DTYPES if text == "all" else [n for n in text.split(",") if n]
    dtypes = []
    for name in names:
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise SystemExit(f"--dtypes: {name!r} is not a torch dtype")
        if dtype is not torch.float32:
            dtypes.append(dtype)
    return dtypes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=os.environ.get("REMOTE_ACCEL_TEST_DEVICE", "cpu"),
                        help="the server's device (default: cpu, or $REMOTE_ACCEL_TEST_DEVICE)")
    parser.add_argument("--limit", type=int, default=0, help="only the first N entries (default: all)")
    parser.add_argument("--ops", default="", help="only these comma-separated entries (default: all)")
    parser.add_argument("--samples", type=int, default=2, help="sample inputs per entry (default: 2)")
    parser.add_argument("--grad", action="store_true", help="also outputs and input gradients at float32")
    parser.add_argument("--grad-samples", type=int, default=3,
                        help="sample inputs per entry for --grad (default: 3)")
    parser.add_argument("--dtypes", default="",
                        help=f"comma-separated dtypes to sweep forward besides float32, or 'all' "
                             f"({','.join(OTHER_DTYPES)}); default: none")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    parser.add_argument("--markdown", action="store_true", help="OPINFO.md's tables on stdout")
    args = parser.parse_args()
    dtypes = _dtypes(args.dtypes)
    warnings.filterwarnings("ignore")
    from torch.testing._internal.common_methods_invocations import op_db

    entries = list(op_db[: args.limit] if args.limit else op_db)
    if args.ops:
        entries = [op for op in entries if entry_name(op) in args.ops.split(",")]
    server_type = args.device.split(":")[0]
    with ServerProcess(device=args.device) as server:
        address = "%s:%d" % server.tcp

        def connect():
            remote_accel.init(transport="tcp", server=address, token=server.token, timeout=60)

        connect()
        from remote_accel.pytorch_ext.handles import _C

        served = _C.plan_stats()[1]  # op calls the C++ fallback served without Python
        report = _sweep(entries, lambda op: check_forward(op, args.samples), torch.float32, server_type, False, connect)
        report["calls_served_from_plans"] = _C.plan_stats()[1] - served
        if args.grad:
            report["gradients"] = _sweep([op for op in entries if op.supports_autograd],
                                         lambda op: check_gradients(op, args.grad_samples), torch.float32,
                                         server_type, True, connect)
            report["gradients"]["samples_per_entry"] = args.grad_samples
        report["dtypes"] = {}
        for dtype in dtypes:
            report["dtypes"][str(dtype)[6:]] = _sweep(
                entries, lambda op, d=dtype: check_forward(op, args.samples, d), dtype, server_type, False, connect)
        remote_accel.shutdown()
    report.update({"server_device": args.device, "samples_per_entry": args.samples, "torch": torch.__version__})
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
        return 0
    (_markdown if args.markdown else _print)(report, args, server_type)
    return 0


def _sections(report: dict, args) -> list:
    sections = [("float32", report, f"{args.samples} samples per entry, each run twice")]
    if "gradients" in report:
        sections.append(("float32 outputs and input gradients", report["gradients"],
                         f"{args.grad_samples} samples per entry"))
    sections += [(name, section, f"{args.samples} samples per entry, each run twice")
                 for name, section in report["dtypes"].items()]
    return sections


def _print(report: dict, args, server_type: str) -> None:
    sections = _sections(report, args)
    print(f"OpInfo on remote_accel (server on {args.device}) vs CPU (torch {torch.__version__}); "
          f"{report['calls_served_from_plans']} float32 op calls served from cached plans")
    for title, section, how in sections:
        print(f"{title}: {section['passed']}/{section['compared']} compared entries match "
              f"({100 * section['pass_rate']:.1f}%); {section['entries']} entries, {len(section['skipped'])} skipped "
              f"as PyTorch's test_compare_cpu skips them, {len(section['no_cpu_reference'])} without a CPU "
              f"reference, {len(section['unsupported_on_server'])} without a kernel on {server_type}; {how}")
        for label, key in (("FAIL", "failures"), ("NO CPU REFERENCE", "no_cpu_reference"), ("SKIPPED", "skipped"),
                           ("UNSUPPORTED ON SERVER", "unsupported_on_server")):
            for name, cause in section[key].items():
                print(f"  {label} {name}: {cause}")


def _markdown(report: dict, args, server_type: str) -> None:
    sections = _sections(report, args)
    print("| sweep | entries | compared | match | rate | skipped | no CPU reference | no kernel on server |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for title, s, _ in sections:
        print(f"| {title} | {s['entries']} | {s['compared']} | {s['passed']} | {100 * s['pass_rate']:.2f}% | "
              f"{len(s['skipped'])} | {len(s['no_cpu_reference'])} | {len(s['unsupported_on_server'])} |")
    for title, s, how in sections:
        print(f"\n### {title}\n\n{s['passed']}/{s['compared']} ({100 * s['pass_rate']:.2f}%), {how}.\n")
        rows = [(label, name, cause) for label, key in (("fails", "failures"), ("no CPU reference", "no_cpu_reference"),
                                                        ("skipped", "skipped"),
                                                        ("no kernel on server", "unsupported_on_server"))
                for name, cause in s[key].items()]
        print("| entry | outcome | reason |\n|---|---|---|")
        for label, name, cause in rows:
            print(f"| `{name}` | {label} | {cause.replace('|', '/')} |")


if __name__ == "__main__":
    sys.exit(main())
