"""docs/architecture.md matches the tree: every path it names exists (paths are relative
to src/, the import tree, or to the checkout for tests/, benchmarks/ and the like), and its
folder table has a row for each package folder and for the DPDK shim."""

from __future__ import annotations

import re
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
SRC = CHECKOUT / "src"
PAGE = (CHECKOUT / "docs" / "architecture.md").read_text()
#: the shim's layer folders, which the folder table names inside the shim's row
SHIM_LAYERS = ("wire/", "link/", "chan/", "wait/", "api/")


def _paths() -> set[str]:
    found = set()
    for token in re.findall(r"`([^`\s]+)`", PAGE):
        token = token.rstrip(":,.")
        if "/" not in token or token.startswith(("http", "/", "-", "../")) or token in SHIM_LAYERS:
            continue
        braces = re.fullmatch(r"(.*)\{([^}]*)\}", token)  # fast_loop.{h,cpp}
        found |= {braces.group(1) + ext for ext in braces.group(2).split(",")} if braces else {token}
    return found


def test_every_path_the_page_names_exists():
    paths = _paths()
    assert len(paths) > 50, "the page names the files of each concept"
    missing = sorted(p for p in paths if not (SRC / p).exists() and not (CHECKOUT / p).exists())
    assert not missing, f"docs/architecture.md names paths the tree lacks: {missing}"


def test_the_folder_table_has_a_row_for_every_folder():
    rows = set(re.findall(r"^\| `([^`]+/)` \|", PAGE, flags=re.M))
    folders = {f"{p.parent.relative_to(SRC)}/" for p in (SRC / "remote_accel").glob("*/__init__.py")}
    folders |= {"remote_accel/", "dpdk_shim/"}
    assert folders == rows, f"folders without a row: {sorted(folders - rows)}; rows without a folder: {sorted(rows - folders)}"
    for layer in SHIM_LAYERS:
        assert (SRC / "dpdk_shim" / layer).is_dir() and f"`{layer}`" in PAGE, layer
