"""The shared token that clients present in HELLO.

By default it lives in `config.default_token_file()`, inside a folder only this user can
enter, so that a client on the same host and account reads it without being told.
A token file that others may read is refused: anyone who can read it can use the server.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat

from ..errors import ConfigError

log = logging.getLogger(__name__)

TOKEN_BYTES = 32


def load_or_create(path: str) -> str:
    """The token in `path`; a new random one is written there (mode 0600) if it is absent."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, mode=0o700, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read(path)
    except OSError as exc:
        raise ConfigError(f"cannot create token file {path}: {exc.strerror}") from None
    token = secrets.token_hex(TOKEN_BYTES)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    log.info("created a new token in %s", path)
    return token


def _read(path: str) -> str:
    try:
        info = os.stat(path)
        if info.st_uid != os.getuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"token file {path} is accessible to other users: "
                              f"run `chmod 600 {path}` (and make sure you own it)")
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read token file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"token file {path} is not text") from None
    if not token:
        raise ConfigError(f"token file {path} is empty")
    return token
