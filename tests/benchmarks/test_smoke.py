"""Every benchmark in benchmarks/ runs, as a user runs it (`python benchmarks/X.py ...`, a
process of its own), with the smallest settings its flags allow: it exits 0 and prints
its table or its ratio lines. A smoke test, not a measurement: the figures are never
checked against any time (they depend on the machine and on what else runs on it), only
that each row is there and holds a number, and what a benchmark states as a fact of its
run (bytes counted, storages swapped) where that is not a time.

bench_gpu.py and opinfo_report.py have their own tests (tests/e2e/test_bench_gpu.py,
tests/e2e/test_opinfo.py); sync_points.py, opinfo_checks.py and timing.py are modules of
the benchmarks (bench_device.py, opinfo_report.py, all of them), run through them.
The DPDK runs use memif, as a user's do; CI has DPDK, so they never skip there."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
NUMBER = r"-?[\d,]+(?:\.\d+)?"
TIMEOUT_S = 600  # one benchmark's run, EAL start-ups and Inductor compiles included, on a loaded 2-core host

try:
    from remote_accel.dataplane import dpdk  # noqa: F401
    NO_DPDK = None
except ImportError as exc:  # UnavailableError: DPDK or the shim is missing
    NO_DPDK = f"DPDK transport unavailable: {exc}"


@pytest.fixture
def need_dpdk(require_in_ci):
    """The run uses DPDK memif: skip where the transport is missing (a failure in CI)."""
    if NO_DPDK:
        require_in_ci(NO_DPDK)


# serial: each benchmark starts servers and local baselines in clean processes; CI runs
# them after the rest of the suite, two tests at a time
pytestmark = pytest.mark.serial


def run_bench(script: str, *args: str) -> list[str]:
    """Run benchmarks/`script` with `args`; its stdout's lines, after checking it exited 0."""
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{script} {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc.stdout.splitlines()


def row(lines: list[str], label: str) -> str:
    """The one line that starts with `label` (after leading blanks): the rest of it."""
    found = [line.strip()[len(label):] for line in lines if line.strip().startswith(label)]
    assert len(found) == 1, f"expected one row {label!r} in:\n" + "\n".join(lines)
    return found[0]


def numbers(text: str) -> list[float]:
    return [float(n.replace(",", "")) for n in re.findall(NUMBER, text)]


def test_every_benchmark_script_has_a_smoke_test_here():
    """A new benchmark gets its smoke test: every script in benchmarks/ with a main is
    run by a test of this file or by its own test."""
    own_tests = {"bench_gpu.py", "opinfo_report.py"}  # tests/e2e/test_bench_gpu.py, test_opinfo.py
    source = pathlib.Path(__file__).read_text()
    scripts = sorted(p.name for p in BENCHMARKS.glob("*.py") if '__name__ == "__main__"' in p.read_text())
    assert "bench_device.py" in scripts, scripts  # the glob found the folder
    untested = [s for s in scripts if s not in own_tests and f'run_bench("{s}"' not in source]
    assert not untested, f"benchmarks without a smoke test: {untested}"


def test_cpu_bernoulli_table():
    lines = run_bench("bench_cpu_bernoulli.py", "--repeats", "1")
    assert lines[0].startswith("torch ") and "threads" in lines[0], lines
    assert lines[1].split() == ["shape", "torch", "us", "server", "us", "torch", "ns/el", "server", "ns/el",
                                "speed-up"], lines
    rows = lines[2:]
    assert len(rows) == 4, lines  # the tiny Transformer's three dropout shapes and a large FFN's
    for line in rows:
        assert re.fullmatch(rf".+?(\s+{NUMBER}){{4}}\s+{NUMBER}x", line), line


def test_cpu_wait_rows():
    lines = run_bench("bench_cpu_wait.py", "--rounds", "1", "--steps", "7")
    assert lines[1].split()[:2] == ["round", "local"] and "PASSIVE" in lines[1], lines
    values = numbers(lines[2])
    assert len(values) == 6 and values[0] == 1 and all(v > 0 for v in values[1:]), lines


@pytest.mark.dpdk
def test_sync_after_idle_slices(need_dpdk):
    lines = run_bench("sync_after_idle.py", "--transport", "dpdk", "--rounds", "2", "--pause", "0.1")
    assert lines[0].startswith("x.sum().item() over dpdk: medians of 75-call slices"), lines
    first, after = row(lines, "new connection: median"), row(lines, "after 0.1 s: median")
    for text in (first, after):
        # the median, then 900 / 75 = 12 slices: microseconds[client faults,server faults]
        assert len(re.findall(r"\d+\[\d+,\d+\]", text)) == 12, text


@pytest.mark.dpdk
def test_clients_table(need_dpdk):
    lines = run_bench("bench_clients.py", "--clients", "2", "--transports", "dpdk", "--steps", "1")
    assert lines[0].split()[:2] == ["transport", "clients"], lines
    (memif,) = [line.split() for line in lines[1:]]
    assert memif[:2] == ["memif", "2"] and len(numbers(" ".join(memif[2:]))) == 3, lines


def _pool_rows(lines: list[str], mib: int) -> None:
    direct, through = numbers(row(lines, "direct")), numbers(row(lines, "through_client"))
    # ms, GB/s, client wire bytes per copy, peer bytes per copy
    assert len(direct) == 4 and len(through) == 4, lines
    assert direct[3] == mib << 20 and through[3] == 0, lines  # direct: server to server; else none
    assert through[2] >= 2 * (mib << 20) > direct[2], lines  # through the client: down and up again
    assert re.fullmatch(rf": {NUMBER}x", row(lines, "ratio (through client / direct)")), lines


def test_pool_two_servers():
    lines = run_bench("bench_pool.py", "--mib", "1", "--repeat", "1")
    assert lines[0] == "copy of 1 MiB remote_accel:0 -> remote_accel:1 (two servers, best of 1)", lines
    _pool_rows(lines, 1)


def test_pool_on_ray():
    pytest.importorskip("ray", reason="remote_accel.ray needs Ray: pip install 'remote_accel[ray]'")
    lines = run_bench("bench_pool.py", "--mib", "1", "--repeat", "1", "--ray")
    assert lines[0] == "copy of 1 MiB remote_accel:0 -> remote_accel:1 (Ray pool, best of 1)", lines
    _pool_rows(lines, 1)


@pytest.mark.parametrize("link", ["tcp", "tls", "dpdk"])
def test_parallel_rows_and_projection(link, request):
    if link == "dpdk":
        request.getfixturevalue("needs_dpdk")  # skips where DPDK is missing (fails in CI)
    lines = run_bench("bench_parallel.py", "--servers", "1,2", "--steps", "1", "--batch", "8", "--width", "16",
                      "--depth", "1", *(() if link == "tcp" else (f"--{link}",)))
    assert lines[0].startswith("DataParallel, MLP 1 x (16 -> 64 -> 16)"), lines
    assert lines[0].endswith({"tcp": "thread(s)", "tls": ", TLS", "dpdk": ", server 0 over DPDK (memif)"}[link]), lines
    measured = lines[2:lines.index(next(line for line in lines if line.startswith("ceiling:")))]
    rows = {int(line.split()[0]): numbers(line) for line in measured}
    assert sorted(rows) == [1, 2], lines
    # the link of each device: server 0 over the transport asked for, the others over TCP (or TLS)
    assert measured[-1].split()[-1] == {"tcp": "tcp/tcp", "tls": "tls/tls", "dpdk": "dpdk/tcp"}[link], lines
    for n, r in rows.items():
        # servers, samples/s, step ms, speedup, ceiling, client CPU ms, tensor B, wire B, server-server B
        assert len(r) == 9, lines
        # the only tensor bytes through the client: the batch going up and the loss coming down
        assert r[6] == 2 * 8 * 16 * 4 + 4, lines
    assert rows[1][8] == 0 and rows[2][8] > 0, lines  # with two servers, parameters and gradients go between them
    assert len(numbers(row(lines, "direct copy 0 -> 1: latency"))) == 3, lines
    projected = [line.split() for line in lines if re.match(r"\s+[1248]\s+[\d.]+\s+[\d.]+\s+[\d.]+x\s", line)]
    assert [p[0] for p in projected[-4:]] == ["1", "2", "4", "8"], lines


def test_recovery_overhead_and_recovery_rows():
    lines = run_bench("bench_recovery.py", "--steps", "3", "--rounds", "1", "--big-mb", "8", "--server-threads", "1")
    # round 0: on ms, off ms, their ratio
    assert len(numbers(row(lines, "0 "))) == 3, lines
    assert len(numbers(row(lines, "median on/off:"))) == 1, lines
    # a fresh batch per step: on ms, off ms, ratio, RSS growth, recovery MB
    assert len(numbers(row(lines, "loader 0"))) == 5 and numbers(row(lines, "loader 0"))[4] > 0, lines
    assert len(numbers(row(lines, "loader median on/off:"))) == 1, lines
    for model, columns in (("tiny", 7), ("mlp", 8)):
        # [the MLP's parameter MB,] steps, step s, kept MB, ops replayed, recovery s, then s, work s
        values = numbers(row(lines, model))[-7:]
        assert len(numbers(row(lines, model))) == columns and values[0] >= 1 and values[3] > 0, lines


def test_swap_ratio_and_swap_figures():
    lines = run_bench("bench_swap.py", "--width", "64", "--layers", "2", "--steps", "1")
    assert lines[0].startswith("model state ") and "(AdamW per parameter, 1 steps, median)" in lines[0], lines
    for label in ("step, swapping", "step, enough memory", "ratio", "swapped per step"):
        assert len(numbers(row(lines, label))) == 1, lines
    assert re.fullmatch(rf"\s*{NUMBER} %\s+\(\d+ hits, \d+ misses\)", row(lines, "prefetch hit rate")), lines
    # half the model's state fits the device: the run swapped both ways
    for label in ("swap in", "swap out"):
        _, storages = numbers(row(lines, label))
        assert storages > 0, lines


@pytest.mark.dpdk
def test_dataplane_table(need_dpdk):
    lines = run_bench("bench_dataplane.py", "--size", str(1 << 20), "--count", "1", "--rtts", "10",
                      "--idle-ms", "0.1", "--user-size", str(1 << 20), "--user-rounds", "1")
    assert lines[0].split() == ["bulk", "GB/s", "x", "TCP", "%", "memcpy", "RTT", "p50", "us", "RTT", "p99", "us",
                                "idle", "RTT", "p50"], lines
    # a row: its name in 16 columns, then bulk GB/s, x TCP, % memcpy, RTT p50, p99, idle p50 ("-": none)
    rows = {line[:16].strip(): line[16:].split() for line in lines[1:] if not line.startswith(("(", "dpdk:"))}
    measured = {"memcpy": "bulk", "dpdk memif": "both", "dpdk memif naps": "rtt", "tcp loopback": "both",
                "tcp no poll": "rtt", "tls loopback": "both", "user memif": "bulk", "user tcp": "bulk", "user tls": "bulk"}
    assert list(rows) == list(measured), lines
    for name, kind in measured.items():
        cells = rows[name]
        assert len(cells) == 6, (name, lines)
        for i, cell in enumerate(cells):
            expected = kind == "both" or (kind == "bulk") == (i < 3)
            assert bool(re.fullmatch(rf"{NUMBER}%?", cell)) == expected and (expected or cell == "-"), (name, lines)
    assert any(line.startswith("(tcp loopback: both ends poll up to") for line in lines), lines
    assert any(line.startswith("(user: 1 MiB tensor") for line in lines), lines
    assert re.match(r"dpdk: \d+ frames, \d+ zero-copy, \d+ retransmitted", lines[-1]), lines


@pytest.mark.dpdk
def test_dataplane_sweep_rows(need_dpdk):
    lines = run_bench("bench_dataplane.py", "--only", "dpdk,tcp", "--user-size", "0", "--size", str(1 << 20),
                      "--count", "1", "--rtts", "10", "--sweep", "--sweep-mib", "8")
    start = next(i for i, line in enumerate(lines) if line.startswith("user sweep, GB/s one way"))
    assert lines[start].split()[-8:] == ["memif", "up", "memif", "down", "tcp", "up", "tcp", "down"], lines
    labels = ["64 KiB", "1 MiB", "8 MiB as 2 x 4 MiB", "8 MiB as 8 x 1 MiB"]
    expected = [f"{label} round {r}" for label in labels for r in (1, 2)] + ["model .to(), 17 MB"]
    rows = lines[start + 1:start + 1 + len(expected)]
    for label, line in zip(expected, rows):
        assert line.startswith(label), (label, lines)
        values = numbers(line[len(label):])
        assert len(values) == 4 and all(v > 0 for v in values), (label, lines)  # memif and TCP, up and down


@pytest.mark.dpdk
def test_device_rows_over_memif(need_dpdk):
    lines = run_bench("bench_device.py", "--transport", "dpdk", "--steps", "1", "--chain-ops", "200",
                      "--idle-matmuls", "10")
    text = "\n".join(lines)
    # the local baselines ran in a clean process, and the remote losses matched them
    assert lines[0].startswith("server: its default CPU threads; local: ") and "losses checked" in lines[0], text
    for label in ("tiny-op chain, remote (ops/s)", "tiny-op chain, local (ops/s)",
                  "out-of-place chain y = x + 1.0, remote (ops/s)", "16x16 add_ ops per second end to end",
                  "round trips per eager MLP step", "MLP step local compiled (Inductor) (ms)",
                  "synchronize() with nothing queued (us)", "x.sum().item() (us)", "x.cpu(), 16 floats (us)",
                  "idle client's own CPU use (% of a core)"):
        assert len(numbers(row(lines, label))) == 1, (label, text)
    for label in ("tiny Transformer step remote / local (ms)", "MLP step remote eager / local (ms)",
                  "MLP step remote compiled / local", "MLP step uploading its batch, remote / local (ms)",
                  "idle client: 10 local matmul+tanh (s)"):
        assert re.fullmatch(rf"\s*{NUMBER} / {NUMBER} = {NUMBER}x", row(lines, label)), (label, text)
    assert re.fullmatch(rf"\s*{NUMBER} - {NUMBER} = {NUMBER}", row(lines, "server cost per op beyond the kernel (us)"))
    generate = row(lines, "tiny GPT-2 generate 16 tokens remote / CPU (ms)").strip()
    assert generate == "skipped: transformers is not installed" or "(tokens differ!)" not in generate, text
    # every row measured: no "-" cell
    assert not [line for line in lines if line.rstrip().endswith(" -")], text


@pytest.mark.dpdk
def test_device_sync_points_both_transports(need_dpdk):
    """The default --transport both: a process per transport, one table with a column each."""
    lines = run_bench("bench_device.py", "--steps", "1", "--sync-only", "--idle-matmuls", "10")
    assert lines[0].startswith("server: its default CPU threads; no local runs"), lines
    assert lines[1].split() == ["tcp", "dpdk"], lines
    for label in ("synchronize() with nothing queued (us)", "x.sum().item() (us)",
                  "(x + 1).sum().item() (us)", "x.cpu(), 16 floats (us)"):
        assert len(numbers(row(lines, label))) == 2, (label, lines)
    assert row(lines, "tiny-op chain, remote (ops/s)").split() == ["-", "-"], lines  # not measured: --sync-only
    idle = row(lines, "idle client: 10 local matmul+tanh (s)")
    assert len(re.findall(rf"{NUMBER} / {NUMBER} = {NUMBER}x", idle)) == 2, lines
    assert lines[-1] == "idle client: connected (idle) / before init() in the same process", lines


def test_device_sync_points_over_tls():
    """--transport tls: a server with a certificate made for the run, the client checking it."""
    lines = run_bench("bench_device.py", "--transport", "tls", "--steps", "1", "--sync-only", "--idle-matmuls", "10")
    assert lines[1].split() == ["tls"], lines
    for label in ("synchronize() with nothing queued (us)", "x.sum().item() (us)", "x.cpu(), 16 floats (us)"):
        assert len(numbers(row(lines, label))) == 1, (label, lines)


def test_compile_rows():
    """Local eager and Inductor against the remote compiled model with its graphs replayed
    by the server (REMOTE_ACCEL_COMPILE_GRAPHS=0): of the remote runs, the one with no
    Inductor compile on the server, which on a cold cache takes a minute per run on the
    2-core machine (the server's compiler runs through bench_gpu.py --compile in
    tests/e2e/test_bench_gpu.py, and in tests/e2e/test_compiled_graphs.py)."""
    lines = run_bench("bench_compile.py", "--steps", "1", "--rounds", "1", "--runs", "replayed")
    assert lines[0].startswith("transport: tcp; ") and "medians of 1 steps, then of 1 rounds" in lines[0], lines
    rows = {m.group(1): m.group(2) for m in (re.match(r"step time (.+?):\s+(.*)", line) for line in lines[1:]) if m}
    names = list(rows)
    # the local rows and the one remote run asked for; the other remote runs' rows are left out
    assert re.fullmatch(r"local eager CPU \(\d+ threads\)", names[0]), lines
    assert names[1:] == ["local eager CPU, 1 thread", "local compiled CPU (Inductor, model)",
                         "remote compiled model, graphs replayed",
                         "local eager CPU, 1 thread, no optimizer step"], lines
    for figures in rows.values():
        assert re.fullmatch(rf"{NUMBER} ms  \({NUMBER}x local eager, {NUMBER}x on 1 thread\) \[{NUMBER}\]",
                            figures), figures
    assert not any(line.startswith("server graph figures") for line in lines), lines  # no compiled run asked


def test_compile_refuses_an_unknown_run():
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_compile.py"), "--runs", "compiled,fast"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--runs: some of replayed, compiled" in proc.stderr, proc.stderr


def test_ddp_rows_bandwidth_and_model():
    lines = run_bench("bench_ddp.py", "--ranks", "1,2", "--models", "ddp", "--steps", "1", "--sizes", "64K",
                      "--width", "64", "--depth", "1", "--server-threads", "1")
    assert lines[0].startswith("bench_ddp ") and "link tcp" in lines[0], lines
    rows = {int(r[0]): numbers(" ".join(r[1:])) for r in (line.split()[1:] for line in lines if line.startswith("ddp "))}
    assert sorted(rows) == [1, 2], lines
    for n, r in rows.items():
        # step ms, no_sync ms, efficiency, client B/step, tensor B/step, grad bytes
        assert len(r) == 6 and r[0] > 0 and r[1] > 0, lines
        # the client sends the batch and reads the loss; the gradients never pass through it
        assert r[3] < r[5], lines
    assert rows[1][2] == 1.0, lines
    bandwidth = numbers(row(lines, "65536"))  # time us, algbw, busbw, copy, busbw/copy
    assert len(bandwidth) == 5 and bandwidth[0] > 0, lines
    modelled = [line.split()[0] for line in lines if re.match(r"\s+\d+ servers: step", line)]
    assert modelled == ["1", "2", "4", "8"] * 2, lines  # this MLP, then GPT-2 small
