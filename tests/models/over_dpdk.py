"""Client process of test_dpdk.py (one DPDK EAL per process): GPT-2 with its tied
embeddings and torchvision's nms on remote_accel over DPDK memif, against CPU.

Usage: over_dpdk.py TOKEN; prints the transport's peer, exits 0 when everything agreed."""

from __future__ import annotations

import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torchvision  # noqa: E402
import transformers  # noqa: E402

import model_check  # noqa: E402
import remote_accel  # noqa: E402


def main() -> int:
    # init before any backward: autograd makes its per-device queues at the first one
    remote_accel.init(transport="dpdk", port=0, token=sys.argv[1], timeout=60)
    print("peer", remote_accel.pytorch_ext.runtime.sessions()[0].transport.peer, flush=True)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": t, "labels": t} for t in (torch.randint(0, 64, (2, 10), generator=g) for _ in range(3))]
    model_check.check_training(lambda: transformers.GPT2LMHeadModel(config), batches,
                               lambda model, batch: model(**batch).loss, tied=1)
    xy = torch.rand(80, 2, generator=g) * 40
    boxes, scores = torch.cat([xy, xy + 10], dim=1), torch.rand(80, generator=g)
    keep = torchvision.ops.nms(boxes.to(model_check.R), scores.to(model_check.R), 0.4)
    assert torch.equal(keep.cpu(), torchvision.ops.nms(boxes, scores, 0.4))
    remote_accel.shutdown()
    print("agreed", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
