"""transformers' Trainer and accelerate on remote_accel, unchanged, against CPU: a user's
script under autoload (hf_unchanged.py, run once for the module), and a Trainer in this
process after an explicit remote_accel.init() (the `remote` fixture), with transformers
imported before init()."""

from __future__ import annotations

import pytest
import torch

import remote_accel
import unchanged

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

FP32, HALF = unchanged.FP32, unchanged.HALF


@pytest.fixture(scope="module")
def runs(remote):
    return unchanged.run("hf_unchanged.py", remote)


def _on_the_device(run: dict) -> None:
    assert run["device"].startswith("remote_accel")
    assert run["trained_on"] in (["remote_accel:0"], "remote_accel:0")
    assert run["ops"] > 100, "the server ran the training's ops"


def test_trainer_with_default_arguments_trains_on_the_device(runs):
    run, cpu = runs["fp32"], runs["fp32_cpu"]
    _on_the_device(run)
    assert cpu["trained_on"] == ["cpu"] and cpu["ops"] == 0  # use_cpu=True still means cpu
    assert len(run["losses"]) == 4
    torch.testing.assert_close(run["losses"], cpu["losses"], **FP32)


def test_trainer_bf16(runs):
    run = runs["bf16"]
    _on_the_device(run)
    assert run["dtypes"] == ["bfloat16"] and run["scaler"] is None
    torch.testing.assert_close(run["losses"], runs["bf16_cpu"]["losses"], **HALF)


def test_trainer_fp16_scales_its_gradients_on_the_device(runs):
    run = runs["fp16"]
    _on_the_device(run)
    assert run["dtypes"] == ["float16"]
    assert run["scaler"]["device"] == "remote_accel" and 1 <= run["scaler"]["scale"] < float("inf")
    torch.testing.assert_close(run["losses"], runs["fp32_cpu"]["losses"], **HALF)


def test_accelerate_loop(runs):
    run, cpu = runs["accelerate"], runs["accelerate_cpu"]
    _on_the_device(run)
    assert cpu["device"] == "cpu" and run["seeded"] and cpu["seeded"]
    torch.testing.assert_close(run["losses"], cpu["losses"], **FP32)
    fp16 = runs["accelerate_fp16"]
    _on_the_device(fp16)
    assert fp16["scaler"] == "remote_accel"
    torch.testing.assert_close(fp16["losses"], cpu["losses"], **HALF)


def test_device_map_auto_places_the_model_on_the_device(runs):
    placed = runs["device_map"]
    assert placed["devices"] == ["remote_accel:0"]
    assert placed["max_difference"] < 1e-5


def test_trainer_after_explicit_init(remote, tmp_path):
    def train(**options):
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                         bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
        g = torch.Generator().manual_seed(1)
        data = [{"input_ids": t, "labels": t} for t in torch.randint(0, 64, (6, 8), generator=g)]
        args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                                              logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
                                              **options)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        ops = remote_accel.server_stats()["ops_done"]
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return args.device, remote_accel.server_stats()["ops_done"] - ops, losses

    device, ops, losses = train()
    assert device.type == "remote_accel" and ops > 100
    cpu_device, cpu_ops, cpu_losses = train(use_cpu=True)
    assert cpu_device.type == "cpu"
    torch.testing.assert_close(losses, cpu_losses, **FP32)
