"""Lightning (Trainer and Fabric) on remote_accel, unchanged, against CPU: users' scripts
under autoload (lightning_unchanged.py, run once for the module), and Fabric in this
process after an explicit remote_accel.init(), with Lightning imported before init()."""

from __future__ import annotations

import pytest
import torch

import remote_accel
import unchanged

L = pytest.importorskip("lightning")

FP32, HALF = unchanged.FP32, unchanged.HALF


@pytest.fixture(scope="module")
def runs(remote):
    return unchanged.run("lightning_unchanged.py", remote)


def _on_the_device(run: dict) -> None:
    assert run["strategy"] == "SingleDeviceStrategy(remote_accel:0)"
    assert run["trained_on"] == ["remote_accel:0"]
    assert run["ops"] > 100, "the server ran the training's ops"


def test_trainer_fits_on_the_device(runs):
    run, cpu = runs["32-true"], runs["32-true_cpu"]
    _on_the_device(run)
    assert run["precision"] == "Precision()" and run["dtypes"] == ["float32"]
    assert cpu["strategy"] == "SingleDeviceStrategy(cpu)"
    assert len(run["losses"]) == 8  # 2 epochs of 4 batches
    torch.testing.assert_close(run["losses"], cpu["losses"], **FP32)


def test_bf16_mixed(runs):
    run = runs["bf16-mixed"]
    _on_the_device(run)
    assert run["precision"] == "MixedPrecision(remote_accel)" and run["dtypes"] == ["bfloat16"]
    assert run["scaler"] is None
    torch.testing.assert_close(run["losses"], runs["bf16-mixed_cpu"]["losses"], **HALF)


def test_16_mixed_scales_its_gradients_on_the_device(runs):
    run = runs["16-mixed"]
    _on_the_device(run)
    assert run["precision"] == "MixedPrecision(remote_accel)" and run["dtypes"] == ["float16"]
    assert run["scaler"] == "remote_accel"
    torch.testing.assert_close(run["losses"], runs["16-mixed_cpu"]["losses"], **HALF)


def test_device_stats_report_the_devices_memory(runs):
    # taken in the first training step: the model and a batch are on the device
    for name in ("32-true", "bf16-mixed", "16-mixed"):
        assert runs[name]["allocated"] > 1000, name
    assert runs["32-true_cpu"]["allocated"] is None  # CPUAccelerator reports other figures


def test_checkpoint_and_resume_go_on_with_the_same_losses(runs):
    full, resumed = runs["checkpointed"], runs["resumed"]
    _on_the_device(full)
    _on_the_device(resumed)
    assert full["checkpoints"] == ["epoch=0.ckpt", "epoch=1.ckpt", "epoch=2.ckpt"]
    # resumed from epoch 0's checkpoint: epochs 1 and 2 again, from other initial weights
    assert len(resumed["losses"]) == 8
    torch.testing.assert_close(resumed["losses"], full["losses"][4:], **FP32)


def test_fabric_picks_the_device_by_itself(runs):
    run, cpu = runs["fabric"], runs["fabric_cpu"]
    assert run["device"] == run["trained_on"] == "remote_accel:0"
    assert cpu["device"] == "cpu"
    torch.testing.assert_close(run["losses"], cpu["losses"], **FP32)


def test_pytorch_lightning_package(runs):
    run = runs["pytorch_lightning"]
    _on_the_device(run)
    torch.testing.assert_close(run["losses"], runs["32-true_cpu"]["losses"][:4], **FP32)


def test_fabric_after_explicit_init(remote):
    def train(accelerator):
        fabric = L.Fabric(accelerator=accelerator, devices=1, precision="bf16-mixed")
        torch.manual_seed(0)
        layer = torch.nn.Linear(8, 2)
        model, optimizer = fabric.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        losses = []
        for _ in range(3):
            optimizer.zero_grad()
            loss = model(fabric.to_device(x)).float().square().mean()
            fabric.backward(loss)
            optimizer.step()
            losses.append(loss.item())
        return fabric, losses

    ops = remote_accel.server_stats()["ops_done"]
    fabric, losses = train("remote_accel")
    assert fabric.device == torch.device("remote_accel", 0)
    assert type(fabric._precision).__name__ == "MixedPrecision" and fabric._precision.device == "remote_accel"
    assert remote_accel.server_stats()["ops_done"] > ops
    torch.testing.assert_close(losses, train("cpu")[1], **HALF)


def test_devices_are_parsed_as_for_gpus(remote):
    accelerator = L.pytorch.accelerators.AcceleratorRegistry.get("remote_accel")
    assert accelerator.auto_device_count() == 1
    assert accelerator.parse_devices(1) == accelerator.parse_devices("1") == accelerator.parse_devices(-1) == [0]
    assert accelerator.parse_devices([0]) == accelerator.parse_devices("0,") == [0]
    assert accelerator.get_parallel_devices([0]) == [torch.device("remote_accel", 0)]
    with pytest.raises(ValueError, match=r"devices=2 asks for remote_accel devices \[0, 1\], and this process has 1"):
        accelerator.parse_devices(2)
