"""The DPDK shim's layers, read from its object files: dpdk_shim/wire -> link -> chan ->
wait -> api, each folder a layer. Every call from one C file to another goes to a file of
the same layer or of one below, the files of one layer call each other in no circle, and
only api/ defines shim_* (the functions of shim.h, which cffi sees). Includes run the
same way, and a name that one file alone uses lives in that file, not in its layer's
header, where it would tie files together that do not call each other.

Each .c is compiled here (cc -c with libdpdk's pkg-config flags, as the package builds it)
and nm lists what it defines and what it leaves undefined: a call counts wherever it is,
behind a macro or an inline function of a header too, and one moved into another file
cannot hide from this test.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from graph_cycles import cycles

CHECKOUT = Path(__file__).resolve().parents[2]
SHIM = CHECKOUT / "src" / "dpdk_shim"
#: bottom to top: a file may call files of its own layer and of those before it
LAYERS = ("wire", "link", "chan", "wait", "api")
CC = os.environ.get("CC", "cc")
#: as meson builds the shim (meson.build: c_std, dpdk_shim/meson.build: its c_args)
FLAGS = ["-std=gnu11", "-O0", "-g0", "-DSHIM_VERSION=\"test\"", "-Wno-unused-parameter"]


def layer(source: str) -> str:
    """The layer of a file named relative to the shim's folder ("chan/conn.c" -> "chan")."""
    return source.split("/")[0]


def sources(root: Path = SHIM) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.c"))


def _compile(root: Path, names: list[str], flags: list[str], out: Path) -> dict[str, Path]:
    """Each file to an object file; a compiler error fails the test with its message."""

    def one(name: str) -> Path:
        obj = out / (name.replace("/", "__") + ".o")
        run = subprocess.run([CC, *flags, f"-I{root}", "-c", "-o", str(obj), str(root / name)],
                             capture_output=True, text=True)
        assert run.returncode == 0, f"{name} does not compile:\n{run.stderr}"
        return obj

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return dict(zip(names, pool.map(one, names)))


