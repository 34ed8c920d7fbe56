"""What EAL leaves on disk: a process's own folder goes at exit, those of dead
processes at the next start; live processes and foreign names are left alone."""

from __future__ import annotations

import os
import subprocess
import sys

from remote_accel.dataplane import eal_files


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no such process now (pids are not reused this fast)


def test_sweep_removes_only_dead_processes_files(tmp_path):
    base, huge = tmp_path / "run", tmp_path / "huge"
    base.mkdir()
    huge.mkdir()
    dead, live = dead_pid(), os.getppid()
    for name in (f"ra{dead}_0", f"ra{dead}_1", f"ra{live}_0", f"ra{os.getpid()}_0", "rte", "other_1"):
        (base / name).mkdir()
        (base / name / "fbarray_memseg").write_bytes(b"x" * 100)
    (huge / f"ra{dead}_0map_0").write_bytes(b"")
    (huge / f"ra{live}_0map_0").write_bytes(b"")
    removed = eal_files.sweep_dead(str(base), str(huge))
    assert sorted(os.path.basename(p) for p in removed) == sorted([f"ra{dead}_0", f"ra{dead}_1", f"ra{dead}_0map_0"])
    assert sorted(os.listdir(base)) == sorted([f"ra{live}_0", f"ra{os.getpid()}_0", "rte", "other_1"])
    assert os.listdir(huge) == [f"ra{live}_0map_0"]


def test_remove_own_only_removes_our_prefix_form(tmp_path):
    mine, foreign = tmp_path / f"ra{os.getpid()}_0", tmp_path / "rte"
    for d in (mine, foreign):
        d.mkdir()
        (d / "f").write_text("x")
    eal_files.remove_own(str(mine))
    eal_files.remove_own(str(foreign))
    assert not mine.exists() and foreign.exists()
