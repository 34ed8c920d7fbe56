"""ra-pmdinfo: list the DPDK poll-mode drivers installed on this host.

Every DPDK driver library carries its metadata in `.rodata` as NUL-terminated strings
`PMD_INFO_STRING=<json>` (name, device parameters, supported PCI ids). Reading them with
pyelftools needs neither EAL nor root, so this works on any host, even without hugepages.
Drivers that remote_accel can use without a NIC are marked.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field

from .extras import requires

PREFIX = b"PMD_INFO_STRING="

#: Virtual drivers remote_accel runs on without any NIC, and what each is good for.
NO_NIC_DRIVERS = {
    "net_ring": "loopback or a port pair inside one process",
    "net_null": "load and overhead tests (drops TX, RX returns stale mbufs)",
    "net_memif": "two processes on one host (the default transport)",
    "net_af_packet": "a kernel interface, e.g. a veth pair across network namespaces",
    "net_tap": "a kernel tap interface (frames up to 1500 bytes)",
}

# Debian/Ubuntu, Fedora/RHEL, and a source install under /usr/local.
_LIB_DIRS = (
    "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
    "/usr/local/lib/x86_64-linux-gnu", "/usr/local/lib64", "/usr/local/lib",
)
_INSTALL_HINT = "install DPDK (Debian/Ubuntu: apt-get install dpdk) or name the driver folder with --dir"


class NoDrivers(Exception):
    """No DPDK driver was found where we looked; the message says where."""


@dataclass
class Driver:
    name: str
    kind: str  # net, crypto, baseband, event, ... (from the library's file name)
    library: str
    params: str  # the raw "params" string, as the driver declares it
    param_list: list = field(default_factory=list)  # params split into "key=value" items
    pci_ids: int = 0
    kmod: str = ""  # kernel module the driver needs for PCI devices
    no_nic: bool = False
    no_nic_use: str = ""


# -- finding the driver folder ---------------------------------------------------------
def _pkg_config(variable: str) -> str:
    try:
        out = subprocess.run(["pkg-config", f"--variable={variable}", "libdpdk"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def default_dirs() -> tuple[list[str], list[str]]:
    """(PMD folders found, places looked at). pkg-config's `pmdsdir` first; Debian does not
    set it, so then the `dpdk/pmds-*` folders under pkg-config's libdir and the usual lib dirs."""
    looked: list[str] = []
    pmdsdir = _pkg_config("pmdsdir")
    if pmdsdir:
        looked.append(pmdsdir)
        if os.path.isdir(pmdsdir):
            return [pmdsdir], looked
    libdirs = [d for d in (_pkg_config("libdir"),) if d] + list(_LIB_DIRS)
    found: list[str] = []
    for libdir in dict.fromkeys(libdirs):
        pattern = os.path.join(libdir, "dpdk", "pmds-*")
        looked.append(pattern)
        found += [d for d in sorted(glob.glob(pattern)) if os.path.isdir(d) and d not in found]
    return found, looked


def library_files(folder: str) -> list[str]:
    """Each driver library once: librte_x.so, .so.23 and .so.23.0 are links to one file."""
    seen: dict[str, str] = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.so*"))):
        real = os.path.realpath(path)
        if os.path.isfile(real):
            # keep the shortest name (librte_net_ring.so), it reads best
            if real not in seen or len(path) < len(seen[real]):
                seen[real] = path
    return sorted(seen.values())


# -- reading one library ---------------------------------------------------------------
def _kind(library: str) -> str:
    base = os.path.basename(library)
    m = re.match(r"librte_([a-z0-9]+)_", base)
    return m.group(1) if m else "?"


def read_library(path: str) -> list[Driver]:
    """The drivers declared in one .so; [] for a file that is not ELF or has no metadata."""
    with requires("ra-pmdinfo"):
        from elftools.common.exceptions import ELFError
        from elftools.elf.elffile import ELFFile

    try:
        with open(path, "rb") as fh:
            elf = ELFFile(fh)
            section = elf.get_section_by_name(".rodata")
            data = section.data() if section is not None else b""
    except (OSError, ELFError):
        return []
    infos, strings = [], []
    for raw in data.split(b"\0"):
        if raw.startswith(PREFIX):
            try:
                infos.append(json.loads(raw[len(PREFIX):]))
            except ValueError:
                continue  # a string that merely starts like one
        elif raw:
            strings.append(raw)
    # Every other string in .rodata: the kvargs key names live there, which tells where
    # one parameter ends and the next begins when a driver glued them together.
    known = b"\0" + b"\0".join(strings) + b"\0"
    drivers = []
    for info in infos:
        if not isinstance(info, dict) or not isinstance(info.get("name"), str):
            continue
        params = info.get("params") or ""
        name = info["name"]
        drivers.append(Driver(
            name=name, kind=_kind(path), library=os.path.basename(path), params=params.strip(),
            param_list=split_params(params, known), pci_ids=len(info.get("pci_ids") or []),
            kmod=str(info.get("kmod") or ""), no_nic=name in NO_NIC_DRIVERS,
            no_nic_use=NO_NIC_DRIVERS.get(name, ""),
        ))
    return drivers


# -- parameter strings -------------------------------------------------------------------
_KEY = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*")


