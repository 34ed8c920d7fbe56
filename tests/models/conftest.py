"""Third-party models (transformers, torchvision, timm) and training frameworks (transformers'
Trainer, accelerate, Lightning) on remote_accel against CPU.

They need those packages, which load only beside a torch they were
built for: `./quickstart.sh test` makes a second environment for them (.venv-models,
torch 2.14.1 + torchvision 0.29.1) and sets REMOTE_ACCEL_MODELS_REQUIRED=1 there, so that
a missing package fails the run instead of skipping it. Elsewhere (the main environment,
torch 2.13.0) the suite is skipped, saying how to run it.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # model_check, the suite's helper

# tiny configurations with random weights: nothing may come from a hub
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

NEEDED = ("torchvision", "transformers", "timm", "accelerate", "lightning", "pytorch_lightning", "diffusers", "peft",
          "sentence_transformers")
_missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
if _missing:
    if os.environ.get("REMOTE_ACCEL_MODELS_REQUIRED") == "1":
        raise RuntimeError(f"tests/models need {', '.join(_missing)}, which are not installed")
    collect_ignore_glob = ["test_*.py"]


def pytest_report_header(config):
    if _missing:
        return (f"tests/models: not collected, {', '.join(_missing)} missing here "
                "(`./quickstart.sh models` runs them in .venv-models)")
    return None


@pytest.fixture(scope="module")
def remote():
    """A CPU server process over TCP for each test module; torchvision:: ops are served
    because torchvision imports there (the server's default). Module scope: the suites run
    after this one in the same pytest run (device, e2e, server) init() sessions of their
    own, which a session still open here would refuse."""
    import remote_accel
    from remote_accel.server.testing import ServerProcess

    with ServerProcess() as server:
        host, port = server.tcp
        remote_accel.init(transport="tcp", server=f"{host}:{port}", token=server.token)
        yield server
        remote_accel.shutdown()
        assert "Traceback" not in server.log(), server.log()
