"""The shim's API is shim.h, all of it used: the module exports nothing but its Python
entry point (hidden visibility: the shim's functions are called through cffi inside the
module), and every function that shim.h declares is called from Python somewhere."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from remote_accel.dataplane import dpdk

CHECKOUT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm (binutils)")
def test_only_the_module_entry_point_is_exported():
    from remote_accel.dataplane import _dpdk

    so = _dpdk.__file__
    out = subprocess.run(["nm", "-D", "--defined-only", so], capture_output=True, text=True, check=True).stdout
    assert [line.split()[-1] for line in out.splitlines()] == ["PyInit__dpdk"]


def test_every_function_of_shim_h_is_used():
    header = re.sub(r"/\*.*?\*/", "", (CHECKOUT / "src" / "dpdk_shim" / "shim.h").read_text(), flags=re.S)
    declared = set(re.findall(r"\b(shim_\w+)\s*\(", header))
    assert len(declared) > 20
    python = "\n".join(p.read_text() for folder in ("src/remote_accel", "tests")
                       for p in (CHECKOUT / folder).rglob("*.py"))
    unused = sorted(name for name in declared if not re.search(rf"\blib\.{name}\b", python))
    assert unused == [], "declared in shim.h, called from no Python: remove, or make internal"
    for name in declared:
        assert hasattr(dpdk.lib, name), name


def test_the_eal_says_it_is_up(eal):
    assert dpdk.lib.shim_eal_initialized() == 1
