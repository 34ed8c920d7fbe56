"""Code written for CUDA (or for torch.accelerator) runs unchanged on remote_accel: torch's
device-backend autoload, torch.compile's default backend and modes, torch.accelerator's
memory figures, torch.Event on the server's timeline, device properties, pinned memory.
Each against a real server process; autoload in fresh interpreters whose only link to
remote_accel is the environment."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import remote_accel
from remote_accel.server.testing import ServerProcess

# -- autoload: scripts that never import remote_accel ------------------------------------------
TRAIN_WITHOUT_IMPORT = textwrap.dedent("""
    import sys
    import torch
    runtime = sys.modules.get("remote_accel.pytorch_ext.runtime")
    connected = runtime is not None and runtime.is_initialized()  # not before the first use
    dev = torch.accelerator.current_accelerator()
    ours = dev is not None and dev.type == "remote_accel"  # a CUDA build of torch says cuda, GPU or not
    print("accelerator", ours, torch.accelerator.is_available(), torch.accelerator.device_count() if ours else "-",
          connected)
    if not ours:
        print("extension", "remote_accel.pytorch_ext._native" in sys.modules)
        sys.exit(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    x, y = torch.randn(32, 10), torch.randn(32, 1)
    local = [p.detach().clone() for p in model.parameters()]
    model.to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xd, yd = x.to(dev), y.to(dev)
    for _ in range(3):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xd), yd)
        loss.backward()
        opt.step()
    print("device", next(model.parameters()).device, round(loss.item(), 6))
""")


def _run(script: str, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=300)


def _local_loss() -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    x, y = torch.randn(32, 10), torch.randn(32, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    return round(loss.item(), 6)


@pytest.fixture(scope="module")
def server_env():
    with ServerProcess() as server:
        env = {k: v for k, v in os.environ.items() if not k.startswith("REMOTE_ACCEL_")}
        env["REMOTE_ACCEL_RUNTIME_DIR"] = os.environ.get("REMOTE_ACCEL_RUNTIME_DIR", "/tmp/ra-unchanged-none")
        yield server, env


def test_autoload_from_the_environment_trains_on_the_server(server_env):
    server, env = server_env
    env = dict(env, REMOTE_ACCEL_SERVER="%s:%d" % server.tcp, REMOTE_ACCEL_TOKEN=server.token)
    out = _run(TRAIN_WITHOUT_IMPORT, env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["accelerator"] == "True True 1 False"
    device, loss = lines["device"].split()
    assert device == "remote_accel:0"
    assert float(loss) == pytest.approx(_local_loss(), rel=1e-5)


@pytest.mark.parametrize("extra", [{"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}, None], ids=["autoload-off", "unconfigured"])
def test_no_device_without_configuration(server_env, extra):
    server, env = server_env
    if extra is not None:  # configured, but torch's autoload is off
        env = dict(env, REMOTE_ACCEL_SERVER="%s:%d" % server.tcp, REMOTE_ACCEL_TOKEN=server.token, **extra)
    out = _run(TRAIN_WITHOUT_IMPORT, env)
    assert out.returncode == 0, out.stderr[-3000:]
    # no device, and the C++ extension never loaded: an unconfigured process pays nothing
    # (no accelerator at all on a CPU build of torch; a CUDA build names cuda, unavailable here)
    assert out.stdout.splitlines() == ["accelerator False False - False", "extension False"]
    assert "remote_accel" not in out.stderr


def test_a_server_process_is_not_its_own_client(server_env):
    server, env = server_env
    env = dict(env, REMOTE_ACCEL_SERVER="%s:%d" % server.tcp, REMOTE_ACCEL_TOKEN=server.token)
    script = ("import remote_accel.server, torch; dev = torch.accelerator.current_accelerator(); "
              "print(dev is not None and dev.type == 'remote_accel', torch._C._get_privateuse1_backend_name())")
    out = _run(script, env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "False privateuseone"


# the same script, then which link the session took
OVER_WHICH_LINK = TRAIN_WITHOUT_IMPORT + textwrap.dedent("""
    print("link", sys.modules["remote_accel.pytorch_ext.runtime"].session(0).transport.peer.split(":")[0])
""")


@pytest.mark.dpdk
@pytest.mark.any_torch  # the TCP autoload above runs under every torch; this differs only in the link
def test_autoload_over_dpdk_from_the_transport_variable_alone_with_the_local_token_file(needs_dpdk):
    """REMOTE_ACCEL_TRANSPORT=dpdk is all the environment says: the local server's memif
    socket and its token file (in the runtime folder, as a local server writes them) do the
    rest: no REMOTE_ACCEL_SERVER, no REMOTE_ACCEL_TOKEN."""
    with ServerProcess("--transport", "tcp,dpdk", start_timeout=240) as server:
        env = {k: v for k, v in os.environ.items() if not k.startswith("REMOTE_ACCEL_")}
        env.update(REMOTE_ACCEL_TRANSPORT="dpdk", REMOTE_ACCEL_RUNTIME_DIR=server.runtime_dir)
        assert os.path.exists(os.path.join(server.runtime_dir, "token"))  # the local token file
        out = _run(OVER_WHICH_LINK, env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["accelerator"] == "True True 1 False"
    device, loss = lines["device"].split()
    assert device == "remote_accel:0" and lines["link"] == "dpdk"
    assert float(loss) == pytest.approx(_local_loss(), rel=1e-5)


EXPLICIT_INIT_WINS = textwrap.dedent("""
    import sys, torch
    x = torch.ones(3, device="remote_accel")  # connects to the environment's server
    import remote_accel
    first = remote_accel.server_stats()["session"]
    remote_accel.init(transport="tcp", server=sys.argv[1], token=sys.argv[2])
    y = torch.full((3,), 2.0, device="remote_accel")
    print(first != remote_accel.server_stats()["session"], y.cpu().tolist())
