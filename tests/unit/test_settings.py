"""One home for settings: every REMOTE_ACCEL_* environment variable the source reads is
in config.SETTINGS (with its default), is read through config.setting() (C++ reads its two
cache budgets itself), and is in the README's configuration table."""

from __future__ import annotations

import re
from pathlib import Path

from remote_accel import config

CHECKOUT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bREMOTE_ACCEL_[A-Z0-9_]+\b")
#: names that are no settings: header guards, C macros, and what only tests and
#: quickstart.sh read (README "Development" documents those)
NOT_SETTINGS = re.compile(r"REMOTE_ACCEL_(\w+_H|VERSION|DEVICE_ALLOCATOR|TEST_DEVICE|CI|FUZZ_\w+)\Z")
#: the only places that read the environment for a setting themselves
OWN_READERS = {"src/remote_accel/config.py", "src/remote_accel/dataplane/host_pages.h"}


def test_autoload_names_the_server_variables_of_the_settings():
    """remote_accel_autoload.py reads them without importing the package."""
    import remote_accel_autoload

    assert set(remote_accel_autoload.SERVER_VARIABLES) == {config.ENV_SERVER, config.ENV_TRANSPORT}


def _sources():
    for path in sorted((CHECKOUT / "src").rglob("*")):
        if path.suffix in (".py", ".c", ".h", ".cpp"):
            yield path.relative_to(CHECKOUT).as_posix(), path.read_text()


def test_every_variable_the_source_names_is_a_setting():
    named = {(name, where) for where, text in _sources() for name in NAME.findall(text)
             if not NOT_SETTINGS.match(name)}
    unknown = sorted(f"{name} ({where})" for name, where in named if name not in config.SETTINGS)
    assert not unknown, f"add these to config.SETTINGS: {unknown}"


def test_settings_are_read_in_one_place():
    direct = re.compile(r"(os\.environ\.get|os\.getenv|getenv)\(\s*['\"](REMOTE_ACCEL_\w+)")
    through_constant = re.compile(r"os\.environ(\.get\(|\[)\s*(config\.)?ENV_")
    wrong = [where for where, text in _sources() if where not in OWN_READERS and (
        any(not NOT_SETTINGS.match(m.group(2)) for m in direct.finditer(text)) or through_constant.search(text))]
    assert not wrong, f"read settings with config.setting(): {wrong}"


def test_the_readme_lists_every_setting():
    readme = (CHECKOUT / "README.md").read_text()
    missing = sorted(name for name in config.SETTINGS if name not in readme)
    assert not missing, f"README.md's configuration table lacks {missing}"


def test_defaults_and_switches(monkeypatch):
    monkeypatch.delenv("REMOTE_ACCEL_MEMIF_BSIZE", raising=False)
    assert config.setting("REMOTE_ACCEL_MEMIF_BSIZE") == "16384"
    monkeypatch.setenv("REMOTE_ACCEL_COMPILE_GRAPHS", "0")
    assert not config.enabled("REMOTE_ACCEL_COMPILE_GRAPHS")
    monkeypatch.setenv("REMOTE_ACCEL_COMPILE_GRAPHS", "yes")
    assert config.enabled("REMOTE_ACCEL_COMPILE_GRAPHS")
    monkeypatch.setenv("REMOTE_ACCEL_TRANSPORT", "TCP")
    assert config.transport(None) == "tcp" and config.transport("dpdk") == "dpdk"
    monkeypatch.setenv("REMOTE_ACCEL_EAL_ARGS", "--no-pci --vdev 'net_ring0'")
    assert config.eal_args(None) == ["--no-pci", "--vdev", "net_ring0"]
    assert config.eal_args(["-a"]) == ["-a"]
