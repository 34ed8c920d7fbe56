"""Tiny Hugging Face transformers (random weights, built from configs): GPT-2, BERT,
Llama, T5, trained 3 AdamW steps on remote_accel against CPU."""

from __future__ import annotations

import pytest
import torch

import model_check

transformers = pytest.importorskip("transformers")

VOCAB = 96
STEPS = model_check.STEPS


def _tokens(seed: int, batch: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _lm_batches():
    return [{"input_ids": t, "labels": t} for t in (_tokens(i) for i in range(STEPS))]


def _hf_loss(model, batch):
    return model(**batch).loss


def test_gpt2_keeps_tied_embeddings(remote):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    runs = model_check.check_training(lambda: transformers.GPT2LMHeadModel(config), _lm_batches(), _hf_loss, tied=1)
    model = runs["remote"]["model"]
    assert model.lm_head.weight is model.transformer.wte.weight


def test_bert_masked_lm(remote):
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    batches = []
    for i in range(STEPS):
        ids = _tokens(10 + i)
        labels = torch.full_like(ids, -100)
        labels[:, ::3] = ids[:, ::3]  # a third of the positions are predicted
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    runs = model_check.check_training(lambda: transformers.BertForMaskedLM(config), batches, _hf_loss, tied=2)
    model = runs["remote"]["model"]
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight


def test_llama(remote):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model_check.check_training(lambda: transformers.LlamaForCausalLM(config), _lm_batches(), _hf_loss)


def test_t5_keeps_shared_embeddings(remote):
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    batches = [{"input_ids": _tokens(20 + i), "labels": _tokens(30 + i, length=8)} for i in range(STEPS)]
    runs = model_check.check_training(lambda: transformers.T5ForConditionalGeneration(config), batches, _hf_loss,
                                      tied=1)
    model = runs["remote"]["model"]
    shared = model.shared.weight
    assert model.encoder.embed_tokens.weight is shared and model.decoder.embed_tokens.weight is shared
    assert model.lm_head.weight is shared


def test_gpt2_greedy_generate_gives_cpu_tokens(remote):
    """Inference as users run it: generate() waits at every token (a stopping check reads
    the new tokens) and builds its inputs with arange, cat and cumsum on the device."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                     eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    prompt = _tokens(40, batch=2, length=6)
    settings = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompt))
    with torch.no_grad():
        expected = model.generate(prompt, **settings)
        model.to("remote_accel")
        got = model.generate(prompt.to("remote_accel"), **{k: v.to("remote_accel") if torch.is_tensor(v) else v
                                                          for k, v in settings.items()})
    assert got.device.type == "remote_accel"
    assert torch.equal(got.cpu(), expected) and expected.shape == (2, 18)
