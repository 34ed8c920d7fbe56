__version__ = "0.1.0"
# Bumped whenever the wire format changes incompatibly; peers refuse other versions.
WIRE_VERSION = 3  # 2: challenge-response handshake (HELLO carries no token); 3: copies under one-copy keys
