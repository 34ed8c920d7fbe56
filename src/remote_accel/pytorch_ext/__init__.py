"""The remote_accel device: a PrivateUse1 backend whose tensors live on a remote server.

`remote_accel.init()` renames PrivateUse1 to "remote_accel", registers `torch.remote_accel`
and the tensor methods, installs the boxed fallback (csrc/op_queue.cpp, with its Python
half in fallback.py) and connects.
"""

from .lifecycle import init, shutdown
from .runtime import is_initialized

__all__ = ["init", "is_initialized", "shutdown"]
