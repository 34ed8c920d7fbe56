"""Lightning scripts as users write them, which never import remote_accel: the device comes
from the environment (REMOTE_ACCEL_SERVER, autoload). Run by test_frameworks_lightning.py.

`Trainer(accelerator="remote_accel", devices=1)` fits in fp32, "bf16-mixed" and
"16-mixed", each against the same fit with accelerator="cpu"; `ModelCheckpoint` saves
each epoch and a fit resumed from the first checkpoint goes on; `Fabric()` (accelerator
"auto") trains; `pytorch_lightning`, the standalone package, fits too. Prints one JSON
line: what each run saw and its losses.
"""

import json
import os
import sys
import tempfile

import lightning as L
import pytorch_lightning
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

EPOCHS = 2


def regression_data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=16)


def regression_module(base):
    class Regression(base):
        """A small MLP; records each step's loss, where it ran, the output's dtype and, once,
        the accelerator's device stats."""

        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
            self.losses, self.devices, self.dtypes, self.stats = [], set(), set(), None

        def training_step(self, batch, index):
            x, y = batch
            out = self.net(x)
            loss = torch.nn.functional.mse_loss(out.float(), y)
            self.losses.append(loss.detach())
            self.devices.add(str(self.net[0].weight.device))
            self.dtypes.add(str(out.dtype).split(".")[1])
            if self.stats is None:
                self.stats = self.trainer.accelerator.get_device_stats(self.device)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Regression


def ops_done() -> int:
    device = torch.get_device_module("remote_accel")
    return device.server_stats()["ops_done"] if device.is_initialized() else 0


def fit(package, accelerator: str, precision: str = "32-true", epochs: int = EPOCHS, folder=None, resume=None,
        seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = regression_module(package.LightningModule)()
    callbacks = [] if folder is None else [ModelCheckpoint(dirpath=folder, filename="{epoch}", save_top_k=-1)]
    trainer = package.Trainer(accelerator=accelerator, devices=1, max_epochs=epochs, precision=precision,
                              logger=False, enable_checkpointing=folder is not None, callbacks=callbacks,
                              enable_progress_bar=False, enable_model_summary=False, default_root_dir=folder)
    ops = ops_done()
    trainer.fit(model, regression_data(), ckpt_path=resume)
    plugin = trainer.precision_plugin
    stats = model.stats or {}
    return {"strategy": f"{type(trainer.strategy).__name__}({trainer.strategy.root_device})",
            "precision": f"{type(plugin).__name__}({getattr(plugin, 'device', '')})",
            "scaler": getattr(getattr(plugin, "scaler", None), "_device", None),
            "trained_on": sorted(model.devices), "dtypes": sorted(model.dtypes),
            "losses": [loss.item() for loss in model.losses], "ops": ops_done() - ops,
            "allocated": stats.get("allocated_bytes.all.current"),
            "checkpoints": sorted(os.listdir(folder)) if folder else []}


def fabric_loop(**options) -> dict:
    fabric = L.Fabric(devices=1, **options)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    losses = []
    for x, y in fabric.setup_dataloaders(regression_data()):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    return {"device": str(fabric.device), "trained_on": str(next(model.parameters()).device), "losses": losses}


def main() -> int:
    results = {}
    for precision in ("32-true", "bf16-mixed", "16-mixed"):
        results[precision] = fit(L, "remote_accel", precision)
        results[precision + "_cpu"] = fit(L, "cpu", "32-true" if precision == "16-mixed" else precision)
    with tempfile.TemporaryDirectory() as folder:
        results["checkpointed"] = fit(L, "remote_accel", epochs=3, folder=folder)
        # another start (other weights) resumed from the first epoch's checkpoint
        results["resumed"] = fit(L, "remote_accel", epochs=3, resume=os.path.join(folder, "epoch=0.ckpt"), seed=5)
    results["fabric"] = fabric_loop()  # accelerator="auto": torch's accelerator
    results["fabric_cpu"] = fabric_loop(accelerator="cpu")
    results["pytorch_lightning"] = fit(pytorch_lightning, "remote_accel", epochs=1)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
