"""Settings: every environment variable remote_accel reads, with its default, in one table
(SETTINGS), read through `setting()`; and the defaults shared by client, server and
tools. The README's configuration table lists the same variables
(tests/unit/test_settings.py holds the two and the source together)."""

import argparse
import os
import re
import shlex
from dataclasses import dataclass
from typing import Optional, Sequence

from .errors import ConfigError

ENV_SERVER = "REMOTE_ACCEL_SERVER"
ENV_TRANSPORT = "REMOTE_ACCEL_TRANSPORT"
ENV_TOKEN = "REMOTE_ACCEL_TOKEN"
ENV_EAL_ARGS = "REMOTE_ACCEL_EAL_ARGS"
ENV_RUNTIME_DIR = "REMOTE_ACCEL_RUNTIME_DIR"
ENV_TLS_CA = "REMOTE_ACCEL_TLS_CA"  # the CA a TCP client checks the server's certificate with
ENV_TLS_CERT = "REMOTE_ACCEL_TLS_CERT"  # the client's own certificate, for mutual TLS
ENV_TLS_KEY = "REMOTE_ACCEL_TLS_KEY"

@dataclass(frozen=True)
class Setting:
    name: str
    default: str  # as the variable would say it; "" where there is none
    reader: str   # who reads it: client, server, both, or the C++ part that does
    meaning: str


SETTINGS = {s.name: s for s in (
    Setting(ENV_SERVER, "", "client", "init()'s server (host:port, or several comma-separated: remote_accel:0, 1, "
                                      "...); with autoload, names the server(s) to connect to"),
    Setting(ENV_TRANSPORT, "auto", "client", "init()'s transport: dpdk, tcp or auto"),
    Setting(ENV_TOKEN, "", "client", "init()'s token (one per server, comma-separated, for several); else the "
                                     "token file a local server wrote"),
    Setting(ENV_EAL_ARGS, "", "client", "init()'s DPDK EAL arguments (split as a shell would)"),
    Setting(ENV_RUNTIME_DIR, "", "both", "folder of the memif socket and the token file "
                                         "(default $XDG_RUNTIME_DIR/remote_accel-UID or /tmp/...)"),
    Setting(ENV_TLS_CA, "", "client", "init()'s tls_ca"),
    Setting(ENV_TLS_CERT, "", "client", "init()'s tls_cert"),
    Setting(ENV_TLS_KEY, "", "client", "init()'s tls_key"),
    Setting("REMOTE_ACCEL_TCP_POLL_US", "200", "both", "longest a TCP/TLS receiver polls before it blocks (0: never)"),
    Setting("REMOTE_ACCEL_SERVER_CPU_BERNOULLI", "1", "server", "the server's bernoulli_ kernel for CPU tensors"),
    Setting("REMOTE_ACCEL_SERVER_FAST_LOOP", "1", "server", "the C++ receive loop for DPDK and plain TCP sessions"),
    Setting("REMOTE_ACCEL_COMPILE_GRAPHS", "1", "server", "compile graphs with Inductor (0: replay them node by node)"),
    Setting("REMOTE_ACCEL_DPDK_DOORBELL", "1", "both", "memif/ring waiters sleep until the peer's next frame"),
    Setting("REMOTE_ACCEL_MEMIF_BSIZE", "16384", "both", "memif buffer size in bytes (one frame per buffer)"),
    Setting("REMOTE_ACCEL_MEMIF_RING_MB", "64", "client", "memif buffers each way, MiB (shared memory per local client)"),
    Setting("REMOTE_ACCEL_CLIENT_CACHE_MB", "1024", "client (C++)", "free host blocks kept for .cpu() results"),
    Setting("REMOTE_ACCEL_RECOVERY_MEMORY", "", "client", "host memory a session's recovery may keep "
            "(snapshot, journal); default: a quarter of the host's"),
    Setting("REMOTE_ACCEL_HOST_CACHE_MB", "2048", "server (C++)", "free host blocks kept for the server's storages"),
)}


