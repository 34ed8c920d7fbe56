"""A pool of servers placed by Ray (remote_accel.ray.ServerPool), on a local Ray cluster.

Two CPU servers as Ray actors: a model split across them trains as on the CPU, a 64 MiB
copy from one to the other is bit-identical and does not pass the client, and a server
actor that is killed is restarted by Ray while its client gets RemoteAccelError, then
works again after re-init.
"""

import os
import signal
import time

import pytest
import torch
import torch.nn as nn

import remote_accel
from remote_accel.server.testing import wait_for

pytestmark = pytest.mark.any_torch

try:
    import ray
except ImportError:
    ray = None
#: a skip reason CI turns into a failure (tests/conftest.py): its main venv has Ray, and the
#: models venv, which has none, leaves these tests out (any_torch). A module-level skip would
#: be reported at collection, before that venv's `-m "not any_torch"` leaves them out.
NO_RAY = "remote_accel.ray needs Ray: pip install 'remote_accel[ray]'"

MIB = 1 << 20


@pytest.fixture(scope="module")
def pool():
    if ray is None:
        pytest.skip(NO_RAY)
    import remote_accel.ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 * MIB,
             configure_logging=False)
    try:
        pool = remote_accel.ray.ServerPool(num_servers=2, resources_per_server={"num_cpus": 1})
        try:
            yield pool
        finally:
            remote_accel.shutdown()
            pool.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture
def client(pool):
    remote_accel.init(servers=pool, timeout=30.0)
    try:
        yield pool
    finally:
        remote_accel.shutdown()


def test_pool_gives_addresses_and_tokens_through_ray(pool):
    addresses, tokens = pool.addresses(), pool.tokens()
    assert len(addresses) == len(tokens) == len(pool) == 2
    assert len(set(addresses)) == 2 and len(set(tokens)) == 2  # a token per server
    assert all(len(t) == 64 for t in tokens)
    # the addresses and tokens work as init arguments too
    remote_accel.init(transport="tcp", servers=addresses, tokens=tokens)
    try:
        assert torch.remote_accel.device_count() == 2
        x = torch.arange(6.0).to("remote_accel:1")
        assert torch.equal((x * 2).cpu(), torch.arange(6.0) * 2)
        assert torch.remote_accel.get_device_properties(0).type == "cpu"
    finally:
        remote_accel.shutdown()


def _halves(seed: int):
    torch.manual_seed(seed)
    first = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 16), nn.ReLU())
    second = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))
    return first, second


def _train(first, second, x, y, devices, steps=6):
    first.to(devices[0])
    second.to(devices[1])
    opt = torch.optim.SGD(list(first.parameters()) + list(second.parameters()), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        hidden = first(x.to(devices[0]))
        out = second(hidden.to(devices[1]))  # the activations move server 0 -> server 1
        loss = nn.functional.cross_entropy(out, y.to(devices[1]))
        loss.backward()  # the gradient moves back server 1 -> server 0
        opt.step()
        losses.append(loss.item())
    return losses


def test_model_split_across_two_servers_trains_like_cpu(client):
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 12, generator=gen), torch.randint(0, 3, (32,), generator=gen)
    expected = _train(*_halves(1), x, y, ("cpu", "cpu"))
    before = [remote_accel.server_stats(i)["peer_copies_received"] for i in (0, 1)]
    got = _train(*_halves(1), x, y, ("remote_accel:0", "remote_accel:1"))
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert got[-1] < got[0]
    after = [remote_accel.server_stats(i)["peer_copies_received"] for i in (0, 1)]
    # activations went 0 -> 1 and gradients 1 -> 0, server to server, every step
    assert after[1] - before[1] >= 6 and after[0] - before[0] >= 6


def test_copy_of_64_mib_between_pool_servers_bypasses_the_client(client):
    gen = torch.Generator().manual_seed(7)
    host = torch.randint(0, 256, (64 * MIB,), dtype=torch.uint8, generator=gen)
    x = host.to("remote_accel:0")
    torch.remote_accel.synchronize(0)
    wire = lambda: sum(remote_accel.stats(f"remote_accel:{i}")[k] for i in (0, 1)  # noqa: E731
                       for k in ("bytes_sent", "bytes_received"))
    before_client, before_servers = wire(), client.stats()
    y = x.to("remote_accel:1")
    torch.remote_accel.synchronize(1)
    torch.remote_accel.synchronize(0)  # the source counts its bytes once the destination said done
    after_servers = client.stats()
    assert wire() - before_client < MIB  # a few small messages, not 64 MiB
    assert after_servers[0]["peer_bytes_sent"] - before_servers[0]["peer_bytes_sent"] == 64 * MIB
    assert after_servers[1]["peer_bytes_received"] - before_servers[1]["peer_bytes_received"] == 64 * MIB
    assert torch.equal(y.cpu(), host)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("kill", ["SIGKILL", "ray.kill"])
