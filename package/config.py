"""Defaults and environment variables shared by client, server and tools."""

import argparse
import os

ENV_SERVER = "REMOTE_ACCEL_SERVER"
ENV_TRANSPORT = "REMOTE_ACCEL_TRANSPORT"
ENV_TOKEN = "REMOTE_ACCEL_TOKEN"
ENV_EAL_ARGS = "REMOTE_ACCEL_EAL_ARGS"
ENV_RUNTIME_DIR = "REMOTE_ACCEL_RUNTIME_DIR"
ENV_TLS_CA = "REMOTE_ACCEL_TLS_CA"  # the CA a TCP client checks the server's certificate with
ENV_TLS_CERT = "REMOTE_ACCEL_TLS_CERT"  # the client's own certificate, for mutual TLS
ENV_TLS_KEY = "REMOTE_ACCEL_TLS_KEY"

DEFAULT_TCP_PORT = 18515
DEFAULT_TCP_SERVER = f"127.0.0.1:{DEFAULT_TCP_PORT}"
DEFAULT_TIMEOUT_S = 10.0
#: Where `remote-accel-server --metrics` serves Prometheus text and `ra-top` looks.
DEFAULT_METRICS_HOST = "127.0.0.1"
DEFAULT_METRICS_PORT = 18516
DEFAULT_METRICS = f"{DEFAULT_METRICS_HOST}:{DEFAULT_METRICS_PORT}"


def runtime_dir() -> str:
    """Folder for the memif socket and the token file, private to this user."""
    path = os.environ.get(ENV_RUNTIME_DIR)
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
