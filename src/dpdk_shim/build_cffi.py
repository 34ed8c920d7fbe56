"""Emit the C source of the cffi API-mode module `remote_accel.dataplane._dpdk`.

meson runs this (custom_target) and compiles its output with the shim's C files, so
the cdef comes from the one header the C code also includes. Usage:
    build_cffi.py shim.h OUTPUT.c
"""

import re
import sys

import cffi


def cdef_text(header: str) -> str:
    """The header without preprocessor lines, keeping integer #defines (cffi knows those)."""
    keep = []
    for line in header.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            if re.match(r"#define\s+\w+\s+-?\d+\s*$", stripped):
                keep.append(stripped)
            continue
        keep.append(line)
    return "\n".join(keep)


def main(argv: list[str]) -> int:
    header_path, out_path = argv[1], argv[2]
    with open(header_path, encoding="utf-8") as f:
        header = f.read()
    ffi = cffi.FFI()
    ffi.cdef(cdef_text(header))
    ffi.set_source("remote_accel.dataplane._dpdk", '#include "shim.h"')
    ffi.emit_c_code(out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
