"""The data plane: one wire format, the Transport interface, TCP and DPDK transports."""

from .transport import Listener, Message, Transport
from .wire import DEFAULT_LIMITS, Limits, MsgType

__all__ = ["Listener", "Limits", "DEFAULT_LIMITS", "Message", "MsgType", "Transport"]