def _symbols(objects: dict[str, Path]) -> tuple[dict[str, str], dict[str, set[str]]]:
    """(global symbol -> the file defining it, file -> the symbols it uses undefined)."""
    defined, undefined, twice = {}, {}, []
    for name, obj in objects.items():
        undefined[name] = set()
        out = subprocess.run(["nm", "-P", str(obj)], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            symbol, kind = line.split()[:2]
            if kind == "U":
                undefined[name].add(symbol)
            elif kind.isupper():  # lower case: static, local to the file
                if symbol in defined:
                    twice.append(f"{symbol}: {defined[symbol]} and {name}")
                defined[symbol] = name
    assert not twice, f"global symbols defined twice: {twice}"
    return defined, undefined


def calls(defined: dict[str, str], undefined: dict[str, set[str]]) -> list[tuple[str, str, str]]:
    """(file, the file it calls or whose variable it uses, the symbol) across files of the shim."""
    return sorted((name, defined[symbol], symbol) for name, used in undefined.items()
                  for symbol in used if symbol in defined and defined[symbol] != name)


def upward(found: list[tuple[str, str, str]]) -> list[str]:
    return [f"{src} ({layer(src)}) uses {symbol} of {dst} ({layer(dst)})" for src, dst, symbol in found
            if LAYERS.index(layer(dst)) > LAYERS.index(layer(src))]


def circles(found: list[tuple[str, str, str]], name: str) -> list[list[str]]:
    graph: dict[str, set[str]] = {}
    for src, dst, _ in found:
        if layer(src) == layer(dst) == name:
            graph.setdefault(src, set()).add(dst)
    return cycles(graph)


#: headers whose defines are wire facts, read by the scapy layer and the tests too (one
#: header owns each wire fact), wherever the shim uses them
WIRE_FACTS = ("wire/wire.h",)


def lone_defines(root: Path = SHIM) -> list[str]:
    """Object-like #defines of a layer's header (its include guard aside) that one C file
    of the shim uses and no other header: they belong in that file. Macros leave no trace
    in object files, so the call checks cannot see two files tied by a header's constants
    (chan.c's retransmission timer ran on conn.c's RTO constants, all in chan.h)."""
    texts = {str(p.relative_to(root)): p.read_text() for p in root.rglob("*.[ch]")}
    found = []
    for header, text in sorted(texts.items()):
        if "/" not in header or not header.endswith(".h") or header in WIRE_FACTS:
            continue
        guard = re.search(r"^\s*#\s*ifndef\s+(\w+)", text, re.M)
        for name in re.findall(r"^\s*#\s*define\s+([A-Z][A-Z0-9_]*)(?=[ \t]|$)", text, re.M):
            if guard and name == guard.group(1):
                continue
            users = [f for f, t in texts.items() if f != header and re.search(rf"\b{name}\b", t)]
            if len(users) == 1 and users[0].endswith(".c"):
                found.append(f"{name} ({header}): only {users[0]} uses it")
    return found


def misplaced_api(defined: dict[str, str]) -> list[str]:
    return sorted(f"{symbol} ({name})" for symbol, name in defined.items()
                  if symbol.startswith("shim_") and layer(name) != "api")


def _missing_tools() -> str | None:
    for tool in (CC, "nm", "pkg-config"):
        if shutil.which(tool) is None:
            return f"DPDK transport unavailable: no {tool} to build the shim's object files"
    if subprocess.run(["pkg-config", "--exists", "libdpdk"]).returncode != 0:
        return "DPDK transport unavailable: pkg-config knows no libdpdk (apt-get install libdpdk-dev)"
    return None


@pytest.fixture(scope="module")
def _built(tmp_path_factory):
    """The shim's symbols, or why they cannot be had here."""
    missing = _missing_tools()
    if missing:
        return missing
    dpdk = subprocess.run(["pkg-config", "--cflags", "libdpdk"], capture_output=True, text=True,
                          check=True).stdout.split()
    objects = _compile(SHIM, sources(), FLAGS + dpdk, tmp_path_factory.mktemp("shim"))
    return _symbols(objects)


@pytest.fixture
def shim(_built, require_in_ci):
    if isinstance(_built, str):
        require_in_ci(_built)
    return _built


# -- the layout ------------------------------------------------------------------------
def test_every_c_file_is_in_a_layer_with_one_header():
    names = sources()
    assert names and all(name.count("/") == 1 and layer(name) in LAYERS for name in names), names
    assert sorted({layer(name) for name in names}) == sorted(LAYERS)
    for name in LAYERS:
        assert sorted(p.name for p in (SHIM / name).glob("*.h")) == [f"{name}.h"], name
    assert sorted(p.name for p in SHIM.glob("*.h")) == ["shim.h"]  # the API: the only header cffi sees


def test_meson_builds_the_files_checked_here():
    text = re.sub(r"#.*", "", (SHIM / "meson.build").read_text())
    assert sorted(re.findall(r"'(\w+/\w+\.c)'", text)) == sources()


def test_includes_go_down_too():
    """A file includes its own layer's header or one below (each layer's header includes the
    one below it); shim.h, declarations only, lies under every layer."""
    wrong = []
    for path in sorted(SHIM.rglob("*.[ch]")):
        here = str(path.relative_to(SHIM))
        if "/" not in here:
            continue
        for target in re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), re.M):
            if target == "shim.h":
                continue
            if not (target.endswith(".h") and layer(target) in LAYERS and (SHIM / target).is_file()):
                wrong.append(f"{here} includes {target}: not a layer's header")
            elif LAYERS.index(layer(target)) > LAYERS.index(layer(here)):
                wrong.append(f"{here} ({layer(here)}) includes {target}")
    assert not wrong, "includes against the layer order:\n" + "\n".join(wrong)


# -- the calls -------------------------------------------------------------------------
def test_calls_go_down_or_across(shim):
    defined, undefined = shim
    found = calls(defined, undefined)
    assert len(found) > 50  # the shim's files do call each other: the reading works
    wrong = upward(found)
    assert not wrong, "calls against the layer order:\n" + "\n".join(wrong)


