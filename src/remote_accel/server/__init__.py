"""remote_accel.server: executes remote_accel clients' aten ops on a local torch device.

Run it with `remote-accel-server` (or `python -m remote_accel.server`); see __main__.
Modules: service (listeners, sessions), session (protocol loop, errors), executor (ops),
storage (per-session storage table), ops (what op names may reach), rng, device, auth,
and testing (a server process and a protocol-level client for tests and tools).
"""

from .. import _torch_hook

_torch_hook.skip()  # a server is no remote_accel client (its device may be PrivateUse1 too)