def test_a_pool_member_killed_and_restarted_by_ray_takes_the_session_back(pool, kill):
    """Recovery (on by default): Ray restarts the killed server (a new process, address
    and token, which the session asks the pool for) and the session goes on there, whether
    the process died (SIGKILL) or Ray killed the actor."""
    remote_accel.init(servers=pool, timeout=30.0)
    try:
        old_pid = pool.info()[0]["pid"]
        x = torch.arange(1000.0).to("remote_accel:0")
        y = (x / 7).exp_()
        expected = (y + 1).cpu()
        if kill == "SIGKILL":
            os.kill(old_pid, signal.SIGKILL)  # Ray restarts the actor, with a new server
        else:
            ray.kill(pool.actors[0], no_restart=False)
        # the scenario: the server the session knew is gone before its next use (ray.kill
        # returns before the process ends)
        wait_for(lambda: _gone(old_pid), "the killed server's process to end")
        assert torch.equal((y + 1).cpu(), expected)
        assert pool.info()[0]["pid"] != old_pid
        assert remote_accel.stats(0)["recoveries"] == 1
    finally:
        remote_accel.shutdown()


def test_killed_server_is_restarted_and_the_client_reinits(pool):
    remote_accel.init(servers=pool, timeout=30.0, recovery=False)
    old_token, old_pid = pool.tokens()[0], pool.info()[0]["pid"]
    try:
        x = torch.ones(100).to("remote_accel:0")
        assert (x + 1).sum().item() == 200
        ray.kill(pool.actors[0], no_restart=False)  # the server process dies; Ray restarts it
        deadline = time.monotonic() + 60
        with pytest.raises(remote_accel.RemoteAccelError):
            while time.monotonic() < deadline:  # ray.kill returns before the process is gone
                (x + 1).cpu()
                time.sleep(0.05)
    finally:
        remote_accel.shutdown()
    remote_accel.init(servers=pool, timeout=30.0, recovery=False)  # waits for the restarted server
    try:
        assert pool.tokens()[0] != old_token  # a new server, with a token of its own
        assert pool.info()[0]["pid"] != old_pid
        y = torch.arange(4.0).to("remote_accel:0")
        assert torch.equal((y * 3).cpu(), torch.arange(4.0) * 3)
        assert torch.equal(y.to("remote_accel:1").cpu(), torch.arange(4.0))  # direct copies again
        # the server process dying by itself (here SIGKILL) is restarted the same way
        old_pid = pool.info()[1]["pid"]
        z = torch.ones(10).to("remote_accel:1")
        os.kill(old_pid, signal.SIGKILL)
        with pytest.raises(remote_accel.RemoteAccelError):
            (z + 1).cpu()
    finally:
        remote_accel.shutdown()
    remote_accel.init(servers=pool, timeout=30.0, recovery=False)
    try:
        assert pool.info()[1]["pid"] != old_pid
        assert torch.equal((torch.ones(3).to("remote_accel:1") * 2).cpu(), torch.full((3,), 2.0))
    finally:
        remote_accel.shutdown()


def test_insecure_lets_a_pool_serve_plain_tcp_off_loopback(pool):
    """host= an address that is not loopback carries tensors in clear: the pool's servers
    refuse it, saying how to allow it, unless insecure=True (their --insecure). The
    wildcard address stands for such an address here: it binds, and nothing is sent
    anywhere but this host. No CPU of the cluster is held (both are the module pool's)."""
    import remote_accel.ray

    with pytest.raises(remote_accel.RemoteAccelError, match="--insecure"):
        remote_accel.ray.ServerPool(num_servers=1, resources_per_server={"num_cpus": 0}, host="0.0.0.0")
    plain = remote_accel.ray.ServerPool(num_servers=1, resources_per_server={"num_cpus": 0}, host="0.0.0.0",
                                        insecure=True)
    try:
        (address,) = plain.addresses()
        assert address.startswith("0.0.0.0:"), address
        port = address.rpartition(":")[2]
        remote_accel.init(transport="tcp", server=f"127.0.0.1:{port}", token=plain.tokens()[0])
        try:
            assert torch.equal((torch.arange(4.0).to("remote_accel") * 2).cpu(), torch.arange(4.0) * 2)
        finally:
            remote_accel.shutdown()
    finally:
        plain.shutdown()
