"""Timing shared by the benchmarks."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Optional


def add_server_threads_option(parser: argparse.ArgumentParser) -> None:
    """--server-threads N, passed on to the benchmark's server as its --threads."""
    parser.add_argument("--server-threads", type=int, default=0, metavar="N",
                        help="the server's --threads (default: the server's own default, torch's); on a host "
                             "shared with the client, fewer threads than cores run small models much faster")


def server_thread_options(server_threads: int) -> tuple:
    """The server's command-line options for --server-threads N (none for 0: its default)."""
    return ("--threads", str(server_threads)) if server_threads else ()


def json_child(script: str, argv: list, env: Optional[dict] = None, what: str = "child",
               timeout: Optional[float] = None) -> dict:
    """Run `script` (a benchmark's own file, for one of its parts) in a process of its
    own with `argv`: the JSON object of its last stdout line; SystemExit with its stderr
    when it failed."""
    child = subprocess.run([sys.executable, script, *argv], env=env, capture_output=True, text=True, timeout=timeout)
    lines = child.stdout.strip().splitlines()
    if child.returncode != 0 or not lines:
        raise SystemExit(f"the {what} run failed (rc {child.returncode}):\n{child.stderr[-3000:]}")
    return json.loads(lines[-1])


def median_seconds(fn, n: int, warmup: int = 2) -> float:
    """Median seconds per call after `warmup` calls: on a small shared machine the mean
    follows stray stalls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def wait_for_compiles(session, limit_s: float = 1800.0, failures_fail: bool = True) -> None:
    """Until the server has compiled (or given up on) every graph it holds, at most
    `limit_s`: steps timed while its compiler thread works would measure node-by-node
    replay and the compiler, not the compiled code. A graph it gave up on would be timed
    replayed node by node: SystemExit then, unless `failures_fail` is False (a caller
    that reports the failures itself)."""
    _wait_until_compiled(session, limit_s)
    failures = session.stats()["graph_compile_failures"]
    if failures and failures_fail:
        raise SystemExit(f"the server failed to compile {failures} graph(s) (its log says why): the compiled "
                         "steps would be timed replayed node by node")


def _wait_until_compiled(session, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        stats = session.stats()
        if stats["graph_compiles"] + stats["graph_compile_failures"] >= stats["graphs_cached"]:
            return
        time.sleep(0.5)