""")


def test_explicit_init_replaces_the_environments_session(server_env):
    server, env = server_env
    with ServerProcess() as other:
        env = dict(env, REMOTE_ACCEL_SERVER="%s:%d" % server.tcp, REMOTE_ACCEL_TOKEN=server.token)
        out = _run(EXPLICIT_INIT_WINS, env, "%s:%d" % other.tcp, other.token)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "True [2.0, 2.0, 2.0]"


def test_the_first_use_may_be_torch_tensor(server_env):
    """torch.tensor(x, device=...) builds its tensor below autograd: a connection made
    there (the first use, autoload) still checks its autograd queues with autograd on
    (accelerate's get_max_memory starts with torch.tensor(0, device="remote_accel:0"))."""
    server, env = server_env
    env = dict(env, REMOTE_ACCEL_SERVER="%s:%d" % server.tcp, REMOTE_ACCEL_TOKEN=server.token)
    out = _run("import torch; print(torch.tensor([3.0], device='remote_accel:0').cpu().tolist())", env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[3.0]"

# -- in this process: init() as usual -----------------------------------------------------------
@pytest.fixture(scope="module")
def remote():
    with ServerProcess() as server:
        remote_accel.init(transport="tcp", server="%s:%d" % server.tcp, token=server.token)
        yield server
        remote_accel.shutdown()


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


@pytest.mark.parametrize("options", [{}, {"mode": "reduce-overhead"}, {"mode": "max-autotune"}, {"fullgraph": True},
                                     {"dynamic": True}, {"backend": "remote_accel", "mode": "reduce-overhead"}],
                         ids=["default", "reduce-overhead", "max-autotune", "fullgraph", "dynamic",
                              "remote_accel-reduce-overhead"])
def test_torch_compile_as_users_write_it(remote, options):
    torch._dynamo.reset()
    model = _mlp()
    remote_model = _mlp().to("remote_accel")
    compiled = torch.compile(remote_model, **options)
    for batch in (16, 16, 7):  # a new batch size: dynamic shapes, or a recompile
        x = torch.randn(batch, 10)
        expected = model(x)
        out = compiled(x.to("remote_accel"))
        expected.sum().backward()
        out.sum().backward()
        torch.testing.assert_close(out.cpu(), expected.detach(), rtol=1e-5, atol=1e-5)
    for p, q in zip(model.parameters(), remote_model.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-5, atol=1e-5)


def test_default_backend_compiles_code_that_mixes_cpu_and_remote(remote):
    torch._dynamo.reset()

    def f(a, b):
        return (a * 2).to("remote_accel") + b.sin()

    a, b = torch.randn(8), torch.randn(8)
    out = torch.compile(f)(a, b.to("remote_accel"))
    torch.testing.assert_close(out.cpu(), a * 2 + b.sin())
    # CPU-only graphs still go to Inductor
    torch.testing.assert_close(torch.compile(lambda t: t.cos() + 1)(a), a.cos() + 1)


def test_accelerator_memory_figures(remote):
    torch.accelerator.reset_peak_memory_stats()
    before = torch.accelerator.memory_allocated()
    x = torch.empty(1 << 20, device="remote_accel")
    assert torch.accelerator.memory_allocated() == before + (4 << 20)
    assert torch.accelerator.max_memory_allocated() >= before + (4 << 20)
    stats = torch.accelerator.memory_stats()
    assert stats["allocated_bytes.all.current"] == before + (4 << 20)
    del x
    assert torch.accelerator.memory_allocated() == before
    assert torch.accelerator.max_memory_allocated() >= before + (4 << 20)
    torch.accelerator.reset_peak_memory_stats()
    assert torch.accelerator.max_memory_allocated() == before
    torch.accelerator.empty_cache()
    free, total = torch.accelerator.get_memory_info()
    assert 0 < free <= total
    assert torch.remote_accel.mem_get_info() == pytest.approx((free, total), rel=0.05)


def test_events_time_the_servers_work(remote):
    start = torch.Event(device="remote_accel", enable_timing=True)
    end = torch.remote_accel.Event(enable_timing=True)
    x = torch.randn(256, 256, device="remote_accel")
    start.record()
    for _ in range(30):
        x = torch.tanh(x @ x)
    end.record()
    end.synchronize()
    assert end.query()
    elapsed = start.elapsed_time(end)
    assert elapsed > 0
    # a second interval that does nothing takes less time than the thirty matmuls
    idle_start, idle_end = torch.Event(device="remote_accel", enable_timing=True), torch.Event(
        device="remote_accel", enable_timing=True)
    idle_start.record()
    idle_end.record()
    assert idle_start.elapsed_time(idle_end) < elapsed
    torch.remote_accel.current_stream().wait_event(end)
    torch.accelerator.synchronize()
    never = torch.Event(device="remote_accel", enable_timing=True)
    with pytest.raises(ValueError, match="recorded"):
        never.elapsed_time(end)  # torch's own check, as on CUDA


def test_streams_and_event_waits_as_cuda_code_writes_them(remote):
    """torch.cuda's stream idioms: stream(), wait_stream, default_stream, Event.wait. One
    stream per device runs everything in issue order, so the waits have nothing to order:
    they must be accepted, and the work around them give the results it gives without."""
    x = torch.randn(64, 64)
    xd = x.to("remote_accel")
    side = torch.remote_accel.Stream()
    assert torch.remote_accel.default_stream() == torch.remote_accel.current_stream()
    assert side.device == torch.device("remote_accel:0")
    with torch.remote_accel.stream(side):
        assert torch.remote_accel.current_device() == side.device.index
        y = xd @ xd
    torch.remote_accel.current_stream().wait_stream(side)
    done = torch.Event(device="remote_accel")
    done.record()
    done.wait()  # the current stream waits for it
    done.wait(side)
    side.wait_event(done)
    z = torch.tanh(y)
    torch.testing.assert_close(z.cpu(), torch.tanh(x @ x))
    done.synchronize()
    assert done.query()


def test_activation_checkpointing_gives_the_gradients_of_a_plain_backward(remote):
    """torch.utils.checkpoint, both ways: the forward runs again on the server during
    backward, and the gradients are CPU's."""
    torch.manual_seed(5)
    x, w = torch.randn(16, 32), torch.randn(32, 32)

    def block(a, b):
        return torch.tanh(a @ b).sin() @ b

    (block(x, w.requires_grad_()).square().sum()).backward()
    for reentrant in (False, True):
        wd = w.detach().to("remote_accel").requires_grad_()
        xd = x.to("remote_accel").requires_grad_(reentrant)  # the reentrant form needs an input that requires grad
        out = torch.utils.checkpoint.checkpoint(block, xd, wd, use_reentrant=reentrant)
        out.square().sum().backward()
        torch.testing.assert_close(wd.grad.cpu(), w.grad, rtol=1e-4, atol=1e-4)


def test_torch_func_transforms_give_cpu_s_results(remote):
    """torch.func over device tensors: grad, vmap, jacrev, jvp and functional_call."""
    torch.manual_seed(6)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    xd, wd = x.to("remote_accel"), w.to("remote_accel")

    def loss(b, a):
        return torch.tanh(a @ b).sum()

    torch.testing.assert_close(torch.func.grad(loss)(wd, xd).cpu(), torch.func.grad(loss)(w, x))
    torch.testing.assert_close(torch.func.vmap(lambda row: row @ wd)(xd).cpu(), x @ w)
    torch.testing.assert_close(torch.func.jacrev(torch.sin)(xd[0]).cpu(), torch.func.jacrev(torch.sin)(x[0]))
    _, tangent = torch.func.jvp(torch.sin, (xd,), (torch.ones_like(xd),))
    torch.testing.assert_close(tangent.cpu(), torch.cos(x))
    model = torch.nn.Linear(8, 2)
    params = {name: p.detach().to("remote_accel") for name, p in model.named_parameters()}
    torch.testing.assert_close(torch.func.functional_call(model, params, (xd,)).cpu(), model(x).detach())


def test_device_properties_describe_the_servers_device(remote):
    props = torch.remote_accel.get_device_properties(0)
    assert props.type == "cpu"  # the test server's device
    with open("/proc/cpuinfo") as f:
        models = {line.split(":", 1)[1].strip() for line in f if line.startswith("model name")}
    assert props.name in models | {"cpu"}
    assert torch.remote_accel.get_device_name() == props.name
    assert props.total_memory > 0
    assert torch.remote_accel.get_device_capability(0) == (0, 0)
    assert torch.remote_accel.is_bf16_supported()


def test_pinned_memory_and_non_blocking_uploads(remote):
    data = torch.utils.data.TensorDataset(torch.randn(96, 10), torch.randint(0, 3, (96,)))
    for x, y in torch.utils.data.DataLoader(data, batch_size=32, pin_memory=True):
        assert x.is_pinned() and y.is_pinned()
        assert torch.equal(x.to("remote_accel", non_blocking=True).cpu(), x)
    assert not torch.randn(4).is_pinned()
    big = torch.randn(3 << 20).pin_memory()  # large: sent by the background sender
    assert big.is_pinned() and big[5:].is_pinned()
    uploads = [big.to("remote_accel", non_blocking=True) for _ in range(3)]
    sums = [(u * 2).sum() for u in uploads]
    for u, s in zip(uploads, sums):
        assert torch.equal(u.cpu(), big)
        torch.testing.assert_close(s.cpu(), (big * 2).sum())
