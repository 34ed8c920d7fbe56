"""An HF script as users write it for several processes, which never imports remote_accel:
every rank sees the servers REMOTE_ACCEL_SERVER names (autoload) and accelerate gives it
remote_accel:LOCAL_RANK. Run by test_frameworks_multi.py as

    accelerate launch --num_processes 2 hf_multi.py accelerate,trainer   (or torchrun --nproc_per_node 2 ...)
    python hf_multi.py alone      (no server: one process on cpu, the whole batch: what the ranks must match)

- "accelerate": an `Accelerator()` loop (an MLP, AdamW, a DataLoader that accelerate
  shards across the ranks), against the same loop in plain torch on cpu over the whole
  batch, run by each rank beside it;
- "trainer": transformers' `Trainer`, default arguments, a tiny GPT-2, 2 sequences a rank
  a step; its losses are compared by the test with `alone`'s (4 a step, one process).

Each rank writes its JSON result to rank<r>.json in $MULTI_RESULTS (the ranks' lines
on one stdout can run into each other).
"""

from transformers import TrainingArguments  # isort: skip  (torch's autoload comes while it runs)

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback

VOCAB = 96
STEPS = 4
PER_RANK = 2  # sequences per rank and step (the Trainer); 4 rows per rank and step (the loop)


def collectives() -> int:
    device = getattr(torch, "remote_accel", None)  # none on a machine that names no server
    return device.stats().get("collectives", 0) if device is not None and device.is_initialized() else 0


def accelerate_loop() -> dict:
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator()
    world = accelerator.num_processes
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    alone = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    alone.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(STEPS * 4 * world, 16, generator=g), torch.randn(STEPS * 4 * world, 1, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_alone = torch.optim.AdamW(alone.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    before, losses, losses_alone = collectives(), [], []
    for step, (xb, yb) in enumerate(loader):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        optimizer.step()
        losses.append(accelerator.gather(loss.detach()[None]).mean().item())  # the ranks' mean: the batch's loss
        # one process, the whole batch of this step: the rows every rank took (accelerate
        # gives rank r the r-th batch of each group of `world` batches)
        rows = slice(step * 4 * world, (step + 1) * 4 * world)
        opt_alone.zero_grad()
        loss_alone = torch.nn.functional.mse_loss(alone(x[rows]), y[rows])
        loss_alone.backward()
        opt_alone.step()
        losses_alone.append(loss_alone.item())
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    difference = max((p.detach().cpu() - q.detach()).abs().max().item()
                     for p, q in zip(unwrapped.parameters(), alone.parameters()))
    return {"device": str(accelerator.device), "distributed_type": str(accelerator.distributed_type),
            "backend": accelerator.state.backend, "world": world, "ddp": type(model).__name__,
            "trained_on": str(next(unwrapped.parameters()).device), "losses": losses, "losses_alone": losses_alone,
            "parameter_difference": difference, "collectives": collectives() - before}


class Seen(TrainerCallback):
    def __init__(self):
        self.devices = set()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.devices.add(str(next(model.parameters()).device))


def trainer(batch: int, **options) -> dict:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0))
    g = torch.Generator().manual_seed(1)
    texts = [{"input_ids": t, "labels": t} for t in torch.randint(0, VOCAB, (4 * STEPS, 12), generator=g)]
    with tempfile.TemporaryDirectory() as folder:
        args = TrainingArguments(output_dir=folder, max_steps=STEPS, per_device_train_batch_size=batch,
                                 logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, **options)
        seen = Seen()
        run = Trainer(model=model, args=args, train_dataset=texts, callbacks=[seen])
        before = collectives()
        run.train()
        weights = run.accelerator.unwrap_model(run.model).lm_head.weight.detach().cpu()
    return {"device": str(args.device), "parallel_mode": str(args.parallel_mode), "world": args.world_size,
            "distributed_type": str(run.accelerator.distributed_type), "ddp": type(run.model_wrapped).__name__,
            "trained_on": sorted(seen.devices), "losses": [h["loss"] for h in run.state.log_history if "loss" in h],
            "weights": weights.flatten()[:64].tolist(), "collectives": collectives() - before}


def main() -> int:
    what = sys.argv[1].split(",")
    if what == ["alone"]:  # one process, cpu, the whole global batch of two ranks
        print("ALONE " + json.dumps(trainer(2 * PER_RANK, use_cpu=True)), flush=True)
        return 0
    results = {}
    if "accelerate" in what:
        results["accelerate"] = accelerate_loop()
    if "trainer" in what:
        results["trainer"] = trainer(PER_RANK)
    rank = dist.get_rank()
    with open(os.path.join(os.environ["MULTI_RESULTS"], f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
