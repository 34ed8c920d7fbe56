"""End to end: models larger than the server's device memory (--device-memory) train
when it may swap to host memory (--swap-space), with the losses of a CPU run; without
swap space they fail with torch.OutOfMemoryError and the session goes on.

Clients are processes of their own (swap_client.py): one client process holds one
session, and three of them share the server's device memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from remote_accel.server.testing import ServerProcess

pytestmark = pytest.mark.any_torch

CLIENT = os.path.join(os.path.dirname(__file__), "swap_client.py")
MB = 1 << 20


def run_clients(server: ServerProcess, *arg_lists, timeout: float = 900) -> list:
    host, port = server.tcp
    procs = [subprocess.Popen([sys.executable, CLIENT, "--server", f"{host}:{port}", "--token", server.token,
                               *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, **server.client_env()))
             for args in arg_lists]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"client failed:\n{err}\nserver log:\n{server.log()[-4000:]}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def param_bytes(width: int, layers: int) -> int:
    return 4 * (layers * (width * width + width) + width + 1)


def check_losses(result: dict) -> None:
    torch.testing.assert_close(torch.tensor(result["remote"]), torch.tensor(result["cpu"]), rtol=1e-4, atol=1e-6)


def test_mlp_of_800mb_trains_on_64mb_with_swap_space():
    width, layers = 2048, 12
    state = 4 * param_bytes(width, layers)  # weights, gradients, AdamW's two moments
    assert 750e6 < state < 850e6  # ~800 MB
    with ServerProcess("--device-memory", "64M", "--swap-space", "2G") as server:
        (result,) = run_clients(server, ["--width", str(width), "--layers", str(layers), "--steps", "2"])
        check_losses(result)
        stats = result["stats"]
        # memory_allocated counts what the client holds, not what is on the device
        assert result["memory_allocated"] >= state
        assert stats["server_device_memory"] == 64 * MB and stats["server_swap_space"] == 2 << 30
        assert stats["swap_outs"] > 0 and stats["swap_ins"] > 0
        assert stats["swapped_out_bytes"] > 0
        assert stats["swapped_out_bytes"] <= stats["swap_out_bytes"]
        assert stats["prefetch_hits"] > 0  # the batch's next ops were looked at
        assert stats["server_resident_bytes"] + stats["server_swapped_bytes"] >= state
        # once the model is gone, nothing of it stays swapped out
        assert result["after"]["swapped_out_bytes"] == 0
        assert result["after"]["server_swapped_bytes"] == 0
        server.stop()
        assert "swap: " in server.log() and "prefetch hits" in server.log()
        assert "Traceback" not in server.log()


def test_three_clients_together_over_device_memory_all_finish():
    width, layers = 1024, 6
    assert 3 * 4 * param_bytes(width, layers) > 4 * 64 * MB
    with ServerProcess("--device-memory", "64M", "--swap-space", "1G") as server:
        results = run_clients(server, *[["--width", str(width), "--layers", str(layers), "--steps", "2",
                                         "--seed", str(seed)] for seed in range(3)])
        for result in results:
            check_losses(result)
            assert result["stats"]["swap_outs"] > 0
        assert results[0]["cpu"] != results[1]["cpu"]  # three different models
        assert "Traceback" not in server.log()


def test_without_swap_space_the_model_is_out_of_memory_and_the_session_goes_on():
    with ServerProcess("--device-memory", "64M") as server:
        (result,) = run_clients(server, ["--width", "2048", "--layers", "12", "--expect-oom"])
        assert result["raised"] == "OutOfMemoryError"
        assert "device memory" in result["message"]
        assert result["after"] == [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]
        assert "Traceback" not in server.log()


@pytest.mark.parametrize("option", ["--device-memory", "--swap-space"])
def test_size_options_refuse_bad_values(option):
    proc = subprocess.run([sys.executable, "-m", "remote_accel.server", "--", option, "lots"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "bad size" in proc.stderr
