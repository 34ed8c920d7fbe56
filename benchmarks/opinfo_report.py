"""PyTorch's OpInfo database (fp32) on remote_accel against CPU results: a report.

    python benchmarks/opinfo_report.py [--limit N] [--samples K]

Starts a CPU server, runs each op_db entry's first K sample inputs on remote_accel and
on CPU, and prints the pass rate and every failure with its cause.
"""

import argparse
import collections
import sys

import torch

import remote_accel
from remote_accel.server.testing import ServerProcess


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def _cpu(value):
    return _to(value, "cpu")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--limit", type=int, default=0, help="only the first N entries (default: all)")
    parser.add_argument("--samples", type=int, default=2, help="sample inputs per entry (default: 2)")
    args = parser.parse_args()
    from torch.testing._internal.common_methods_invocations import op_db

    entries = [op for op in op_db if torch.float32 in op.supported_dtypes("cpu")]
    if args.limit:
        entries = entries[: args.limit]
    failures = collections.OrderedDict()
    with ServerProcess() as server:
        host, port = server.tcp
        remote_accel.init(transport="tcp", server=f"{host}:{port}", token=server.token, timeout=60)
        for op in entries:
            name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
            try:
                for i, sample in enumerate(op.sample_inputs("cpu", torch.float32)):
                    if i >= args.samples:
                        break
                    want = op(sample.input, *sample.args, **sample.kwargs)
                    got = op(_to(sample.input, "remote_accel"), *_to(sample.args, "remote_accel"),
                             **_to(sample.kwargs, "remote_accel"))
                    torch.testing.assert_close(_cpu(got), want, equal_nan=True, check_device=False,
                                               atol=1e-4, rtol=1e-4)
            except Exception as exc:  # the report lists every cause
                failures[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                if not remote_accel.pytorch_ext.runtime.sessions()[0].alive:
                    remote_accel.shutdown()
                    remote_accel.init(transport="tcp", server=f"{host}:{port}", token=server.token, timeout=60)
        remote_accel.shutdown()
    passed = len(entries) - len(failures)
    print(f"OpInfo fp32: {passed}/{len(entries)} entries match CPU ({100 * passed / len(entries):.1f}%)")
    for name, cause in failures.items():
        print(f"  FAIL {name}: {cause}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
