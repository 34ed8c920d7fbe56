"""The compatibility matrix's library rows (docs/frameworks.md): each library used as its
documentation shows, on remote_accel and on cpu, with a tiny model built from a config
(nothing from a hub). A diffusers pipeline's inference, a PEFT LoRA fine-tune,
sentence-transformers encoding."""

from __future__ import annotations

import os

import pytest
import torch

import model_check
import remote_accel

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")
sentence_transformers = pytest.importorskip("sentence_transformers")
transformers = pytest.importorskip("transformers")

R = model_check.R


def _ops() -> int:
    return remote_accel.server_stats()["ops_done"]


def test_diffusers_pipeline_inference(remote):
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                                 block_out_channels=(16, 32), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                 up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8)
    pipeline = diffusers.DDPMPipeline(unet=unet, scheduler=diffusers.DDPMScheduler(num_train_timesteps=50))
    pipeline.set_progress_bar_config(disable=True)

    def generate(device):
        pipeline.to(device)  # as the docs do: the pipeline moves, the generator stays on cpu
        return pipeline(batch_size=2, num_inference_steps=3, generator=torch.Generator().manual_seed(0),
                        output_type="np").images

    expected = generate("cpu")
    ops = _ops()
    images = generate(R)
    assert pipeline.unet.device.type == R and _ops() - ops > 100
    assert images.shape == (2, 16, 16, 3)
    assert abs(images - expected).max() < 1e-5


def test_peft_lora_fine_tune(remote):
    config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0,
                           task_type="CAUSAL_LM", init_lora_weights="gaussian")  # B not zero: A learns from step one

    def make():
        return peft.get_peft_model(transformers.GPT2LMHeadModel(config), lora)

    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": t, "labels": t} for t in (torch.randint(0, 96, (2, 12), generator=g) for _ in range(3))]
    runs = model_check.check_training(make, batches, lambda model, batch: model(**batch).loss, tied=1)
    local, remote_run = runs["local"], runs["remote"]
    trained = {n for n, p in remote_run["model"].named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)
    # the adapters moved, the frozen base did not (on the device as on cpu)
    base = "base_model.model.transformer.h.0.attn.c_attn.base_layer.weight"
    torch.testing.assert_close(remote_run["params"][base], local["params"][base])
    assert remote_run["grads"][base] is None


def test_sentence_transformers_encoding(remote, tmp_path):
    words = "the a cat dog sat on mat ran fast sky is blue red".split()
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=len(words) + 5, hidden_size=32,
                                                          num_hidden_layers=2, num_attention_heads=2,
                                                          intermediate_size=64, max_position_embeddings=64))
    bert.save_pretrained(tmp_path)
    transformers.BertTokenizerFast(vocab_file=os.fspath(vocab)).save_pretrained(tmp_path)
    sentences = ["the cat sat on the mat", "a dog ran fast", "the sky is blue", "red cat"]

    def encode(device):
        model = sentence_transformers.SentenceTransformer(os.fspath(tmp_path), device=device)
        return model, model.encode(sentences, batch_size=2, convert_to_tensor=True)

    _, expected = encode("cpu")
    ops = _ops()
    model, embeddings = encode(R)
    assert model.device.type == R and embeddings.device.type == R and _ops() - ops > 20
    torch.testing.assert_close(embeddings.cpu(), expected, rtol=1e-5, atol=1e-5)
