"""The shim on its own: EAL, ports, bursts, stats, fault injection, frame checks."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time

import crc32c
import numpy as np
import pytest

from remote_accel import __version__
from remote_accel.dataplane import buffers, dpdk
from remote_accel.errors import DpdkError, PeerGone

from dpdk_helpers import pattern

FT_DATA, FT_ACK, FT_HELLO = 1, 2, 3
STRIDE = 16384


def rx_all(port: int, want: int, timeout: float = 5.0) -> list[bytes]:
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got += dpdk.rx_raw(port, 2 * 32 + 8, STRIDE)  # a burst, its duplicates, held frames
        if len(got) < want:
            time.sleep(0.001)
    return got


def wait_for(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_shim_version_matches_package():
    assert dpdk._shim_version == __version__


def test_eal_init_twice_is_a_clear_error(eal):
    with pytest.raises(DpdkError) as info:
        dpdk.eal_init(role="local")
    assert info.value.errno == errno.EALREADY
    assert "one EAL per process" in str(info.value)
    with pytest.raises(DpdkError, match="one EAL per process"):
        dpdk.ensure_eal(["--vdev=net_null7"])  # other arguments than those EAL runs with


def test_eal_init_twice_in_a_fresh_process():
    """The shim itself (not only the Python guard) refuses a second rte_eal_init."""
    code = (
        "from remote_accel.dataplane import dpdk\n"
        "dpdk.eal_init(role='local')\n"
        "argv = [dpdk.ffi.new('char[]', a) for a in (b'x', b'--no-huge', b'--no-pci')]\n"
        "print(dpdk.lib.shim_eal_init(len(argv), dpdk.ffi.new('char *[]', argv)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) == -errno.EALREADY


def test_dpdk_ending_the_process_leaves_its_reason_on_stderr():
    """DPDK's log goes to `logging`, but rte_exit's reason (CRIT) must not die with the
    process unread; a warning stays out of the user's stderr."""
    code = (
        "import ctypes, ctypes.util\n"
        "from remote_accel.dataplane import dpdk\n"
        "dpdk.eal_init(role='local')\n"
        "eal = ctypes.CDLL(ctypes.util.find_library('rte_eal'))\n"
        "eal.rte_log(5, 0, b'a warning for the log only\\n')\n"
        "eal.rte_exit(3, b'the reason DPDK gives\\n')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, (out.returncode, out.stderr[-500:])
    assert "the reason DPDK gives" in out.stderr and "exiting with code: 3" in out.stderr
    assert "a warning" not in out.stderr


def test_crc32c_matches_reference():
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, 40000, dtype=np.uint8).tobytes()
    for n in (0, 1, 7, 8, 63, 255, 768, 769, 6143, 6144, 6145, 16286, 40000):
        for off in (0, 1, 5):
            chunk = data[off : off + n]
            assert dpdk.crc32c(chunk) == crc32c.crc32c(chunk), (n, off)
    assert dpdk.crc32c(data[100:], dpdk.crc32c(data[:100])) == crc32c.crc32c(data)


def test_ring_pair_burst_and_stats(ring_ports):
    a, b = ring_ports
    frames = [os.urandom(n) for n in (60, 64, 1500, 9000, 16000)]
    for f in frames:
        dpdk.tx_raw(a, f)
    assert rx_all(b, len(frames)) == frames
    sa, sb = dpdk.port_stats(a), dpdk.port_stats(b)
    assert sa["tx_frames"] == len(frames) and sa["tx_bytes"] == sum(map(len, frames))
    assert sb["rx_frames"] == len(frames) and sb["rx_bytes"] == sum(map(len, frames))
    assert sb["eth_ipackets"] == len(frames)
    dpdk.reset_port_stats(a)
    assert dpdk.port_stats(a)["tx_frames"] == 0


