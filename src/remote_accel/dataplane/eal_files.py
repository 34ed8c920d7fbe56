"""Files EAL leaves behind, and removing them. Pure Python (no DPDK needed).

EAL makes a runtime folder per process, `<base>/<file-prefix>` (base: /var/run/dpdk
for root, else $XDG_RUNTIME_DIR/dpdk or /tmp/dpdk), and never removes it, not even in
rte_eal_cleanup; with --no-huge it holds a memory map file of about 12 MiB, and
hugepage-backed memory without --in-memory leaves rtemap files in hugetlbfs. Our
processes name their prefix `ra<pid>_<n>` (eal_args.default_eal_args), so:
- a clean exit removes its own folder (dpdk.py registers `remove_own` at exit);
- every EAL start first removes the folders and hugepage files of `ra<pid>_*` prefixes
  whose process is gone (killed processes cannot clean up after themselves).
Prefixes of live processes and names of any other form are never touched.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import shutil

log = logging.getLogger(__name__)

_OURS = re.compile(r"^ra(\d+)_\d+")
HUGETLBFS = "/dev/hugepages"


def runtime_base() -> str:
    """Where EAL makes its per-prefix folders (eal_get_runtime_dir's rule)."""
    if os.getuid() == 0:
        return "/var/run/dpdk"
    return os.path.join(os.environ.get("XDG_RUNTIME_DIR") or "/tmp", "dpdk")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def _dead_owner(name: str) -> bool:
    match = _OURS.match(name)
    return bool(match) and int(match.group(1)) != os.getpid() and not _alive(int(match.group(1)))


def sweep_dead(base: str | None = None, hugetlbfs: str = HUGETLBFS) -> list[str]:
    """Remove what EAL left for `ra<pid>_*` prefixes of dead processes; returns the paths."""
    removed = []
    base = base or runtime_base()
    try:
        names = os.listdir(base)
    except OSError:
        names = []
    for name in names:
        path = os.path.join(base, name)
        if _dead_owner(name) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    for path in glob.glob(os.path.join(glob.escape(hugetlbfs), "ra*map_*")):
        if _dead_owner(os.path.basename(path)):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    if removed:
        log.debug("removed DPDK files of exited processes: %s", ", ".join(removed))
    return removed


def remove_own(runtime_dir: str) -> None:
    """This process's runtime folder, at exit (only one of our own prefix form)."""
    if runtime_dir and _OURS.match(os.path.basename(runtime_dir)):
        shutil.rmtree(runtime_dir, ignore_errors=True)
