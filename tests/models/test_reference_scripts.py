"""Public training scripts that no package ships, run as their users run them, against CPU:
timm's `train.py` (at the root of the pytorch-image-models repository) and torchvision's
`references/classification/train.py` (in the pytorch/vision repository).

Neither is in a wheel or an sdist (timm's sdist has the package and its tests; PyPI has
no torchvision sdist since 0.1.x), and this repository does not copy other projects'
scripts. So each test runs the script of a checkout named by an environment variable,
and skips, saying how to run it, where none is named:

    REMOTE_ACCEL_TIMM_TRAIN=/path/to/pytorch-image-models/train.py
    REMOTE_ACCEL_TORCHVISION_TRAIN=/path/to/vision/references/classification/train.py

Each script runs twice, `--device cpu` and `--device remote_accel` (the server from the
environment: the script never imports remote_accel), on a small ImageFolder this test
writes, a tiny model and one short epoch; both runs must end with the same parameters
(their checkpoints) and the same losses.
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys

import pytest
import torch

import unchanged
from remote_accel.server.testing import Client

TIMEOUT_S = 300


_COLOURS = (("a", (200, 40, 40)), ("b", (40, 40, 200)), ("c", (40, 200, 40)), ("d", (200, 200, 40)),
            ("e", (200, 40, 200)))


def _image_folder(root, splits=("train", "validation"), classes=2, images=8) -> str:
    """`classes` classes of `images` small images per split, colours with noise (PIL, as ImageFolder reads)."""
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for split in splits:
        for label, colour in _COLOURS[:classes]:
            folder = os.path.join(root, split, label)
            os.makedirs(folder, exist_ok=True)
            for i in range(images):
                pixels = (torch.tensor(colour).view(1, 1, 3) + torch.randint(-40, 40, (40, 40, 3), generator=g))
                Image.fromarray(pixels.clamp(0, 255).to(torch.uint8).numpy()).save(os.path.join(folder, f"{i}.png"))
    return str(root)


def _script(variable: str, what: str) -> str:
    path = os.environ.get(variable)
    if not path:
        pytest.skip(f"{what} is in no package (neither wheel nor sdist) and is not copied here: set {variable} to "
                    "the script of a checkout to run this row (docs/frameworks.md, compatibility matrix)")
    assert os.path.isfile(path), f"{variable}={path}: no such file"
    return path


def _server_ops(server) -> int:
    """The server's ops, every session's (a STATS round trip of a client of its own)."""
    host, port = server.tcp
    with Client.tcp(host, port, token=server.token) as client:
        return client.stats()["server_ops_done"]


def _run(command: list, server, cwd: str) -> tuple:
    """The script's output, and how many ops the server ran meanwhile."""
    env = dict(unchanged.clean_environment(), REMOTE_ACCEL_SERVER="%s:%d" % server.tcp,
               REMOTE_ACCEL_TOKEN=server.token, REMOTE_ACCEL_TRANSPORT="tcp")
    before = _server_ops(server)
    out = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    return out.stdout + out.stderr, _server_ops(server) - before


def _parameters(checkpoint: str) -> dict:
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    state = state.get("state_dict", state.get("model", state))
    return {k: v.float() for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point()}


def _same_parameters(cpu: dict, remote: dict) -> float:
    assert cpu.keys() == remote.keys() and cpu
    return max((cpu[k] - remote[k]).abs().max().item() for k in cpu)


