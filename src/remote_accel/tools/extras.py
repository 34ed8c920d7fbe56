"""The tools' own dependencies (scapy, pyelftools, rich, prometheus_client) come with the
`tools` extra (`pip install 'remote_accel[tools]'`), not with the client: a tool that
lacks one says which extra brings it, instead of a bare ImportError."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def requires(tool: str):
    try:
        yield
    except ImportError as exc:
        raise ImportError(f"{tool} needs the tools extra: pip install 'remote_accel[tools]' ({exc})") from exc
