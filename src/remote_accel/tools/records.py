"""What the capture readers (capture, frames) hand to ra-dump: one Record per message."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .wire_layers import RAPrologue


@dataclass
class Record:
    """One message (or one problem) seen in the capture."""

    time: float
    src: str
    dst: str
    proto: str  # "tcp", "udp", or the frame layer's name
    prologue: Optional[RAPrologue] = None
    crc_ok: bool = True
    frame: dict = field(default_factory=dict)  # frame header fields of DPDK frames
    note: str = ""  # what went wrong, for records that are not a message
    info: str = ""  # what this is, for records that are neither (a DPDK session frame)

    @property
    def is_message(self) -> bool:
        return self.prologue is not None



def endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
