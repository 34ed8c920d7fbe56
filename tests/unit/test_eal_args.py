"""EAL command lines: defaults per role, the user's options winning, memif slots."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from remote_accel.dataplane import eal_args as ea
from remote_accel.dataplane import memif_slots
from remote_accel.errors import ConfigError


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    monkeypatch.setenv("REMOTE_ACCEL_RUNTIME_DIR", str(tmp_path))
    return tmp_path


def test_client_defaults(runtime):
    args = ea.default_eal_args("client", hugepages=False)
    assert "--no-pci" in args and "--no-huge" in args and "--in-memory" not in args
    assert "--lcores=0@(0,1)" in args
    assert any(a.startswith("--file-prefix=ra") for a in args)
    vdevs = ea.vdev_options(args)
    (name, opts), = vdevs.items()
    assert name == "net_memif0" and opts["role"] == "client" and opts["id"] == "0"
    assert opts["socket"] == str(runtime / "memif.sock") and int(opts["bsize"]) == ea.MEMIF_BSIZE


def test_memif_ring_follows_its_setting_within_memifs_bounds(runtime, monkeypatch):
    """The client's ring is the connection's: 64 MiB of 16 KiB buffers each way by default
    (4096, memif's 2**12 here), the setting's size otherwise, 256-4096 buffers."""
    monkeypatch.delenv("REMOTE_ACCEL_MEMIF_RING_MB", raising=False)
    (_, opts), = ea.vdev_options(ea.default_eal_args("client", hugepages=False)).items()
    assert int(opts["rsize"]) == 12 and int(opts["bsize"]) == 16384
    assert ea.memif_rsize(65000) == 10  # 1032 such buffers fit in 64 MiB: 1024, the power of two below
    for mb, rsize in (("16", 10), ("1", 8), ("1024", 12)):
        monkeypatch.setenv("REMOTE_ACCEL_MEMIF_RING_MB", mb)
        assert ea.memif_rsize(16384) == rsize
    monkeypatch.setenv("REMOTE_ACCEL_MEMIF_RING_MB", "lots")
    with pytest.raises(ConfigError, match="REMOTE_ACCEL_MEMIF_RING_MB"):
        ea.memif_rsize(16384)


def test_server_defaults_one_interface_per_slot(runtime):
    args = ea.default_eal_args("server", hugepages=True, slots=3)
    assert "--in-memory" in args and "--no-huge" not in args
    vdevs = ea.vdev_options(args)
    assert sorted(v["id"] for v in vdevs.values()) == ["0", "1", "2"]
    assert all(v["role"] == "server" for v in vdevs.values())


def test_local_has_no_device_and_prefixes_differ(runtime):
    a, b = ea.default_eal_args("local"), ea.default_eal_args("local")
    assert ea.vdev_options(a) == {}
    prefix = [x for x in a if x.startswith("--file-prefix")]
    assert prefix and prefix != [x for x in b if x.startswith("--file-prefix")]
    with pytest.raises(ConfigError):
        ea.default_eal_args("router")


@pytest.mark.parametrize("user, gone, kept", [
    (["--vdev=net_ring0"], ["net_memif0"], ["--no-pci"]),
    (["-a", "0000:01:00.0"], ["net_memif0", "--no-pci"], []),
    (["--no-huge", "-m", "256"], ["--in-memory"], ["--no-pci"]),
    (["-l", "1"], ["--lcores=0@(0,1)"], []),
    (["--file-prefix=mine"], [], ["--file-prefix=mine"]),
])
def test_user_arguments_replace_conflicting_defaults(runtime, user, gone, kept):
    merged = ea.merge_eal_args(ea.default_eal_args("client", hugepages=True), user)
    text = " ".join(merged)
    for g in gone:
        assert g not in text
    for k in kept:
        assert k in text
    for u in user:
        assert u in merged or any(m.endswith(u) for m in merged)
    assert len([m for m in merged if m.startswith("--file-prefix")]) == 1


def test_memif_slots_are_claimed_per_process_and_freed_when_it_dies(runtime):
    sock = str(runtime / "memif.sock")
    memif_slots.publish(sock, 2, "max_clients")
    holder = subprocess.Popen([sys.executable, "-c",
                               "import sys; from remote_accel.dataplane import memif_slots as ms;"
                               f"print(ms.claim({sock!r}), flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "0"
        assert memif_slots.claim(sock) == 1 and memif_slots.claim(sock) == 1  # this process keeps its slot
        assert memif_slots.held_slots(sock) == [0, 1]
        memif_slots.release(sock)
        memif_slots.claim(sock)
        other = subprocess.run([sys.executable, "-c", "import sys; from remote_accel.dataplane import memif_slots"
                                f" as ms; ms.claim({sock!r})"], capture_output=True, text=True)
        assert "is full: all 2 memif client slots are taken" in other.stderr
        assert "--max-clients (now 2)" in other.stderr
        assert f"at most {memif_slots.MAX_SLOTS} memif slots, DPDK's limit of ports per process" in other.stderr
        holder.kill()
        holder.wait(10)
        assert memif_slots.held_slots(sock) == [1]  # the killed process's slot is free at once
    finally:
        memif_slots.release(sock)
        holder.kill()
        holder.wait(10)
    assert sorted(os.listdir(runtime)) == ["memif.sock.slots"]  # one file, the server's
    memif_slots.unpublish(sock)
    assert os.listdir(runtime) == []


def test_slots_limited_by_ports_say_so(runtime):
    sock = str(runtime / "memif.sock")
    memif_slots.publish(sock, 1, "ports")
    fd = os.open(memif_slots.slots_path(sock), os.O_RDWR)
    try:
        assert memif_slots._try_lock(fd, 0)  # another open file: another client, as far as locks go
        with pytest.raises(memif_slots.MemifSlotsFull, match="DPDK's limit of ports.*transport='tcp'") as exc:
            memif_slots.claim(sock)
        assert "--max-clients gives no more" in str(exc.value)  # the server option named, and why not
    finally:
        os.close(fd)
        memif_slots.unpublish(sock)
    assert memif_slots.slots_for(2) == 2 and memif_slots.slots_for(64) == memif_slots.MAX_SLOTS


def test_without_a_server_a_client_takes_id_zero_and_writes_nothing(runtime):
    args = ea.default_eal_args("client", hugepages=True)
    assert ea.vdev_options(args)["net_memif0"]["id"] == "0"
    assert os.listdir(runtime) == []


def test_server_start_removes_old_per_id_lock_files(runtime):
    sock = str(runtime / "memif.sock")
    (runtime / "memif.sock.id0.lock").write_text("")
    memif_slots.publish(sock, 4, "max_clients")
    assert sorted(os.listdir(runtime)) == ["memif.sock.slots"]
    assert memif_slots.read_slots(sock) == {"slots": 4, "limited_by": "max_clients"}
    memif_slots.unpublish(sock)


def test_stale_memif_socket_is_removed_live_one_is_reported(runtime):
    path = str(runtime / "memif.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(path)
    s.listen(1)
    assert ea.memif_socket_in_use(path)
    with pytest.raises(ConfigError, match="already listens"):
        ea.default_eal_args("server")
    s.close()  # the file stays behind, like a server that died
    assert os.path.exists(path) and not ea.memif_socket_in_use(path)
    assert not os.path.exists(path)


def test_abstract_memif_socket_is_seen_without_connecting(runtime):
    """memif's default socket is abstract (no file); probing must not connect to it."""
    path = str(runtime / "memif.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind("\0" + path)
    s.listen(1)
    s.setblocking(False)
    try:
        assert ea.memif_socket_in_use(path)
        with pytest.raises(BlockingIOError):
            s.accept()  # nobody knocked
    finally:
        s.close()
    assert not ea.memif_socket_in_use(path)


def test_frame_sizes_from_vdev_arguments():
    args = ["x", "--vdev=net_memif0,bsize=9216", "--vdev=net_af_packet0,iface=lo,framesz=4096"]
    assert ea.port_frame_sizes("net_memif0", "net_memif", args) == (9216, 0)
    frame, room = ea.port_frame_sizes("net_af_packet0", "net_af_packet", args)
    assert frame == 4096 - 96 and room == 4096  # lo's MTU is larger than the frame
    assert ea.port_frame_sizes("0000:01:00.0", "net_ice", args) == (1514, 0)
