"""A server that dies, killed or by its device's fault (exit 3), becomes a RemoteAccelError,
no hang, with recovery off; with recovery on (init()'s default) the session goes on with
the same results on the server that comes back, or says which op killed it."""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import remote_accel
from remote_accel.errors import RemoteOpError
from remote_accel.server.failure import EXIT_DEVICE_LOST
from remote_accel.server.testing import ServerProcess, Supervisor, wait_for

LIBS = str(pathlib.Path(__file__).parents[1] / "libs")  # ra_test_ops: ra_test::lose_device fails the device
LIB_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [LIBS, os.environ.get("PYTHONPATH")]))}
sys.path.insert(0, LIBS)
import ra_test_ops  # noqa: E402,F401  (registers ra_test:: on this side too)

RECOVERY = pytest.mark.parametrize("recovery", [False, True], ids=["recovery-off", "recovery-on"])

# Trains a model and, in lockstep, its CPU copy: every loss the server gives must be the
# CPU's. With recovery off the kill ends the loop with an error; with recovery on the
# loop goes on past the recovery (on the server the test started again) for 5 more steps.
CLIENT = textwrap.dedent("""
    import sys, time, torch, torch.nn as nn, remote_accel
    recovery = sys.argv[3] == "on"
    remote_accel.init(transport="tcp", server=sys.argv[1], token=sys.argv[2], timeout=3.0, recovery=recovery)
    torch.manual_seed(0)
    local = nn.Linear(16, 4)
    model = nn.Linear(16, 4)
    model.load_state_dict(local.state_dict())
    model.to("remote_accel")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, local)]
    x = torch.randn(8, 16)
    xd = x.to("remote_accel")
    started, left, same = None, None, True
    try:
        for step in range(100000):
            for m, opt, inp in ((model, opts[0], xd), (local, opts[1], x)):
                opt.zero_grad()
                loss = m(inp).pow(2).mean()
                loss.backward()
                opt.step()
                if m is model:
                    remote = loss
            started = time.monotonic()
            same = same and abs(remote.item() - loss.item()) <= 1e-5
            if step == 0:
                print("training", flush=True)
            if left is None and remote_accel.stats()["recoveries"]:
                left = 5
            if left is not None:
                left -= 1
                if left == 0:
                    print(f"RECOVERED steps {step + 1} same {same}", flush=True)
                    sys.exit(0)
            time.sleep(0.01)
    except remote_accel.RemoteAccelError as exc:
        print(f"ERROR after {time.monotonic() - started:.1f}s: {exc}", flush=True)
        try:
            (xd + 1).cpu()
        except remote_accel.RemoteAccelError:
            print("later ops fail too", flush=True)
        sys.exit(0)
    sys.exit(1)
""")


