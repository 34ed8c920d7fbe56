"""Many local DPDK (memif) clients of one server, each a process of its own: as many as
--max-clients allows, slots of exited or killed clients free at once, a full server
says so, nothing left on disk, nothing on the user's terminal."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from remote_accel.server.testing import Client, ServerProcess, wait_for

# serial: up to 25 memif clients and their EALs at once, away from the rest of the suite in CI
pytestmark = [pytest.mark.dpdk, pytest.mark.any_torch, pytest.mark.serial]

try:
    from remote_accel.dataplane import dpdk  # noqa: F401
    from remote_accel.dataplane import eal_files, memif_slots
except ImportError as exc:  # UnavailableError: no DPDK or the shim is not built
    pytest.skip(f"DPDK transport unavailable: {exc}", allow_module_level=True)

CLIENTS = 16
WAIT_S = 600  # 16 processes importing torch and starting EAL on a loaded 2-core machine

# A user's training script: connect, say so, wait for "go", train a small model on
# remote_accel and on the CPU from the same seed, print both loss curves.
TRAINER = textwrap.dedent("""
    import json, sys, torch, torch.nn as nn, remote_accel
    remote_accel.init(transport=sys.argv[1], timeout=120)
    print("connected", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit(0)
    def train(device, seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(32, 8, generator=g), torch.randint(0, 2, (32,), generator=g)
        losses = []
        for _ in range(6):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses
    seed = int(sys.argv[2])
    print(json.dumps({"remote": train("remote_accel", seed), "cpu": train("cpu", seed)}), flush=True)
    sys.stdin.readline()
    remote_accel.shutdown()
""")


@pytest.fixture(scope="module")
def server():
    # the observer below sends no heartbeats while 16 clients start and train for minutes
    with ServerProcess("--transport", "tcp,dpdk", "--heartbeat-timeout", "3600",
                       start_timeout=WAIT_S) as proc:
        yield proc
        assert proc.alive(), proc.log()
        assert "Traceback" not in proc.log(), proc.log()


def trainer(server, transport: str = "dpdk", seed: int = 0, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", TRAINER, transport, str(seed)],
                            env=dict(os.environ, **server.client_env(), **env), text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def read_line(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError(f"client exited ({proc.wait()}):\n{proc.stderr.read()}")
    return line.strip()


def tell(proc: subprocess.Popen, text: str) -> None:
    proc.stdin.write(text + "\n")
    proc.stdin.flush()


def socket_of(server) -> str:
    return os.path.join(server.runtime_dir, "memif.sock")


def eal_dirs(pid: int) -> list[str]:
    return glob.glob(os.path.join(eal_files.runtime_base(), f"ra{pid}_*"))


def test_sixteen_memif_clients_train_at_once_then_every_session_is_freed(server):
    procs = [trainer(server, seed=i) for i in range(CLIENTS)]
    try:
        for proc in procs:
            assert read_line(proc) == "connected"
        with Client.tcp(*server.tcp, token=server.token) as observer:
            assert observer.stats()["server_sessions"] == CLIENTS + 1  # all at once
            assert len(memif_slots.held_slots(socket_of(server))) == CLIENTS
            for proc in procs:
                tell(proc, "go")
            for i, proc in enumerate(procs):
                result = json.loads(read_line(proc))
                assert result["remote"] == pytest.approx(result["cpu"], rel=1e-4, abs=1e-5), i
            for proc in procs:
                tell(proc, "exit")
            for proc in procs:
                _, err = proc.communicate(timeout=WAIT_S)
                assert proc.returncode == 0, err
                assert err == "", f"a client printed to its terminal:\n{err}"  # quiet by default
                assert eal_dirs(proc.pid) == []  # a clean exit leaves no EAL files
        with Client.tcp(*server.tcp, token=server.token) as observer:
            stats = wait_for(lambda: (s := observer.stats())["server_sessions"] == 1 and s, "sessions to end")
            assert stats["server_memory_allocated"] == stats["memory_allocated"] == 0
        assert memif_slots.held_slots(socket_of(server)) == []
        assert sorted(os.listdir(server.runtime_dir)) == ["memif.sock.slots", "server.log", "token"]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_full_server_says_which_option_to_raise_and_a_killed_clients_slot_is_reused():
    with ServerProcess("--transport", "tcp,dpdk", "--max-clients", "2", start_timeout=WAIT_S) as server:
        sock = socket_of(server)
        assert memif_slots.read_slots(sock) == {"slots": 2, "limited_by": "max_clients"}
        holders = [trainer(server, seed=i) for i in range(2)]
        try:
            for proc in holders:
                assert read_line(proc) == "connected"
            extra = trainer(server)
            _, err = extra.communicate(timeout=WAIT_S)
            assert extra.returncode != 0
            assert "is full: all 2 memif client slots are taken" in err and "--max-clients" in err, err
            killed = holders[0]
            killed.send_signal(signal.SIGKILL)
            killed.wait()
            assert eal_dirs(killed.pid)  # what a killed process leaves ...
            assert len(memif_slots.held_slots(sock)) == 1  # ... but not its slot
            new = trainer(server, seed=5)
            assert read_line(new) == "connected"  # in the slot of the killed one
            assert eal_dirs(killed.pid) == []  # ... removed by the next EAL start
            tell(new, "go")
            result = json.loads(read_line(new))
            assert result["remote"] == pytest.approx(result["cpu"], rel=1e-4, abs=1e-5)
            tell(new, "exit")
            assert new.wait(WAIT_S) == 0
            wait_for(lambda: "freed" in server.log() and server.log().count("client disconnected") >= 2,
                     "the killed client's session to end")
        finally:
            for proc in holders:
                proc.kill()
                proc.wait()
        assert server.alive(), server.log()
    assert not os.path.exists(memif_slots.slots_path(sock))  # a stopped server removes it


def test_dpdk_without_server_is_quiet_and_clear(tmp_path):
    """No DPDK backtrace and no INFO lines on the terminal: only the error, as an exception."""
    body = textwrap.dedent("""
        import remote_accel
        from remote_accel.errors import RemoteAccelError
        try:
            remote_accel.init(transport="dpdk", timeout=2)
        except RemoteAccelError as exc:
            print(type(exc).__name__, exc)
    """)
    proc = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, timeout=WAIT_S,
                          env=dict(os.environ, REMOTE_ACCEL_RUNTIME_DIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("PeerGone") and "no link" in proc.stdout, proc.stdout
    assert proc.stderr == ""
    assert os.listdir(tmp_path) == []  # no lock file, no socket


def test_default_init_over_tcp_is_quiet(server, tmp_path):
    """transport "auto" on a host without a DPDK server: TCP, said at INFO level only."""
    body = textwrap.dedent("""
        import logging, torch, remote_accel
        records = []
        logging.getLogger("remote_accel").addHandler(type("H", (logging.Handler,), {"emit": lambda s, r: records.append(r)})())
        logging.getLogger("remote_accel").setLevel(logging.DEBUG)
        remote_accel.init()
        assert (torch.ones(3, device="remote_accel") * 2).sum().item() == 6.0
        remote_accel.shutdown()
        said = [(r.levelname, r.getMessage()) for r in records if "transport auto" in r.getMessage()]
        assert len(said) == 1 and said[0][0] == "INFO", said
        print("ok")
    """)
    host, port = server.tcp
    env = dict(os.environ, REMOTE_ACCEL_RUNTIME_DIR=str(tmp_path), REMOTE_ACCEL_SERVER=f"{host}:{port}",
               REMOTE_ACCEL_TOKEN=server.token)
    env.pop("REMOTE_ACCEL_TRANSPORT", None)
    proc = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, timeout=WAIT_S, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr
    assert proc.stderr == ""


RECONNECTS = 25  # past the ~20 after which issue 19's server stopped taking clients
# A short-lived user: connect, check a few ops, then leave as told: "exit" (a clean
# shutdown), "kill" (SIGKILL once it has worked). Two at a time, so that one's
# connect meets another's leaving on the server's memif control thread.
SHORT_LIVED = textwrap.dedent("""
    import sys, torch, remote_accel
    remote_accel.init(transport="dpdk", timeout=60)
    x = torch.arange(4.0, device="remote_accel")
    print(float((x * 2).sum().item()), flush=True)
    if sys.argv[1] == "kill":
        sys.stdin.readline()
    remote_accel.shutdown()
""")


def test_twenty_five_memif_clients_come_and_go_and_the_server_still_takes_new_ones():
    """Issue 19: after ~20 clients had come and gone, a server once stopped taking memif
    clients (new ones hung in EAL start-up). Each of 25 short-lived clients, leaving
    cleanly, killed after its work, or killed while it starts, must get its answer;
    afterwards every session and slot is free and a new client trains."""
    with ServerProcess("--transport", "tcp,dpdk", "--max-clients", "4", start_timeout=WAIT_S) as server:
        env = dict(os.environ, **server.client_env())
        sock = socket_of(server)
        modes = ["exit", "kill", "exit", "kill", "early"] * (RECONNECTS // 5)
        for i in range(0, RECONNECTS, 2):
            procs = [(mode, subprocess.Popen([sys.executable, "-c", SHORT_LIVED, mode], env=env, text=True,
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE)) for mode in modes[i:i + 2]]
            try:
                for mode, proc in procs:
                    if mode == "early":  # killed somewhere in EAL start-up or the memif handshake
                        time.sleep(0.5 + (i % 7) * 0.3)
                        proc.kill()
                        proc.wait()
                        continue
                    assert read_line(proc) == "12.0", f"client {i} ({mode})"
                    if mode == "kill":
                        proc.kill()
                    proc.wait(WAIT_S)
                    if mode == "exit":
                        assert proc.returncode == 0, proc.stderr.read()
            finally:
                for _, proc in procs:
                    proc.kill()
                    proc.wait()
        assert server.alive(), server.log()
        with Client.tcp(*server.tcp, token=server.token) as observer:
            wait_for(lambda: observer.stats()["server_sessions"] == 1, "the sessions to end")
        wait_for(lambda: memif_slots.held_slots(sock) == [], "every slot to be free")
        last = trainer(server, seed=3)
        try:
            assert read_line(last) == "connected"
            tell(last, "go")
            result = json.loads(read_line(last))
            assert result["remote"] == pytest.approx(result["cpu"], rel=1e-4, abs=1e-5)
            tell(last, "exit")
            assert last.wait(WAIT_S) == 0
        finally:
            last.kill()
            last.wait()
        assert "Traceback" not in server.log(), server.log()


def test_a_client_waits_for_a_server_slow_to_accept_instead_of_crashing_it():
    """The cause of issue 19's hang: a memif client restarted its port while its control
    connection still sat in the server's accept queue; DPDK 22.11's memif server then
    panics (or, when the fd number is reused, blocks its interrupt thread: no client is
    accepted any more). A server that does not accept for 3 s (stopped) must find the
    client still there, and live on for the next ones."""
    with ServerProcess("--transport", "tcp,dpdk", "--max-clients", "2", start_timeout=WAIT_S) as server:
        first = trainer(server, seed=1)
        try:
            wait_for(lambda: eal_dirs(first.pid), "the client's EAL to start", WAIT_S)
            os.kill(server.proc.pid, signal.SIGSTOP)  # its connect queues; restarts would close it
            time.sleep(3)
            os.kill(server.proc.pid, signal.SIGCONT)
            assert read_line(first) == "connected"
            assert server.alive(), server.log()
            second = trainer(server, seed=2)
            try:
                assert read_line(second) == "connected"
                for proc in (first, second):
                    tell(proc, "go")
                for proc in (first, second):
                    result = json.loads(read_line(proc))
                    assert result["remote"] == pytest.approx(result["cpu"], rel=1e-4, abs=1e-5)
                    tell(proc, "exit")
                    assert proc.wait(WAIT_S) == 0
            finally:
                second.kill()
                second.wait()
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
            first.kill()
            first.wait()
        assert server.alive() and "panic" not in server.log().lower(), server.log()