def setting(name: str) -> str:
    """The variable's value, else its default (a name not in SETTINGS is a bug: KeyError)."""
    default = SETTINGS[name].default
    return os.environ.get(name, default).strip() or default


def servers(argument: Optional[str] = None) -> list:
    """init()'s server argument, else REMOTE_ACCEL_SERVER: "HOST:PORT", or several
    comma-separated (remote_accel:0, remote_accel:1, ...); [None] where neither names one
    (the default server)."""
    named = argument or setting(ENV_SERVER)
    return [s.strip() for s in named.split(",")] if named else [None]


def whole_number(name: str) -> int:
    """A setting that is a count or a size: a clear error for anything but a whole number >= 0."""
    value = setting(name)
    if not value.isdigit():
        raise ConfigError(f"{name}={value!r}: expected a whole number (default {SETTINGS[name].default})")
    return int(value)


def is_set(name: str) -> bool:
    """Whether the environment says anything for the setting (its default aside)."""
    return bool(os.environ.get(SETTINGS[name].name, "").strip())


def enabled(name: str) -> bool:
    """A switch (default on, as SETTINGS says): off for 0, false, no, off."""
    return setting(name).lower() not in ("0", "false", "no", "off")


def transport(argument: Optional[str]) -> str:
    """init()'s transport argument, else REMOTE_ACCEL_TRANSPORT, else auto; lower case."""
    return (argument or setting(ENV_TRANSPORT)).lower()


def eal_args(argument) -> Optional[list]:
    """init()'s EAL arguments (a list, or a string split as a shell would), else
    REMOTE_ACCEL_EAL_ARGS, else None."""
    if argument is None:
        argument = setting(ENV_EAL_ARGS) or None
    return shlex.split(argument) if isinstance(argument, str) else (list(argument) if argument is not None else None)


_SIZE = re.compile(r"(\d+)\s*([KMGTP]?)(?:i?B)?", re.IGNORECASE)
_UNITS = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40, "P": 50}


def parse_size(text: str) -> int:
    """'8G', '512MiB', '1048576' -> bytes (binary units); ConfigError if it is none."""
    from .errors import ConfigError

    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise ConfigError(f"bad size {text!r}: expected BYTES or a number with K, M, G, T")
    return int(match.group(1)) << _UNITS[match.group(2).upper()]


DEFAULT_TCP_PORT = 18515
DEFAULT_TCP_SERVER = f"127.0.0.1:{DEFAULT_TCP_PORT}"
DEFAULT_TIMEOUT_S = 10.0
#: Where `remote-accel-server --metrics` serves Prometheus text and `ra-top` looks.
DEFAULT_METRICS_HOST = "127.0.0.1"
DEFAULT_METRICS_PORT = 18516
DEFAULT_METRICS = f"{DEFAULT_METRICS_HOST}:{DEFAULT_METRICS_PORT}"


def runtime_dir() -> str:
    """Folder for the memif socket and the token file, private to this user."""
    path = setting(ENV_RUNTIME_DIR)
    if not path:
        base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
        path = os.path.join(base, f"remote_accel-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def default_memif_socket() -> str:
    return os.path.join(runtime_dir(), "memif.sock")


def default_token_file() -> str:
    return os.path.join(runtime_dir(), "token")


def parse_host_port(text: str, default_port: int = DEFAULT_TCP_PORT) -> tuple[str, int]:
    """'host:port', 'host', '[v6]:port' -> (host, port); raises ValueError with the text."""
    from .errors import ConfigError

    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:
        host, port_text = text, ""
    try:
        port = int(port_text) if port_text else default_port
    except ValueError:
        raise ConfigError(f"bad port in server address {text!r}") from None
    if not host or not 0 <= port < 65536:
        raise ConfigError(f"bad server address {text!r}: expected HOST:PORT")
    return host, port


def seconds_argument(low: float, high: float):
    """An argparse type for a number of seconds in [low, high], with a message that says
    which rule a value broke (the server's timeouts, ra-top's refresh interval)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is outside {low}..{high} seconds")
        return value

    return parse
