"""torch.profiler with ProfilerActivity.PrivateUse1 (issue #34 item 6): the server's own
execution of each op and compiled graph shows as the device's events, in the client's
time, beside the client's CPU events; a profile of the CPU alone asks the server nothing."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile
from torch.utils import cpp_extension

import remote_accel
from remote_accel.pytorch_ext._native import load
from remote_accel.server.testing import ServerProcess

#: the headers whose presence decides, when the C++ device is compiled, whether the profiler
#: is built in (pytorch_ext/csrc/profiler.cpp's __has_include)
REGISTRY_HEADERS = ("torch/csrc/profiler/standalone/privateuse1_profiler.h", "kineto/IActivityProfiler.h")


def _torch_has_the_registry() -> bool:
    include = cpp_extension.include_paths()[0]  # torch's own include folder
    return all(os.path.exists(os.path.join(include, header)) for header in REGISTRY_HEADERS)


@pytest.fixture(autouse=True)
def profiler_built(require_in_ci):
    """A torch without the registry (< 2.10) is a reason to skip; a torch that has it and
    a build that compiled the profiler out is a broken build, which CI must not skip."""
    if load().profiler_available():
        return
    if not _torch_has_the_registry():
        pytest.skip(f"torch {torch.__version__} has no PrivateUse1 profiler registry (torch < 2.10)")
    require_in_ci(f"the profiler was compiled out although torch {torch.__version__} has its registry headers "
                  f"({', '.join(REGISTRY_HEADERS)}): rebuild remote_accel")


@pytest.fixture(scope="module")
def connected():
    with ServerProcess("--threads", "1") as server:
        remote_accel.init(transport="tcp", server="%s:%d" % server.tcp, token=server.token)
        try:
            yield server
        finally:
            remote_accel.shutdown()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).to("remote_accel")


def _device_events(prof) -> list:
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.PrivateUse1]


def test_each_remote_op_shows_its_server_time_beside_the_client_events(connected, tmp_path):
    model, x = _model(), torch.randn(128, 64).to("remote_accel")
    model(x).sum().item()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
        loss = model(x).sum()
        loss.backward()
        loss.item()
    names = {e.name for e in _device_events(prof)}
    for op in ("aten::addmm", "aten::relu", "aten::sum", "aten::mm", "aten::threshold_backward"):
        assert f"remote_accel: {op}" in names, names
    averages = {a.key: a for a in prof.key_averages()}
    assert averages["remote_accel: aten::addmm"].self_device_time_total > 0
    assert averages["aten::linear"].cpu_time_total > 0  # the client's side is still there
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    client = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "cpu_op"]
    server = [(e["ts"], e["ts"] + e["dur"]) for e in events
              if str(e.get("name", "")).startswith("remote_accel: ")]
    # in the client's time: within the window from the first client event's start to the
    # last one's end (the client's item() waits for the server's last op, so that op may
    # start after every client event started); a clock off by seconds, or the server's own
    # clock base, would put them far outside
    window = (min(start for start, _ in client), max(end for _, end in client))
    spans = (min(start for start, _ in server), max(end for _, end in server))
    assert window[0] - 5e3 <= spans[0] and spans[1] <= window[1] + 5e3, (window, spans)


def test_a_compiled_graph_shows_its_server_execution(connected):
    model, x = torch.compile(_model(), backend="remote_accel"), torch.randn(128, 64).to("remote_accel")
    for _ in range(2):
        model(x).sum().item()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
        model(x).sum().item()
    assert _device_events(prof), [e.name for e in prof.events()][:40]
    assert sum(e.self_device_time_total for e in prof.key_averages()) > 0


def test_a_cpu_profile_leaves_the_server_alone(connected):
    x = torch.randn(16, device="remote_accel")
    before = remote_accel.stats()["round_trips"]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y = x * 2
    assert not _device_events(prof)
    assert remote_accel.stats()["round_trips"] == before
    assert torch.equal(y.cpu(), x.cpu() * 2)