def _split_outside_brackets(text: str, seps: str) -> list[str]:
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "<[(":
            depth += 1
        elif ch in ">])":
            depth = max(0, depth - 1)
        if ch in seps and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return [p for p in out if p]


def _value_then_key(seg: str, known: bytes) -> tuple[str, str]:
    """'server|clientbsize' -> ('server|client', 'bsize'): the longest suffix that is a key
    name found in the library's strings (a suffix of one counts: the linker merges string
    tails), else what follows a closing bracket; ('', seg) when nothing tells."""
    for start in range(1, len(seg)):
        key = seg[start:]
        # the first start that matches gives the longest key
        if _KEY.fullmatch(key) and key.encode() + b"\0" in known:
            return seg[:start], key
    m = re.search(r"[>\])]([A-Za-z][A-Za-z0-9_.-]*)$", seg)
    if m:
        return seg[: m.start(1)], m.group(1)
    return "", seg


def split_params(params: str, known: bytes = b"") -> list[str]:
    """A driver's params string -> ['key=value', ...]. Drivers separate items with spaces,
    commas or nothing at all ('id=<int>role=server|client'); this undoes all three."""
    items: list[str] = []
    for chunk in _split_outside_brackets(params.strip(), " ,"):
        parts = chunk.split("=")
        if len(parts) <= 2:
            items.append(chunk)
            continue
        key = parts[0]
        for seg in parts[1:-1]:
            value, next_key = _value_then_key(seg, known)
            if not value:  # cannot tell where the value ends: keep the text as it is
                items.append(f"{key}={seg}")
                key = ""
                continue
            items.append(f"{key}={value}" if key else value)
            key = next_key
        items.append(f"{key}={parts[-1]}" if key else parts[-1])
    return items


# -- the command -------------------------------------------------------------------------
def scan(dirs: list[str]) -> list[Driver]:
    drivers: list[Driver] = []
    for folder in dirs:
        paths = [folder] if os.path.isfile(folder) else library_files(folder)
        for path in paths:
            drivers += read_library(path)
    return sorted(drivers, key=lambda d: (d.kind, d.name))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ra-pmdinfo",
        description="List the DPDK poll-mode drivers installed on this host, with their "
                    "parameters, read from the drivers' ELF metadata (no EAL, no root). "
                    "Drivers marked '*' work with remote_accel without any NIC.",
    )
    p.add_argument("--dir", action="append", metavar="PATH",
                   help="driver folder (or one driver .so) to read instead of the installed one; "
                        "repeat for several (default: pkg-config's pmdsdir, else <libdir>/dpdk/pmds-*)")
    p.add_argument("--kind", metavar="KIND",
                   help="only drivers of this kind: net, crypto, compress, baseband, event, dma, "
                        "raw, regex, vdpa, bus, common, mempool (default: all)")
    p.add_argument("--no-nic", action="store_true",
                   help="only the drivers remote_accel can use without a NIC "
                        f"({', '.join(sorted(NO_NIC_DRIVERS))})")
    p.add_argument("--json", action="store_true",
                   help="one JSON document on stdout: {dirs, drivers: [{name, kind, library, params, "
                        "param_list, pci_ids, kmod, no_nic, no_nic_use}]}")
    return p


def _format_table(drivers: list[Driver], dirs: list[str]) -> str:
    width = max([len(d.name) for d in drivers] + [4])
    kind_w = max([len(d.kind) for d in drivers] + [4])
    lines = [f"  {'NAME':<{width}}  {'KIND':<{kind_w}}  {'PCI-IDS':>7}  PARAMETERS"]
    for d in drivers:
        mark = "*" if d.no_nic else " "
        params = " ".join(d.param_list) or "-"
        lines.append(f"{mark} {d.name:<{width}}  {d.kind:<{kind_w}}  {d.pci_ids:>7}  {params}")
    usable = [d for d in drivers if d.no_nic]
    lines.append("")
    lines.append(f"{len(drivers)} drivers in {', '.join(dirs)}")
    if usable:
        lines.append("* usable by remote_accel without a NIC:")
        lines += [f"    {d.name:<{width}}  {d.no_nic_use}" for d in usable]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.dir:
            dirs = args.dir
            missing = [d for d in dirs if not os.path.exists(d)]
            if missing:
                raise NoDrivers(f"{', '.join(missing)}: no such file or directory")
        else:
            dirs, looked = default_dirs()
            if not dirs:
                raise NoDrivers(f"DPDK is not installed: no driver folder in {', '.join(looked)}")
        drivers = scan(dirs)
        if not drivers:
            raise NoDrivers(f"no DPDK driver (no PMD_INFO_STRING metadata) in {', '.join(dirs)}")
    except NoDrivers as exc:
        print(f"ra-pmdinfo: {exc}; {_INSTALL_HINT}", file=sys.stderr)
        return 1
    if args.kind:
        drivers = [d for d in drivers if d.kind == args.kind]
    if args.no_nic:
        drivers = [d for d in drivers if d.no_nic]
    try:
        if args.json:
            json.dump({"dirs": dirs, "drivers": [asdict(d) for d in drivers]}, sys.stdout, indent=1)
            sys.stdout.write("\n")
        else:
            sys.stdout.write(_format_table(drivers, dirs))
        sys.stdout.flush()
    except BrokenPipeError:
        # `ra-pmdinfo | head`: the reader is gone; silence the interpreter's flush at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
