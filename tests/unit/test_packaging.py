"""The installed package holds every Python module of the checkout: meson lists the
sources by hand, and a module left out of its meson.build works in the checkout but
fails at import once installed. The checkout's src/ is the import tree, so each source
folder installs at the same path inside the package."""

from __future__ import annotations

from pathlib import Path

import pytest

import remote_accel

CHECKOUT = Path(__file__).resolve().parents[2]
PACKAGE = CHECKOUT / "src" / "remote_accel"
INSTALLED = Path(remote_accel.__file__).resolve().parent
FOLDERS = sorted(str(p.parent.relative_to(PACKAGE)) for p in PACKAGE.rglob("__init__.py"))


def test_the_source_folders_are_the_packages():
    assert {".", "dataplane", "server", "pytorch_ext", "tools", "torch_wire"} <= set(FOLDERS)


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_module_of_the_checkout_is_installed(folder):
    sources = {p.name for p in (PACKAGE / folder).glob("*.py")}
    installed = {p.name for p in (INSTALLED / folder).glob("*.py")}
    missing = sorted(sources - installed)
    assert not missing, f"src/remote_accel/{folder}/meson.build does not install {missing}"
