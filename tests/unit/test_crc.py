"""dpdk_shim/wire/crc.c alone: the CRC32C of every frame, built here with the C compiler as
the package builds it, against the crc32c package's answers. Both paths run: the
CPU's instruction where this machine has it, and the portable tables that any other
CPU uses. And the file builds for AArch64 (with and without its CRC extension): the
shim is not tied to x86."""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import subprocess
from pathlib import Path

import crc32c
import pytest

SHIM = Path(__file__).resolve().parents[2] / "src" / "dpdk_shim"
CRC_C = SHIM / "wire" / "crc.c"
CC = os.environ.get("CC", "cc")
CROSS_CC = "aarch64-linux-gnu-gcc"
FLAGS = ["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{SHIM}"]


def _build(tmp_path: Path, *defines: str) -> ctypes.CDLL:
    out = tmp_path / f"crc{len(defines)}.so"
    subprocess.run([CC, *FLAGS, "-shared", "-fPIC", *defines, "-o", str(out), str(CRC_C), "-lpthread"],
                   check=True, capture_output=True, text=True)
    lib = ctypes.CDLL(str(out))
    lib.crc32c.restype = ctypes.c_uint32
    lib.crc32c.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    return lib


def _cases():
    rng = random.Random(7)
    data = bytes(rng.getrandbits(8) for _ in range(3 * 6144 + 777))
    # lengths around every block the code cuts (8, 3 x 256, 3 x 2048) at odd alignments
    for length in (0, 1, 7, 8, 9, 767, 768, 769, 6143, 6144, 6145, 3 * 6144 + 5):
        for start in (0, 1, 5):
            yield data[start:start + length]


@pytest.mark.parametrize("defines", [(), ("-DSHIM_CRC_PORTABLE_ONLY",)], ids=["as-built", "portable"])
def test_crc_matches_the_reference(tmp_path, defines):
    lib = _build(tmp_path, *defines)
    for chunk in _cases():
        buf = ctypes.create_string_buffer(chunk, len(chunk) or 1)
        assert lib.crc32c(0, buf, len(chunk)) == crc32c.crc32c(chunk), len(chunk)
        # continuing a CRC over a second piece gives the CRC of the whole
        half = len(chunk) // 2
        first = lib.crc32c(0, buf, half)
        assert lib.crc32c(first, ctypes.byref(buf, half), len(chunk) - half) == crc32c.crc32c(chunk)


@pytest.mark.parametrize("march", ["armv8-a", "armv8-a+crc"])
def test_crc_builds_for_aarch64(tmp_path, march, require_in_ci):
    if shutil.which(CROSS_CC) is None:
        require_in_ci(f"{CROSS_CC} is not installed (quickstart.sh installs gcc-aarch64-linux-gnu)")
    obj = tmp_path / "crc.o"
    subprocess.run([CROSS_CC, f"-march={march}", *FLAGS, "-fPIC", "-c", "-o", str(obj), str(CRC_C)],
                   check=True, capture_output=True, text=True)
    elf = obj.read_bytes()
    assert elf[:4] == b"\x7fELF" and int.from_bytes(elf[18:20], "little") == 183  # EM_AARCH64
