"""The installed package holds every Python module of the checkout: meson lists the
sources by hand, and a module left out of its meson.build works in the checkout but
fails at import once installed."""

from __future__ import annotations

from pathlib import Path

import pytest

import remote_accel

CHECKOUT = Path(__file__).resolve().parents[2]
INSTALLED = Path(remote_accel.__file__).resolve().parent
#: source folder -> where its modules install inside the package
FOLDERS = {"package": ".", "dataplane": "dataplane", "server": "server", "pytorch_ext": "pytorch_ext",
           "tools": "tools", "torch_wire": "torch_wire"}


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_every_module_of_the_checkout_is_installed(folder):
    sources = {p.name for p in (CHECKOUT / folder).glob("*.py")}
    assert sources, f"no modules found in {CHECKOUT / folder}"
    installed = {p.name for p in (INSTALLED / FOLDERS[folder]).glob("*.py")}
    missing = sorted(sources - installed)
    assert not missing, f"{folder}/meson.build does not install {missing}"
