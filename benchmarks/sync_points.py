"""Sync points of the remote_accel device, for bench_device.py (run it, not this module).

What a user waits for at each kind of sync point on a 16-float tensor (median of many),
a tiny GPT-2's greedy `generate()` remote against local CPU, and what a connected but
idle client costs the user's own CPU work in the same process.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from timing import median_seconds

SYNC_REPEATS = 300
IDLE_MATMULS = 2000

#: (row name, key) of the sync table, in the issue's order
SYNC_ROWS = (
    ("synchronize() with nothing queued (us)", "sync_empty_us"),
    ("x.sum().item() (us)", "sum_item_us"),
    ("x.sum().item(), after 500 calls (us)", "sum_item_steady_us"),
    ("x.sum().item() after 5 ms of the user's own work (us)", "sum_item_after_work_us"),
    ("(x + 1).sum().item() (us)", "add_sum_item_us"),
    ("s.item() of a computed scalar (us)", "scalar_item_us"),
    ("x.cpu(), 16 floats (us)", "cpu16_us"),
)


def _median_us(fn, n: int = SYNC_REPEATS, warmup: int = 5) -> float:
    return median_seconds(fn, n, warmup=warmup) * 1e6


def _after_work_us(fn, work_s: float = 0.005, n: int = 100) -> float:
    """Median microseconds of fn() right after `work_s` of the user's own CPU work (a
    training step's host side before its loss.item()): both ends have waited idle
    meanwhile, so this is the wake-up path, not the back-to-back one."""
    times = []
    for _ in range(n):
        end = time.perf_counter() + work_s
        while time.perf_counter() < end:
            pass
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def sync_latencies() -> dict:
    """Medians in microseconds, each row as a user writes it."""
    x = torch.randn(16, device="remote_accel")
    s = x.sum()
    torch.remote_accel.synchronize()
    return {
        "sync_empty_us": _median_us(torch.remote_accel.synchronize),
        "sum_item_us": _median_us(lambda: x.sum().item()),
        # the same once the first calls after idle are behind: on the 2-core VM the first
        # few hundred after a pause of seconds take 2-4x longer (about 20 ms in all; the
        # cause is not established), which the row above, 300 calls after 5, includes
        "sum_item_steady_us": _median_us(lambda: x.sum().item(), warmup=500),
        "sum_item_after_work_us": _after_work_us(lambda: x.sum().item()),
        "add_sum_item_us": _median_us(lambda: (x + 1).sum().item()),
        "scalar_item_us": _median_us(s.item),
        "cpu16_us": _median_us(x.cpu),
    }


def idle_matmuls() -> float:
    """Seconds for IDLE_MATMULS local 256x256 matmul+tanh (the user's own CPU work)."""
    a = torch.randn(256, 256)
    b = torch.randn(256, 256)
    for _ in range(20):
        torch.tanh(a @ b)
    start = time.perf_counter()
    for _ in range(IDLE_MATMULS):
        torch.tanh(a @ b)
    return time.perf_counter() - start


def idle_cpu(seconds: float = 2.0) -> float:
    """This process's CPU time per second of wall time while it sleeps: what its
    background threads (poll engine, heartbeat) take from the user's cores."""
    start, cpu = time.perf_counter(), time.process_time()
    time.sleep(seconds)
    return (time.process_time() - cpu) / (time.perf_counter() - start)


def _tiny_gpt2():
    """A 2-layer, 64-wide GPT-2 with random weights (no download), or None without
    the transformers package."""
    try:
        import transformers
    except ImportError:
        return None
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=1000)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def _generate_once(model, device: str, tokens: int) -> tuple[float, list]:
    ids = torch.arange(1, 9).unsqueeze(0).to(device)
    kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        return time.perf_counter() - start, out[0].tolist()


def generate_ratio(tokens: int = 16, rounds: int = 5) -> dict:
    """Greedy generation remote and on CPU: ms each (medians), and whether the tokens
    agree. The two alternate, call by call: on a small shared host the CPU's own time
    moves by 2x between runs, and alternating puts both under the same load.
    Empty when transformers is not installed."""
    model = _tiny_gpt2()
    if model is None:
        return {}
    remote_model = copy.deepcopy(model).to("remote_accel")
    _generate_once(model, "cpu", tokens)  # warm: plans, meta shapes, server-side caches
    _generate_once(remote_model, "remote_accel", tokens)
    local_times, remote_times = [], []
    for _ in range(rounds):
        seconds, local_tokens = _generate_once(model, "cpu", tokens)
        local_times.append(seconds)
        seconds, remote_tokens = _generate_once(remote_model, "remote_accel", tokens)
        remote_times.append(seconds)
    local, remote = statistics.median(local_times), statistics.median(remote_times)
    return {"gen_local_ms": local * 1e3, "gen_remote_ms": remote * 1e3,
            "gen_tokens_equal": local_tokens == remote_tokens}