def test_fault_drop_duplicate_corrupt(ring_ports):
    a, b = ring_ports
    frame = os.urandom(1000)
    dpdk.set_fault(a, "tx", drop=1.0)
    dpdk.tx_raw(a, frame, 10)
    assert rx_all(b, 1, timeout=0.2) == []
    assert dpdk.port_stats(a)["fault_dropped"] == 10

    dpdk.set_fault(a, "tx", duplicate=1.0)
    dpdk.tx_raw(a, frame, 10)
    assert rx_all(b, 20) == [frame] * 20
    assert dpdk.port_stats(a)["fault_duplicated"] == 10
    dpdk.set_fault(a, "tx")
    dpdk.set_fault(b, "rx", duplicate=1.0)  # a whole burst at once: the output grows
    dpdk.tx_raw(a, frame, 20)
    assert rx_all(b, 40) == [frame] * 40
    dpdk.set_fault(b, "rx")
    assert dpdk.pool_audit() == 0

    dpdk.set_fault(a, "tx", corrupt=1.0, seed=5)
    dpdk.tx_raw(a, frame, 10)
    got = rx_all(b, 10)
    assert len(got) == 10
    for g in got:  # exactly one bit flipped, somewhere
        diff = np.frombuffer(g, np.uint8) ^ np.frombuffer(frame, np.uint8)
        assert np.unpackbits(diff).sum() == 1
    dpdk.set_fault(a, "tx")


def test_fault_drop_is_seeded_and_reorder_keeps_every_frame(ring_ports):
    a, b = ring_ports
    frames = [i.to_bytes(4, "big") * 20 for i in range(200)]

    def run(**fault) -> list[bytes]:
        dpdk.set_fault(a, "tx", **fault)
        for f in frames:
            dpdk.tx_raw(a, f)
        dpdk.tx_raw(a, b"", 0)  # flush what a reorder fault still holds
        return rx_all(b, len(frames), timeout=0.5)

    first, second = run(drop=0.3, seed=42), run(drop=0.3, seed=42)
    assert first == second and 0 < len(first) < len(frames)
    reordered = run(reorder=0.3, seed=7)
    assert sorted(reordered) == sorted(frames) and reordered != frames
    assert dpdk.port_stats(a)["fault_reordered"] > 0
    dpdk.set_fault(a, "tx")
    with pytest.raises(DpdkError):
        dpdk.set_fault(a, "tx", drop=1.5)


def test_malformed_frames_are_counted_and_dropped(pair):
    a, b = pair
    pa, pb = a._port, b._port
    valid = dpdk.build_frame(FT_DATA, conn=0x12345, seq=0, chunk=b"abc")
    bad_crc = bytearray(valid)
    bad_crc[-1] ^= 1
    bad_magic = bytearray(valid)
    bad_magic[42] ^= 0xFF
    bad_type = bytearray(valid)
    bad_type[45] = 99
    other_port = bytearray(valid)
    other_port[36:38] = (4789).to_bytes(2, "big")  # UDP destination: not ours
    before = dpdk.port_stats(pb)
    for frame in (b"\x00" * 10, valid[:60], bytes(bad_crc), bytes(bad_magic), bytes(bad_type),
                  bytes(other_port), valid):
        dpdk.tx_raw(pa, frame)

    def delta(key):
        return dpdk.port_stats(pb)[key] - before[key]

    assert wait_for(lambda: delta("rx_ignored") >= 2 and delta("rx_malformed") >= 3
                    and delta("rx_bad_crc") >= 1 and delta("rx_no_conn") >= 1)
    # and the connection on that port never noticed
    a.send(64, b"still", [b"fine"])
    msg = b.recv(timeout=10)
    assert msg.meta == b"still" and bytes(msg.payloads[0]) == b"fine"


def _pipeline(a, b, sizes, timeout=120.0):
    errors: list = []

    def sender():
        try:
            for i, n in enumerate(sizes):
                a.send(64, i.to_bytes(4, "big"), [pattern(n, i)], req_id=i)
        except Exception as exc:  # reported below
            errors.append(exc)

    th = threading.Thread(target=sender, daemon=True)
    th.start()
    for i, n in enumerate(sizes):
        msg = b.recv(timeout=timeout)
        assert msg.req_id == i and msg.meta == i.to_bytes(4, "big")
        assert np.array_equal(np.frombuffer(msg.payloads[0], np.uint8), pattern(n, i))
    th.join(timeout)
    assert not errors, errors