@pytest.mark.parametrize("name", LAYERS)
def test_no_circle_inside_a_layer(shim, name):
    found = circles(calls(*shim), name)
    assert not found, f"files of {name}/ that call each other, directly or in a circle: {found}"


def test_a_name_one_file_uses_lives_in_that_file():
    assert lone_defines() == [], "defines of a layer's header that belong in the one file using them"


def test_only_the_api_defines_shim_names(shim):
    defined, _ = shim
    assert misplaced_api(defined) == [], "shim_* outside api/ (internal names take no prefix)"
    header = re.sub(r"/\*.*?\*/", "", (SHIM / "shim.h").read_text(), flags=re.S)
    declared = set(re.findall(r"\b(shim_\w+)\s*\(", header))
    assert declared == {s for s in defined if s.startswith("shim_")}, "shim.h and the api/ differ"


def _server_files() -> list[str]:
    """The shim's files that the server's C++ module links (ra_wire, built once by
    dpdk_shim/meson.build); the server compiles none of the shim's files itself."""
    wire = re.search(r"wire_sources = files\(([^)]*)\)", (SHIM / "meson.build").read_text())
    names = re.findall(r"'(\w+/\w+\.c)'", wire.group(1)) if wire else []
    assert names and set(names) <= set(sources()), names
    server = (CHECKOUT / "src" / "remote_accel" / "server" / "meson.build").read_text()
    assert re.search(r"link_with: \[?ra_wire\b", server) and "dpdk_shim/" not in re.sub(r"#.*", "", server)
    return names


def test_the_server_files_build_without_dpdk(tmp_path, require_in_ci):
    """The server's C++ module has no DPDK: the wire's codec and its shim_* names build
    without DPDK's flags."""
    if shutil.which(CC) is None or shutil.which("nm") is None:
        require_in_ci(f"needs {CC} and nm to build dpdk_shim sources")
    objects = _compile(SHIM, _server_files(), ["-std=gnu11", "-Wall", "-Wextra", "-Werror"], tmp_path)
    defined, _ = _symbols(objects)
    assert {"shim_crc32c", "shim_wire_encode", "shim_wire_check"} <= set(defined)


def test_the_server_files_need_no_other_file_of_the_shim(shim):
    defined, undefined = shim
    names = set(_server_files())
    wanted = {(src, dst, symbol) for src, dst, symbol in calls(defined, undefined) if src in names}
    assert {(src, dst, symbol) for src, dst, symbol in wanted if dst not in names} == set()


# -- the checker itself ----------------------------------------------------------------
def test_the_checker_finds_upward_calls_circles_and_shim_names(tmp_path, require_in_ci):
    if shutil.which(CC) is None or shutil.which("nm") is None:
        require_in_ci(f"needs {CC} and nm to build dpdk_shim sources")
    tree = {
        "wire/a.c": "int up(void); int a(void) { return up(); }",
        "link/b.c": "int up(void) { return 1; } int shim_hidden(void) { return 2; }",
        "chan/c.c": "int d(void); int c(void) { return d(); }",
        "chan/d.c": "int c(void); int d(void) { return c(); }",
        "api/e.c": "int a(void); int c(void); int shim_ok(void) { return a() + c(); }",
        "chan/chan.h": "#ifndef CHAN_H\n#define CHAN_H\n#define SHARED 1\n#define ONE_USER 2\n#endif",
        "chan/f.c": '#include "chan/chan.h"\nint f(void) { return SHARED + ONE_USER; }',
        "chan/g.c": '#include "chan/chan.h"\nint g(void) { return SHARED; }',
    }
    for name, text in tree.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text + "\n")
    objects = _compile(tmp_path, sources(tmp_path), ["-std=gnu11"], tmp_path)
    defined, undefined = _symbols(objects)
    found = calls(defined, undefined)
    assert upward(found) == ["wire/a.c (wire) uses up of link/b.c (link)"]
    assert circles(found, "chan") == [["chan/c.c", "chan/d.c"]]
    assert circles(found, "api") == []
    assert misplaced_api(defined) == ["shim_hidden (link/b.c)"]
    assert lone_defines(tmp_path) == ["ONE_USER (chan/chan.h): only chan/f.c uses it"]