@pytest.mark.any_torch
@RECOVERY
def test_a_killed_server_is_an_error_or_with_recovery_the_training_goes_on(recovery):
    server = ServerProcess().start()
    host, port = server.tcp
    client = subprocess.Popen([sys.executable, "-c", CLIENT, f"{host}:{port}", server.token,
                               "on" if recovery else "off"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline().strip() == "training", client.stderr.read()
        server.kill()  # while the client trains: a step is in flight or about to be
        if recovery:
            server.restart()  # as a supervisor would
        out, err = client.communicate(timeout=120)
    finally:
        client.kill()
        server.stop()
    assert client.returncode == 0, out + err
    if not recovery:
        assert "ERROR after" in out and "later ops fail too" in out
        seconds = float(out.split("ERROR after ")[1].split("s:")[0])
        assert seconds < 3.0 + 5.0
        return
    # the scenario: the session met the dead server and recovered (the client counts it)
    assert "recovering this session" in err and "recovered the session" in err, err
    steps, same = out.split()[2], out.split()[4]
    assert int(steps) >= 5 and same == "True", out  # every loss, after the recovery too, is the CPU's


INDEX_ERROR_CLIENT = textwrap.dedent("""
    import sys, torch, remote_accel
    remote_accel.init(transport="tcp", server=sys.argv[1], token=sys.argv[2], timeout=10.0, recovery=False)
    a = torch.ones(4, device="remote_accel")
    idx = torch.tensor([0, 10]).to("remote_accel")
    for name, step in (("index", lambda: a[idx].cpu()), ("after", lambda: (a + 1).cpu().tolist())):
        try:
            print(name, "ok", step(), flush=True)
        except remote_accel.RemoteAccelError as exc:
            print(name, "error", str(exc).splitlines()[0], flush=True)
""")


def test_out_of_range_index_fails_at_the_next_sync():
    """The index op is queued; its failure on the server surfaces at the sync. On CPU the
    session goes on. On CUDA it is a device-side assert, which poisons the process's CUDA
    context: the server tells the client so and exits with EXIT_DEVICE_LOST (a supervisor
    restarts it) instead of aborting in a destructor."""
    with ServerProcess() as server:
        host, port = server.tcp
        proc = subprocess.run([sys.executable, "-c", INDEX_ERROR_CLIENT, f"{host}:{port}", server.token],
                              capture_output=True, text=True, timeout=120)
        lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert lines["index"].startswith("error "), lines
        if server.device == "cpu":
            assert "out of" in lines["index"] and "bounds" in lines["index"], lines
            assert lines["after"] == "ok [2.0, 2.0, 2.0, 2.0]"
            assert server.alive()
        else:
            assert "unrecoverable error" in lines["index"], lines
            assert lines["after"].startswith("error the remote_accel server at"), lines
            assert "unrecoverable error" in lines["after"], lines
            assert server.proc.wait(timeout=30) == EXIT_DEVICE_LOST, server.log()
            assert "Traceback" not in server.log() and "terminate called" not in server.log(), server.log()


# -- exit 3: the device failed (a CUDA device-side assert), played on a CPU server by ra_test::lose_device
@pytest.fixture(scope="module")
def lossy_server():
    """A server whose ops may lose its device (ra_test::lose_device), under a supervisor
    that restarts it whenever it exits."""
    with ServerProcess("--threads", "1", "--op-namespaces", "ra_test=ra_test_ops", env=LIB_ENV) as server, \
            Supervisor(server) as supervisor:
        yield supervisor


@pytest.fixture
def lossy(lossy_server):
    """The supervisor, its record of exits cleared, and connect(**init_kwargs) to its server."""
    supervisor, server = lossy_server, lossy_server.server
    wait_for(lambda: server.alive() and server.addresses, "the server to be up (again)")
    supervisor.exits.clear()
    supervisor.logs.clear()

    def connect(**kwargs):
        remote_accel.init(transport="tcp", server="%s:%d" % server.tcp, token=server.token, timeout=10.0, **kwargs)

    supervisor.connect = connect
    try:
        yield supervisor
    finally:
        remote_accel.shutdown()


def _device_lost_first(supervisor: Supervisor) -> None:
    """The scenario: the server lost its device, said so, and exited with status 3."""
    wait_for(lambda: supervisor.exits, "the server to exit")
    assert supervisor.exits[0] == EXIT_DEVICE_LOST, supervisor.logs
    assert "hit an unrecoverable error" in supervisor.logs[0] and "Traceback" not in supervisor.logs[0], \
        supervisor.logs[0]


@pytest.mark.any_torch
def test_exit_3_without_recovery_is_an_error_that_says_why_and_the_session_stays_closed(lossy):
    lossy.connect(recovery=False)
    x = torch.arange(4.0).to("remote_accel")
    assert (x * 2).sum().item() == 12.0
    with pytest.raises(remote_accel.RemoteAccelError, match="unrecoverable error") as info:
        torch.ops.ra_test.lose_device(x, "")  # its shape depends on the data: the call waits for the reply
    _device_lost_first(lossy)
    assert "lose_device" in str(info.value)
    with pytest.raises(remote_accel.RemoteAccelError, match="its server was lost"):
        x.cpu()  # the server restarted meanwhile; this session stays closed, its tensors gone


@pytest.mark.any_torch
def test_exit_3_with_recovery_takes_the_session_to_the_restarted_server(lossy, tmp_path):
    """A device failure that does not come again (a transient fault): the session is
    rebuilt on the restarted server and the op that met it runs there."""
    lossy.connect()
    once = tmp_path / "armed"
    once.touch()
    x = torch.arange(4.0).to("remote_accel")
    y = x * 2
    assert y.sum().item() == 12.0
    z = torch.ops.ra_test.lose_device(y, str(once))
    _device_lost_first(lossy)
    assert not once.exists()  # the op ran (and failed) on the first server
    assert remote_accel.stats()["recoveries"] == 1
    assert torch.equal(z.cpu(), torch.arange(4.0) * 2) and torch.equal((x + y).cpu(), torch.arange(4.0) * 3)


@pytest.mark.any_torch
def test_exit_3_of_an_op_that_fails_the_device_each_time_names_it_and_keeps_the_session(lossy):
    """A deterministic device-side assert: the op fails the restarted server too, so the
    session stops sending it, raises RemoteOpError naming it, and goes on without it."""
    lossy.connect()
    x = torch.arange(4.0).to("remote_accel")
    y = x * 2
    assert y.sum().item() == 12.0
    with pytest.raises(RemoteOpError, match="killed the server") as info:
        torch.ops.ra_test.lose_device(y, "")
    _device_lost_first(lossy)
    assert "the session is as it was before it" in str(info.value)
    assert len(lossy.exits) >= 2 and set(lossy.exits) == {EXIT_DEVICE_LOST}, lossy.exits  # it failed every server
    assert torch.equal(y.cpu(), torch.arange(4.0) * 2)  # what came before the op is kept
    assert torch.equal((y + x).cpu(), torch.arange(4.0) * 3)  # and the session goes on


@pytest.mark.any_torch
@RECOVERY
def test_ops_served_from_plans_after_the_server_is_gone(recovery):
    """The C++ queue serves ops from their plans without Python; a dead link under it is an
    error with recovery off, and recovers (with the queued ops' results) with recovery on."""
    with ServerProcess() as server:
        try:
            remote_accel.init(transport="tcp", server="%s:%d" % server.tcp, token=server.token, timeout=5,
                              recovery=recovery)
            x = torch.ones(8, device="remote_accel")
            for _ in range(3):  # the later two are served from the plan in C++
                x.add_(1.0)
            assert x.cpu().tolist() == [4.0] * 8
            server.kill()
            if not recovery:
                with pytest.raises(remote_accel.RemoteAccelError):
                    for _ in range(10_000):  # served from the plan until the queue fills and meets the dead link
                        x.add_(1.0)
                    x.cpu()
                with pytest.raises(remote_accel.RemoteAccelError):
                    x.add_(1.0)  # the queue is closed: Python raises the session's error
                return
            server.restart()
            for _ in range(10_000):
                x.add_(1.0)
            assert x.cpu().tolist() == [10_004.0] * 8
            assert remote_accel.stats()["recoveries"] == 1  # the scenario: the queue met the dead server
        finally:
            remote_accel.shutdown()
