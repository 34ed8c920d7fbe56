"""ra-pmdinfo against the DPDK drivers really installed on this host."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from remote_accel.tools import pmdinfo

installed_dirs, _ = pmdinfo.default_dirs()
needs_dpdk = pytest.mark.skipif(not installed_dirs, reason="DPDK drivers are not installed")


def run(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "remote_accel.tools.pmdinfo", *args],
                          capture_output=True, text=True, timeout=timeout)


@needs_dpdk
def test_json_lists_memif_with_its_parameters():
    out = run("--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    drivers = {d["name"]: d for d in doc["drivers"]}
    memif = drivers["net_memif"]
    assert memif["kind"] == "net"
    assert memif["no_nic"] is True
    assert memif["pci_ids"] == 0
    keys = [item.split("=", 1)[0] for item in memif["param_list"]]
    for key in ("id", "role", "bsize", "rsize", "socket", "socket-abstract", "zero-copy", "secret"):
        assert key in keys
    assert "role=server|client" in memif["param_list"]
    assert "socket-abstract=yes|no" in memif["param_list"]
    assert "bsize=<int>" in memif["param_list"]
    assert "socket=<string>" in memif["params"]
    # the other drivers we run on without a NIC are found and marked
    for name in ("net_ring", "net_null", "net_af_packet", "net_tap"):
        assert drivers[name]["no_nic"], name
    # a PCI NIC driver has ids and is not marked
    nics = [d for d in doc["drivers"] if d["kind"] == "net" and d["pci_ids"] > 0]
    assert nics and not any(d["no_nic"] for d in nics)
    assert {d["kind"] for d in doc["drivers"]} >= {"net", "crypto"}


@needs_dpdk
def test_table_marks_no_nic_drivers():
    out = run()
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    memif = next(line for line in lines if line.split()[:2] == ["*", "net_memif"])
    assert "role=server|client" in memif and "bsize=<int>" in memif
    assert any(line.split()[:2] == ["*", "net_ring"] for line in lines)
    assert any(line.startswith("  net_ixgbe ") for line in lines)  # listed, unmarked
    assert "usable by remote_accel without a NIC" in out.stdout


@needs_dpdk
def test_filters_and_dir_override():
    out = run("--json", "--no-nic", "--dir", installed_dirs[0])
    assert out.returncode == 0, out.stderr
    names = {d["name"] for d in json.loads(out.stdout)["drivers"]}
    assert names == set(pmdinfo.NO_NIC_DRIVERS)
    out = run("--json", "--kind", "crypto")
    kinds = {d["kind"] for d in json.loads(out.stdout)["drivers"]}
    assert kinds == {"crypto"}


def test_dir_without_dpdk_gives_clear_message(tmp_path):
    (tmp_path / "librte_net_fake.so").write_bytes(b"not an ELF file")
    out = run("--dir", str(tmp_path))
    assert out.returncode == 1
    assert out.stdout == ""
    assert "no DPDK driver" in out.stderr and str(tmp_path) in out.stderr
    assert "apt-get install dpdk" in out.stderr
    out = run("--dir", str(tmp_path / "missing"))
    assert out.returncode == 1 and "no such file or directory" in out.stderr


def test_dpdk_not_installed(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(pmdinfo, "_pkg_config", lambda variable: "")
    monkeypatch.setattr(pmdinfo, "_LIB_DIRS", (str(tmp_path),))
    assert pmdinfo.main([]) == 1
    err = capsys.readouterr().err
    assert "DPDK is not installed" in err and "apt-get install dpdk" in err


@pytest.mark.parametrize("params, known, expected", [
    ("iface=<string> qpairs=<int>", b"", ["iface=<string>", "qpairs=<int>"]),
    ("max_nb_queue_pairs=<int>socket_id=<int>", b"", ["max_nb_queue_pairs=<int>", "socket_id=<int>"]),
    ("role=server|clientbsize=<int>", b"\0bsize\0role\0", ["role=server|client", "bsize=<int>"]),
    # the linker keeps "secret" only as the tail of another string
    ("zero-copy=yes|nosecret=<string>", b"\0zero-copy\0mysecret\0", ["zero-copy=yes|no", "secret=<string>"]),
    ("mode=[0-6] xmit_policy=[l2 | l23]", b"", ["mode=[0-6]", "xmit_policy=[l2 | l23]"]),
    ("nodeaction=name:node:action(ATTACH|CREATE)", b"", ["nodeaction=name:node:action(ATTACH|CREATE)"]),
    ("", b"", []),
])
def test_split_params(params, known, expected):
    assert pmdinfo.split_params(params, known) == expected


def test_help_documents_every_option():
    out = run("--help")
    assert out.returncode == 0
    for option in ("--dir", "--kind", "--no-nic", "--json"):
        assert option in out.stdout


@needs_dpdk
def test_broken_pipe_is_quiet():
    # the reader goes away before the tool writes (it needs a while to start): EPIPE
    proc = subprocess.Popen([sys.executable, "-m", "remote_accel.tools.pmdinfo"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0
    assert "Traceback" not in err and "BrokenPipe" not in err, err