def test_timm_train_py(remote, tmp_path):
    script = _script("REMOTE_ACCEL_TIMM_TRAIN", "timm's train.py")
    data = _image_folder(tmp_path / "data")
    runs = {}
    # --workers 1, not 0: timm's create_loader up to 1.0.29.dev0 passes persistent_workers=True whatever the count
    # of workers, which DataLoader refuses with none ("persistent_workers option needs num_workers > 0")
    for device in ("cpu", "remote_accel"):
        output = tmp_path / device
        log, ops = _run([sys.executable, script, "--data-dir", data, "--model", "test_resnet", "--num-classes", "2",
                    "--img-size", "32", "-b", "4", "--epochs", "1", "--device", device, "--workers", "1",
                    "--opt", "sgd", "--lr", "0.05", "--warmup-epochs", "0", "--no-aug", "--log-interval", "1",
                    "--seed", "0", "--output", str(output), "--experiment", "run", "--checkpoint-hist", "1"],
                   remote, str(tmp_path))
        with open(output / "run" / "summary.csv") as f:
            summary = list(csv.DictReader(f))
        runs[device] = {"log": log, "ops": ops, "summary": summary[-1],
                        "parameters": _parameters(str(output / "run" / "last.pth.tar"))}
    remote_run, cpu = runs["remote_accel"], runs["cpu"]
    # the scenario: one process on the device, the steps of one epoch (16 images, 4 a step)
    assert "Training with a single process on 1 device (remote_accel)" in remote_run["log"], remote_run["log"][-3000:]
    assert len(re.findall(r"Train: 0 \[", remote_run["log"])) == 4
    assert remote_run["ops"] > 1000 and cpu["ops"] == 0, (remote_run["ops"], cpu["ops"])  # the server trained it
    difference = _same_parameters(cpu["parameters"], remote_run["parameters"])
    print(f"timm train.py: remote_accel {dict(remote_run['summary'])}, cpu {dict(cpu['summary'])}, "
          f"parameters {difference:.3g} apart")
    for key in ("train_loss", "eval_loss", "eval_top1"):
        assert abs(float(remote_run["summary"][key]) - float(cpu["summary"][key])) <= 1e-4, (key, remote_run["summary"],
                                                                                          cpu["summary"])
    assert difference <= 1e-5


def test_torchvision_reference_classification_train_py(remote, tmp_path):
    script = _script("REMOTE_ACCEL_TORCHVISION_TRAIN", "torchvision's references/classification/train.py")
    # five classes: the script measures top-5 accuracy (`topk=(1, 5)`), which needs at least five
    data = _image_folder(tmp_path / "data", splits=("train", "val"), classes=5, images=4)
    # the script does not seed torch: both runs start from one seed (its own folder on sys.path, as `python train.py`)
    seeded = ("import runpy, sys, torch; torch.manual_seed(0); sys.path.insert(0, sys.argv[1]); "
              "sys.argv = sys.argv[1:]; sys.argv[0] = sys.argv[0] + '/train.py'; "
              "runpy.run_path(sys.argv[0], run_name='__main__')")
    runs = {}
    for device in ("cpu", "remote_accel"):
        output = tmp_path / device
        log, ops = _run([sys.executable, "-c", seeded, os.path.dirname(script), "--data-path", data, "--model", "resnet18",
                    "--device", device, "-b", "4", "--epochs", "1", "-j", "0", "--lr", "0.01", "--print-freq", "1",
                    "--train-crop-size", "32", "--val-resize-size", "32", "--val-crop-size", "32",
                    "--output-dir", str(output)], remote, str(tmp_path))
        runs[device] = {"log": log, "ops": ops, "parameters": _parameters(str(output / "checkpoint.pth")),
                        "losses": [float(v) for v in re.findall(r"loss: ([0-9.]+) \(", log)]}
    remote_run, cpu = runs["remote_accel"], runs["cpu"]
    assert "device='remote_accel'" in remote_run["log"]
    assert remote_run["ops"] > 1000 and cpu["ops"] == 0, (remote_run["ops"], cpu["ops"])  # the server trained it
    assert len(remote_run["losses"]) >= 4
    difference = _same_parameters(cpu["parameters"], remote_run["parameters"])
    print(f"torchvision train.py: losses {remote_run['losses']} (cpu {cpu['losses']}), parameters {difference:.3g} apart")
    torch.testing.assert_close(remote_run["losses"], cpu["losses"], rtol=1e-4, atol=1e-4)
    assert difference <= 1e-5
