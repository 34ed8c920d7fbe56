"""remote_accel.frameworks itself: a machine that names no server imports none of it and
its frameworks behave as shipped; a framework version the integrations do not know gets
a message that names the versions supported."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types

import pytest

import unchanged
from remote_accel.errors import RemoteAccelError

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("lightning")

IMPORT_EVERY_FRAMEWORK = textwrap.dedent("""
    import json, sys, tempfile
    from transformers import Trainer, TrainingArguments
    import accelerate, lightning, pytorch_lightning, lightning_fabric
    from accelerate import PartialState
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), report_to=[])
    trainer = lightning.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    print(json.dumps({
        "ours": sorted(name for name in sys.modules if name.split(".")[0] == "remote_accel"),
        "devices": [str(args.device), str(PartialState().device), str(trainer.strategy.root_device)],
        "registered": ["remote_accel" in registry for registry in (
            lightning.pytorch.accelerators.AcceleratorRegistry, lightning.fabric.accelerators.ACCELERATOR_REGISTRY,
            pytorch_lightning.accelerators.AcceleratorRegistry, lightning_fabric.accelerators.ACCELERATOR_REGISTRY)],
    }))
""")


def test_a_machine_without_a_server_imports_none_of_it():
    out = subprocess.run([sys.executable, "-c", IMPORT_EVERY_FRAMEWORK], env=unchanged.clean_environment(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["ours"] == [] and seen["registered"] == [False] * 4
    # as shipped: cpu here (a GPU where the machine has one), and the same for all three
    assert len(set(seen["devices"])) == 1 and "remote_accel" not in seen["devices"][0]
    assert "remote_accel" not in out.stderr


@pytest.fixture
def framework_version(monkeypatch):
    """Pretend an installed framework is at another version (what the integrations read)."""
    def pretend(package: str, version: str):
        monkeypatch.setattr(sys.modules[package], "__version__", version)

    return pretend


def test_an_unsupported_transformers_is_named_and_left_alone(framework_version):
    from remote_accel.frameworks import transformers as integration

    framework_version("transformers", "4.57.6")
    untouched = types.ModuleType("transformers.training_args")  # patch() must not reach into it
    with pytest.warns(RuntimeWarning, match=r"supports transformers >=5\.0,<6 \(tested with .*\), not transformers "
                                            r"4\.57\.6"):
        integration.patch(untouched)
    assert vars(untouched).keys() == vars(types.ModuleType("x")).keys()


def test_an_accelerate_before_1_16_is_named(framework_version):
    from remote_accel.frameworks import accelerate as integration

    framework_version("accelerate", "1.15.0")
    with pytest.warns(RuntimeWarning, match=r"supports accelerate >=1\.16,<2 .*not accelerate 1\.15\.0"):
        integration.patch(types.ModuleType("accelerate.state"))


def test_an_unsupported_lightning_refuses_the_accelerator_by_name(framework_version):
    import lightning.pytorch.accelerators
    from lightning.fabric.accelerators.registry import _AcceleratorRegistry

    from remote_accel.frameworks import lightning as integration

    framework_version("lightning", "3.0.0")
    accelerators = types.SimpleNamespace(__name__="lightning.pytorch.accelerators", AcceleratorRegistry=
                                         _AcceleratorRegistry(), Accelerator=lightning.pytorch.accelerators.Accelerator)
    integration.patch(accelerators)
    assert "remote_accel" in accelerators.AcceleratorRegistry  # so that the name is not an unknown one
    with pytest.raises(RemoteAccelError, match=r"supports lightning >=2\.4,<3 .*not lightning 3\.0\.0"):
        accelerators.AcceleratorRegistry.get("remote_accel")

