"""What init() needs from the rest of the process: each case in a fresh interpreter,
since PyTorch's autograd engine sets itself up once per process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from remote_accel.server.testing import ServerProcess

PRELUDE = textwrap.dedent("""
    import sys, torch, remote_accel
    addresses, token = sys.argv[1].split(","), sys.argv[2]
""")

BACKWARD_BEFORE_IMPORT = textwrap.dedent("""
    import sys, torch
    w = torch.ones(3, requires_grad=True)
    (w * 2).sum().backward()  # local training: autograd's device threads start without remote_accel
    import remote_accel
    addresses, token = sys.argv[1].split(","), sys.argv[2]
    remote_accel.init(transport="tcp", servers=addresses, token=token)
    for index in range(len(addresses)):
        w = torch.ones(3, device=f"remote_accel:{index}", requires_grad=True)
        (w * (index + 2)).sum().backward()
        print(index, w.grad.cpu().tolist())
""")

BACKWARD_ON_EVERY_DEVICE = PRELUDE + textwrap.dedent("""
    remote_accel.init(transport="tcp", server=addresses[0], token=token)
    (torch.ones(3, requires_grad=True) * 2).sum().backward()  # the first backward: one server
    remote_accel.shutdown()
    remote_accel.init(transport="tcp", servers=addresses, token=token)  # now two
    for index in range(len(addresses)):
        w = torch.ones(3, device=f"remote_accel:{index}", requires_grad=True)
        (w * (index + 2)).sum().backward()
        print(index, w.grad.cpu().tolist())
""")


def _run(script: str, *servers: ServerProcess) -> str:
    address = ",".join("%s:%d" % s.tcp for s in servers)
    proc = subprocess.run([sys.executable, "-c", script, address, servers[0].token],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_init_works_after_a_backward_that_ran_before_remote_accel_was_imported():
    """The autograd engine sized its device queues at that backward, without
    remote_accel: init() gives it the missing ones (#14 item 6)."""
    with ServerProcess(token="shared") as a, ServerProcess(token="shared") as b:
        out = _run(BACKWARD_BEFORE_IMPORT, a, b)
    assert out.splitlines() == ["0 [2.0, 2.0, 2.0]", "1 [3.0, 3.0, 3.0]"], out


def test_backward_works_on_servers_added_after_the_first_backward():
    with ServerProcess(token="shared") as a, ServerProcess(token="shared") as b:
        out = _run(BACKWARD_ON_EVERY_DEVICE, a, b)
    assert out.splitlines() == ["0 [2.0, 2.0, 2.0]", "1 [3.0, 3.0, 3.0]"], out
