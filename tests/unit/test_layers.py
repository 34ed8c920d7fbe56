"""The layers of the checkout, read from its source: imports run one way between layers
(tools -> pytorch_ext/server -> torch_wire -> dataplane, all over the base modules errors,
config, _version; pytorch_ext also over frameworks, which knows the device through torch
alone) and never in a circle inside one. Below dataplane lies the DPDK shim, C
with a cffi module (src/dpdk_shim; tests/unit/test_c_layers.py checks its own layers).

Every import counts, at any depth of the file: one inside a function or under
`if TYPE_CHECKING:` still ties two modules together for a reader, so an import moved
into a function cannot hide a circle from this test.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from graph_cycles import cycles

CHECKOUT = Path(__file__).resolve().parents[2]
#: the import tree: src/remote_accel/X/Y.py is the module remote_accel.X.Y
SRC = CHECKOUT / "src"
#: the subpackages that are layers; the package's own modules are the base
LAYERS = {"dataplane", "torch_wire", "server", "pytorch_ext", "tools", "frameworks"}
#: what each layer may import besides itself; pytorch_ext and server stand side by side
#: (a client and a server share only what lies below them)
MAY_IMPORT = {
    "base": set(),
    "dataplane": {"base"},
    "torch_wire": {"base", "dataplane"},
    "server": {"base", "dataplane", "torch_wire"},
    "pytorch_ext": {"base", "dataplane", "torch_wire", "frameworks"},
    "tools": {"base", "dataplane", "torch_wire", "server", "pytorch_ext", "frameworks"},
    # the training frameworks' adaptations: init() installs their hook; they reach the
    # device through torch's own API (torch.accelerator, torch.remote_accel) alone
    "frameworks": {"base"},
}
#: `import remote_accel` sits above every layer but tools (it hands out init() of pytorch_ext),
#: and so does `remote_accel.parallel` (it names pytorch_ext's DataParallel and pipeline)
ENTRY_POINTS = {"remote_accel", "remote_accel.parallel"}
#: the one import that goes up, and why: the hook (a base module, so that the server can
#: switch it off) registers the device once torch has loaded, in a function it runs then
UPWARD = {("remote_accel._torch_hook", "remote_accel.pytorch_ext._register")}
#: layers that must run without torch (the data plane serves tools and benchmarks too);
#: buffers.py may make a tensor over pinned memory, inside the function that does it
TORCH_FREE = {"base", "dataplane"}
TORCH_ALLOWED_INSIDE_FUNCTIONS = {"remote_accel.dataplane.buffers", "remote_accel.errors"}


def module_name(path: Path) -> str:
    """A file's module, named by its path alone (the tree is the import tree)."""
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted((SRC / "remote_accel").rglob("*.py"))}


MODULES = _modules()


#: modules of the package's top that tie the layers to another system, as tools do: the
#: Ray pool starts servers inside Ray actors and hands their addresses to init()
INTEGRATIONS = {"remote_accel.ray": "tools"}


def layer(module: str) -> str:
    if module in INTEGRATIONS:
        return INTEGRATIONS[module]
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "base"


def _imports(module: str, path: Path) -> list[tuple[str, ast.AST]]:
    """(imported module, the import statement) for every import of the file, where the
    imported module is one of ours; `from pkg import name` names pkg.name when that is a module."""
    package = module if path.stem == "__init__" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names]
        else:
            continue
        for target in targets:
            # modules that are no .py file of the checkout (the compiled _dpdk and _C, the
            # generated _build_info) import nothing of ours
            if target in MODULES and target != module:
                found.append((target, node))
    return found


def _graph() -> dict[str, set[str]]:
    return {m: {t for t, _ in _imports(m, p)} for m, p in MODULES.items()}


def test_the_checkout_has_the_layers_it_names():
    assert set(MAY_IMPORT) == {layer(m) for m in MODULES} | {"base"}
    for name in ("remote_accel.dataplane.wire", "remote_accel.torch_wire.values", "remote_accel.server.session",
                 "remote_accel.pytorch_ext.runtime", "remote_accel.tools.capture", "remote_accel.errors"):
        assert name in MODULES, name


@pytest.mark.parametrize("name", sorted(set(MAY_IMPORT)))
def test_no_import_circle_inside_a_layer(name):
    graph = _graph()
    inside = {m: {t for t in deps if layer(t) == name and t not in ENTRY_POINTS}
              for m, deps in graph.items() if layer(m) == name and m not in ENTRY_POINTS}
    circles = cycles(inside)
    assert not circles, f"modules that import each other, directly or in a circle: {circles}"


def test_layers_import_one_way():
    wrong = []
    for module, path in MODULES.items():
        if module in ENTRY_POINTS:
            continue
        here = layer(module)
        for target, node in _imports(module, path):
            there = layer(target)
            if (module, target) in UPWARD:
                continue
            if there != here and (there not in MAY_IMPORT[here] or (target in ENTRY_POINTS and here != "tools")):
                wrong.append(f"{path.relative_to(CHECKOUT)}:{node.lineno} ({here}) imports {target} ({there})")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_the_lower_layers_do_without_torch():
    wrong = []
    for module, path in MODULES.items():
        if layer(module) not in TORCH_FREE:
            continue
        tree = ast.parse(path.read_text(), str(path))
        top_level = set(map(id, tree.body))
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if not any(n == "torch" or n.startswith("torch.") for n in names):
                continue
            if module in TORCH_ALLOWED_INSIDE_FUNCTIONS and id(node) not in top_level:
                continue
            wrong.append(f"{path.relative_to(CHECKOUT)}:{node.lineno}")
    assert not wrong, f"torch imported below torch_wire: {wrong}"


def test_the_circle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"]]
