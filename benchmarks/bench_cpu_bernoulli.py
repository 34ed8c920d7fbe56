"""bernoulli_(p) on CPU tensors: torch's kernel vs the server's (server/csrc/cpu_bernoulli.cpp).

    python benchmarks/bench_cpu_bernoulli.py [--repeats N]

Dropout's mask is bernoulli_(1 - p) on a tensor shaped like its input. Both kernels draw
the same numbers from the same generator (tests/server/test_cpu_bernoulli.py); this times
them side by side, timings of the two alternating, on the tiny Transformer's dropout shapes
(batch 8x32, d_model 64, 4 heads, ff 128: issue #12's model) and on a larger one, in
microseconds per call and nanoseconds per element, medians. Then whole-step figures are
bench_compile.py's ("remote compiled model and AdamW step" with the server's kernel and
with torch's). On an Intel CPU with MKL the server keeps torch's kernel (other numbers);
this still times both.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from remote_accel.server import native

# (name, shape): the tiny Transformer's dropouts per encoder layer, and a large FFN's
SHAPES = (
    ("attention weights 8x4x32x32", (8, 4, 32, 32)),
    ("attention output 8x32x64", (8, 32, 64)),
    ("feed-forward 8x32x128", (8, 32, 128)),
    ("feed-forward 8x32x2048", (8, 32, 2048)),
)


def _per_call(fn, repeats: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(repeats):
        fn()
    return (time.perf_counter_ns() - start) / repeats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=200, help="calls per timing; 9 timings per kernel")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; p = 0.9 (dropout 0.1); "
          "medians of 9 timings each, the two kernels' timings alternating")
    print(f"{'shape':32s} {'torch us':>10s} {'server us':>10s} {'torch ns/el':>12s} {'server ns/el':>13s} "
          f"{'speed-up':>9s}")
    for name, shape in SHAPES:
        mask = torch.empty(shape)
        theirs = lambda: mask.bernoulli_(0.9)  # noqa: E731
        ours = lambda: native.cpu_bernoulli_(mask, 0.9)  # noqa: E731
        theirs(), ours()  # warm
        times = {"torch": [], "server": []}
        for _ in range(9):
            times["torch"].append(_per_call(theirs, args.repeats))
            times["server"].append(_per_call(ours, args.repeats))
        t, s = statistics.median(times["torch"]), statistics.median(times["server"])
        n = mask.numel()
        print(f"{name:32s} {t / 1e3:10.1f} {s / 1e3:10.1f} {t / n:12.2f} {s / n:13.2f} {t / s:8.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
