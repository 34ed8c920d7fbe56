"""Hugging Face models (tiny configs, random weights, no downloads) compiled with
`torch.compile(backend="remote_accel")` train with the losses of local eager CPU, both
while the server replays their graphs and once it runs them compiled by Inductor.

Their graphs hold lifted constants (`_tensor_constantN` -> lift_fresh_copy) and buffers
(rotary `inv_freq`, position ids), which travel as tensors.
"""

from __future__ import annotations

import copy
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import remote_accel  # noqa: E402
from remote_accel.pytorch_ext import runtime  # noqa: E402
from remote_accel.server.testing import ServerProcess  # noqa: E402

COMPILE_WAIT_S = 1500
VOCAB = 64


@pytest.fixture(scope="module")
def remote():
    with ServerProcess() as server:
        host, port = server.tcp
        # The server's compiler thread shares its GIL with the session: on a loaded 2-core
        # machine a sync may wait longer than the default 10 s while a graph compiles.
        remote_accel.init(transport="tcp", server=f"{host}:{port}", token=server.token, timeout=120)
        yield server
        remote_accel.shutdown()


def _gpt2():
    # untied head: tied embeddings train differently on remote_accel even in eager mode (a separate bug)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, tie_word_embeddings=False))


def _bert():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        tie_word_embeddings=False))


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32))


def _train(model, device, compiled, steps=3):
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (steps, 2, 16))
    model = model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    forward = torch.compile(model, backend="remote_accel") if compiled else model
    losses = []
    for x in ids:
        opt.zero_grad()
        x = x.to(device)
        loss = forward(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _stats() -> dict:
    return {k: v for k, v in runtime.sessions()[0].stats().items() if k.startswith("graph")}


@pytest.mark.parametrize("make", [_gpt2, _bert, _llama], ids=["gpt2", "bert", "llama"])
def test_hf_model_compiles_and_trains_like_cpu(remote, make):
    torch.manual_seed(0)
    model = make()
    local = _train(copy.deepcopy(model), "cpu", compiled=False)
    before = _stats()
    # The server replays the graphs while its compiler thread works on them...
    assert _train(copy.deepcopy(model), "remote_accel", compiled=True) == pytest.approx(local, rel=1e-4, abs=1e-5)
    sent = _stats()["graphs_cached"] - before["graphs_cached"]
    assert sent >= 2  # a forward and a backward at least
    deadline = time.monotonic() + COMPILE_WAIT_S
    while True:
        stats = _stats()
        done = (stats["graph_compiles"] - before["graph_compiles"]
                + stats["graph_compile_failures"] - before["graph_compile_failures"])
        if done >= sent or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    # ...and runs them compiled once it is done: the same losses again.
    assert _train(copy.deepcopy(model), "remote_accel", compiled=True) == pytest.approx(local, rel=1e-4, abs=1e-5)
    after = _stats()
    assert after["graphs_compiled"] - before["graphs_compiled"] >= 1, after
    # every graph compiles (GPT-2's forward once failed Dynamo's retrace on a view)
    assert after["graph_compile_failures"] == before["graph_compile_failures"], after
    assert after["graph_runs_compiled"] > stats["graph_runs_compiled"], after
