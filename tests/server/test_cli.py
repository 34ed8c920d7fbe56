"""The command line and the token file."""

from __future__ import annotations

import argparse
import os
import select
import stat
import subprocess
import sys

import pytest

from remote_accel.errors import ConfigError
from remote_accel.server import auth
from remote_accel.server.__main__ import build_parser, parse_listen, parse_size, parse_transports, split_eal

pytestmark = pytest.mark.any_torch


def test_sizes():
    assert parse_size("1048576") == 1 << 20
    assert parse_size("8G") == 8 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("2k") == 2048
    for bad in ("", "1.5G", "-1", "8X", "G"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)


def test_listen_addresses():
    assert parse_listen("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_listen("0.0.0.0:9000") == ("0.0.0.0", 9000)
    assert parse_listen("[::1]:0") == ("::1", 0)
    assert parse_listen("localhost") == ("localhost", 18515)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_listen("host:port")


def test_transports_and_eal_split():
    assert parse_transports("tcp,dpdk") == ("tcp", "dpdk")
    assert parse_transports("dpdk") == ("dpdk",)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_transports("udp")
    assert split_eal(["-l", "0", "--no-pci", "--", "--port", "1"]) == (["-l", "0", "--no-pci"], ["--port", "1"])
    assert split_eal(["--device", "cpu"]) == ([], ["--device", "cpu"])


def test_defaults_and_ranges():
    args = build_parser().parse_args([])
    assert (args.transport, args.listen, args.device, args.memory_limit) == (("tcp",), ("127.0.0.1", 18515), "auto", 0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--max-clients", "0"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--port", "5000"])


def run_cli(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "remote_accel.server", *argv], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, **(env or {})))


def test_help_lists_options_with_ranges():
    out = run_cli("--help")
    assert out.returncode == 0
    for text in ("--transport", "--listen", "--port", "--device", "--token-file", "--memory-limit", "--max-clients",
                 "--log-level", "0..1023", "1..4096", "[EAL options] -- [options]"):
        assert text in out.stdout


def test_startup_errors_are_clear(tmp_path):
    out = run_cli("--", "--device", "tpu", "--token-file", str(tmp_path / "t"))
    assert out.returncode == 2 and "unknown device 'tpu'" in out.stderr
    out = run_cli("--device", "cuda:7", "--token-file", str(tmp_path / "t"))
    assert out.returncode == 2 and "cuda" in out.stderr
    out = run_cli("--device", "cpu", "--listen", "203.0.113.1:1", "--insecure", "--token-file", str(tmp_path / "t"))
    assert out.returncode == 2 and "cannot listen" in out.stderr


def test_dpdk_without_the_transport_says_so(tmp_path):
    try:
        from remote_accel.dataplane import dpdk  # noqa: F401
    except ImportError:
        out = run_cli("--device", "cpu", "--transport", "dpdk", "--token-file", str(tmp_path / "t"))
        assert out.returncode == 2 and "use --transport tcp" in out.stderr
    else:
        pytest.skip("the DPDK transport is built: tests/server/test_dpdk.py covers it")


def test_token_file_is_created_private_and_reused(tmp_path):
    path = tmp_path / "sub" / "token"
    token = auth.load_or_create(str(path))
    assert len(token) == 2 * auth.TOKEN_BYTES
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert auth.load_or_create(str(path)) == token


def test_token_file_readable_by_others_is_refused(tmp_path):
    path = tmp_path / "token"
    path.write_text("secret\n")
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        auth.load_or_create(str(path))
    path.chmod(0o600)
    assert auth.load_or_create(str(path)) == "secret"


def test_default_token_file_lives_in_the_runtime_dir(tmp_path):
    from remote_accel.server.testing import Client

    runtime = tmp_path / "rt"
    env = dict(os.environ, REMOTE_ACCEL_RUNTIME_DIR=str(runtime))
    proc = subprocess.Popen([sys.executable, "-m", "remote_accel.server", "--device", "cpu", "--listen", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert select.select([proc.stdout], [], [], 120)[0], "the server printed nothing"
        line = proc.stdout.readline()
        assert line.startswith("listening on tcp:127.0.0.1:")
        port = int(line.rsplit(":", 1)[1])
        token = (runtime / "token").read_text().strip()
        with Client.tcp("127.0.0.1", port, token=token) as c:  # what a local client does
            assert c.ping() == 7
    finally:
        proc.terminate()
        assert proc.wait(20) == 0
        proc.stdout.close()
