"""A session's random number generators, so that clients never share a random stream.

Generators travel as (gen_id, seed, epoch) (torch_wire.values.GENERATOR). The server keeps one
torch.Generator per id on the device and reseeds it whenever the (seed, epoch) pair it
was last seeded with changes: the client bumps the epoch on every manual_seed, even
with the same seed. Id 0 is the session's default generator, used for ops that name
no generator; ops that take none at all (native_dropout) have the device's shared default
generator swapped to the session's state around the call.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch

from ..errors import ProtocolError
from . import native
from .device import ComputeDevice
from .failure import OP, Failure

#: torch's own default seed, so a session that never seeds starts where torch would.
DEFAULT_SEED = 67280421310721
MAX_GENERATORS = 1024
_U64 = (1 << 64) - 1


@contextmanager
def _default_lock():
    """The device's default generator is process-wide: swaps of its state must not
    interleave, here or in the C++ executor's seeded ops (one lock for both)."""
    native.lock_default_generator()
    try:
        yield
    finally:
        native.unlock_default_generator()



class Generators:
    def __init__(self, device: ComputeDevice):
        self._device = device
        self.default = device.new_generator()
        self.default.manual_seed(DEFAULT_SEED)
        # id -> ((seed, epoch) last applied, generator); None: never seeded by the client
        self._gens: dict[int, tuple[Any, torch.Generator]] = {0: (None, self.default)}

    def resolve(self, value: Any) -> torch.Generator:
        """GENERATOR payload -> the session's torch.Generator for it."""
        if type(value) is not tuple or len(value) != 3 or any(type(v) is not int for v in value):
            raise ProtocolError("malformed generator reference")
        gen_id, seed, epoch = value
        key = (seed, epoch)
        entry = self._gens.get(gen_id)
        if entry is None:
            if len(self._gens) >= MAX_GENERATORS:
                raise Failure(OP, f"a session may hold at most {MAX_GENERATORS} generators")
            entry = (None, self._device.new_generator())
        if entry[0] != key:
            entry[1].manual_seed(seed & _U64)
            entry = (key, entry[1])
        self._gens[gen_id] = entry
        return entry[1]

    def resolve_default(self, value: Any) -> None:
        """Bring the session default up to the client's (seed, epoch) for stream `value`;
        ops without a generator argument draw from the default whatever id it names."""
        if type(value) is not tuple or len(value) != 3 or value[0] != 0:
            raise ProtocolError("the stream of an op without a generator argument must be the default (id 0)")
        self.resolve(value)

    def states(self) -> tuple:
        """Every generator of the session as (id, (seed, epoch) last applied or None, state):
        what a client's recovery snapshot keeps so that a new server draws the same numbers."""
        return tuple((gen_id, key, self.get_state(gen)) for gen_id, (key, gen) in self._gens.items())

    def restore(self, states: Any) -> None:
        """Take back what states() gave (on another server): generators and their keys."""
        if type(states) is not tuple or len(states) > MAX_GENERATORS:
            raise ProtocolError(f"generator states must be a tuple of at most {MAX_GENERATORS} entries")
        for entry in states:
            if (type(entry) is not tuple or len(entry) != 3 or type(entry[0]) is not int
                    or type(entry[2]) is not bytes or not (entry[1] is None or type(entry[1]) is tuple)):
                raise ProtocolError("malformed generator state")
            gen_id, key, state = entry
            gen = self.default if gen_id == 0 else self._gens.get(gen_id, (None, None))[1]
            if gen is None:
                gen = self._device.new_generator()
            self.set_state(gen, state)
            self._gens[gen_id] = (key, gen)

    def get_state(self, gen: torch.Generator) -> bytes:
        return gen.get_state().numpy().tobytes()

    def set_state(self, gen: torch.Generator, state: bytes) -> None:
        try:
            gen.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        except (RuntimeError, ValueError) as exc:
            raise Failure(OP, f"invalid generator state: {exc}") from None

    @contextmanager
    def as_device_default(self):
        """Run the body with the device's default generator holding this session's state."""
        shared = self._device.default_generator()
        if shared is None:
            yield
            return
        with _default_lock():
            saved = shared.get_state()
            shared.set_state(self.default.get_state())
            try:
                yield
            finally:
                self.default.set_state(shared.get_state())
                shared.set_state(saved)
