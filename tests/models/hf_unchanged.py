"""An HF training script as users write it, which never imports remote_accel: the device
comes from the environment (REMOTE_ACCEL_SERVER, autoload). Run by test_frameworks_hf.py.

Each run twice, on the device torch and accelerate choose and on cpu (`use_cpu=True`,
`Accelerator(cpu=True)`): transformers' Trainer with default TrainingArguments (fp32), with
bf16=True and with fp16=True (GradScaler); an accelerate.Accelerator() loop; a model
loaded with device_map="auto". Prints one JSON line: what each run saw and its losses.
"""

# First, before torch: importing TrainingArguments imports torch from inside
# transformers.training_args, whose autoload comes while that module is still running
# (remote_accel.frameworks must adapt it once it has run).
from transformers import TrainingArguments  # isort: skip

import json
import sys
import tempfile

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import set_seed
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback

VOCAB = 96
STEPS = 4


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))


def texts() -> list:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": t, "labels": t} for t in torch.randint(0, VOCAB, (16, 12), generator=g)]


def ops_done() -> int:
    """The server's count of ops run for this process (0 before it connected)."""
    device = torch.get_device_module("remote_accel")
    return device.server_stats()["ops_done"] if device.is_initialized() else 0


class Seen(TrainerCallback):
    """Where the parameters were while the Trainer trained."""

    def __init__(self):
        self.devices = set()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.devices.add(str(next(model.parameters()).device))


def trainer(output_dir: str, **options) -> dict:
    model = gpt2()
    dtypes = set()  # the logits' dtype: autocast's work
    model.lm_head.register_forward_hook(lambda module, inputs, out: dtypes.add(str(out.dtype).split(".")[1]))
    args = TrainingArguments(output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=4, logging_steps=1,
                             report_to=[], save_strategy="no", disable_tqdm=True, **options)
    seen = Seen()
    run = Trainer(model=model, args=args, train_dataset=texts(), callbacks=[seen])
    ops = ops_done()
    run.train()
    scaler = run.accelerator.scaler
    return {"device": str(args.device), "trained_on": sorted(seen.devices), "dtypes": sorted(dtypes),
            "losses": [h["loss"] for h in run.state.log_history if "loss" in h], "ops": ops_done() - ops,
            "scaler": None if scaler is None else {"device": scaler._device, "scale": scaler.get_scale()}}


def accelerate_loop(cpu: bool, mixed_precision: str = "no") -> dict:
    AcceleratorState._reset_state(reset_partial_state=True)  # a second Accelerator in one process
    accelerator = Accelerator(cpu=cpu, mixed_precision=mixed_precision)
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g))
    model, optimizer, loader = accelerator.prepare(model, optimizer, torch.utils.data.DataLoader(data, batch_size=16))
    ops, losses = ops_done(), []
    for x, y in loader:
        optimizer.zero_grad()
        with accelerator.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        accelerator.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    # set_seed seeds the device's generator too
    set_seed(3)
    first = torch.randn(4, device=accelerator.device).cpu()
    set_seed(3)
    again = torch.randn(4, device=accelerator.device).cpu()
    return {"device": str(accelerator.device), "trained_on": str(next(model.parameters()).device),
            "losses": losses, "ops": ops_done() - ops, "seeded": torch.equal(first, again),
            "scaler": None if accelerator.scaler is None else accelerator.scaler._device}


def device_map_auto(folder: str) -> dict:
    gpt2().save_pretrained(folder)
    placed = GPT2LMHeadModel.from_pretrained(folder, device_map="auto")
    local = GPT2LMHeadModel.from_pretrained(folder)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    device = next(placed.parameters()).device
    with torch.no_grad():
        difference = (placed(ids.to(device)).logits.cpu() - local(ids).logits).abs().max().item()
    return {"devices": sorted({str(p.device) for p in placed.parameters()}), "max_difference": difference}


def main() -> int:
    with tempfile.TemporaryDirectory() as folder:
        results = {
            "fp32": trainer(folder), "fp32_cpu": trainer(folder, use_cpu=True),
            "bf16": trainer(folder, bf16=True), "bf16_cpu": trainer(folder, bf16=True, use_cpu=True),
            "fp16": trainer(folder, fp16=True),
            "accelerate": accelerate_loop(cpu=False), "accelerate_cpu": accelerate_loop(cpu=True),
            "accelerate_fp16": accelerate_loop(cpu=False, mixed_precision="fp16"),
            "device_map": device_map_auto(folder),
        }
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