def test_channel_survives_faults_in_process(pair):
    a, b = pair
    for port, seed in ((a._port, 1), (b._port, 2)):
        for direction in ("rx", "tx"):
            dpdk.set_fault(port, direction, drop=0.02, corrupt=0.002, duplicate=0.01, reorder=0.02,
                           seed=seed * 10 + len(direction))
    rng = np.random.default_rng(3)
    sizes = [int(x) for x in np.exp(rng.uniform(0, np.log(2 << 20), 200))]
    _pipeline(a, b, sizes)
    st = a.stats()
    assert st["tx_retransmits"] > 0 and st["port_fault_dropped"] > 0
    assert b.stats()["port_rx_bad_crc"] + a.stats()["port_rx_bad_crc"] > 0
    assert dpdk.pool_audit() == 0  # no mbuf freed twice on the way


def test_zero_copy_send_keeps_buffers_until_freed(eal):
    """Extbuf frames point into the caller's memory; send returns once all are freed.
    A ring pair hands the mbuf itself to the receiver, so send waits for the consumer."""
    pa, pb = dpdk.ring_pair(zero_copy=True)
    options = dpdk.ChannelOptions(zero_copy_min=1 << 16)
    with dpdk.DpdkListener([pb], options=options) as lst:
        a = dpdk.DpdkTransport.connect(pa, timeout=10, options=options)
        b = lst.accept(10)
    for data in (buffers.pinned_empty(8 << 20), np.empty(8 << 20, np.uint8)):
        data[:] = pattern(8 << 20, 9)
        got: list = []
        th = threading.Thread(target=lambda: got.append(b.recv(timeout=30)), daemon=True)
        th.start()
        a.send(66, b"zc", [data])
        th.join(30)
        assert np.array_equal(np.frombuffer(got[0].payloads[0], np.uint8), data)
    assert a.stats()["tx_zero_copy_frames"] > 0
    a.close()
    b.close()
    dpdk.remove_vdev(pa)
    dpdk.remove_vdev(pb)


def test_silent_peer_becomes_peer_gone(eal):
    a, b = dpdk.DpdkTransport.pair(options=dpdk.ChannelOptions(peer_timeout=1.0))
    dpdk.set_fault(b._port, "tx", drop=1.0)  # b says nothing any more
    started = time.monotonic()
    with pytest.raises(PeerGone, match="no frame from the peer"):
        a.recv(timeout=20)
    assert time.monotonic() - started < 5
    b.close()


def test_goodbye_is_prompt(pair):
    a, b = pair
    b.close()
    started = time.monotonic()
    with pytest.raises(PeerGone, match="closed"):
        a.recv(timeout=20)
    assert time.monotonic() - started < 1


def test_pinned_buffers(eal):
    import torch

    arr = buffers.pinned_empty(1 << 20, np.float32)
    arr[:] = 1.5
    assert buffers.is_pinned(arr) and not buffers.is_pinned(np.zeros(16))
    t = buffers.as_tensor(arr, torch.float32)
    t.mul_(2)  # shares the memory
    assert float(arr[123]) == 3.0
    pool = buffers.PinnedPool()
    x = pool.get(5000)
    base = x.base
    pool.put(x)
    assert pool.get(6000).base is base  # same size class, reused


@pytest.mark.parametrize("faulthandler_on", [False, True])
def test_memif_guard_does_not_hide_other_crashes(tmp_path, faulthandler_on):
    """The SIGSEGV guard around memif bursts must hand every other fault on (a real
    crash stays a crash, with faulthandler's traceback when it is enabled)."""
    code = (
        "import ctypes, faulthandler, sys\n"
        f"{'faulthandler.enable()' if faulthandler_on else ''}\n"
        "from remote_accel.dataplane import dpdk\n"
        "dpdk.eal_init(role='local')\n"
        f"p = dpdk.add_vdev('net_memif_g', 'role=server,id=0,socket={tmp_path}/g.sock')\n"
        "dpdk.setup_port(p)  # installs the guard\n"
        "print('armed', flush=True)\n"
        "ctypes.string_at(0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "armed" in out.stdout
    assert out.returncode == -11, (out.returncode, out.stderr[-500:])
    if faulthandler_on:
        assert "Segmentation fault" in out.stderr
