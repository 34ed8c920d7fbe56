"""Copies the installed remote_accel package into a folder, with some of its compiled
modules replaced by other builds of them (scripts/sanitize.sh --c-parts: the sanitizer
builds of the C parts over the package as installed).

    python scripts/overlay_package.py OVERLAY_DIR MODULE.so...

Each MODULE.so replaces the module of the same name in the copy (_dpdk, _codec: both
install in remote_accel/dataplane). Put OVERLAY_DIR first on PYTHONPATH to run it.
"""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path

#: the compiled or generated modules the copy takes from wherever the install keeps them
#: (in an installed package, beside the Python; in an editable one, in its build folder)
BUILT = ("remote_accel.pytorch_ext._C", "remote_accel.server._native", "remote_accel.pytorch_ext._build_info",
         "remote_accel.dataplane._dpdk", "remote_accel.dataplane._codec")


def main(overlay: Path, replacements: list[Path]) -> None:
    import remote_accel

    package = overlay / "remote_accel"
    shutil.copytree(Path(remote_accel.__file__).parent, package,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"), dirs_exist_ok=True)
    by_name = {path.name.split(".")[0]: path for path in replacements}
    for name in BUILT:
        *folder, leaf = name.split(".")[1:]
        source = by_name.pop(leaf, None) or Path(importlib.import_module(name).__file__)
        shutil.copy(source, package.joinpath(*folder, source.name))
    if by_name:
        raise SystemExit(f"overlay_package: no installed module to replace with {sorted(by_name.values())}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), [Path(a) for a in sys.argv[2:]])
