"""Encoding of message fields ("meta"): a small tagged binary format, safe to decode.

Values: None, bool, int (signed 64-bit), float, complex, str, bytes, list, tuple,
dict (str keys), and `Ext(code, value)` for the higher layers' own types (tensor
references, dtypes, devices...). Decoding never builds anything but those, checks every
length against what is left of the input, and bounds nesting depth and item counts, so
arbitrary bytes give a `ProtocolError`, never a crash or a huge allocation.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

from ..errors import ProtocolError


class Ext(NamedTuple):
    """A value of a type defined by a higher layer; `code` says which (0-255)."""

    code: int
    value: Any


class Raw(bytes):
    """A value already encoded, written out verbatim: lets a caller cache the encoding of
    values it sends again and again (tensor metadata). Decodes as the value it encodes."""

    __slots__ = ()


MAX_DEPTH = 64
MAX_ITEMS = 1 << 22

_NONE, _FALSE, _TRUE, _INT, _FLOAT, _STR, _BYTES, _LIST, _TUPLE, _DICT, _COMPLEX, _EXT, _SMALLINT = range(13)
_Q = struct.Struct("<q")
_D = struct.Struct("<d")
_DD = struct.Struct("<dd")
_I = struct.Struct("<I")
_SMALL_BIAS = 128  # one-byte ints in [-128, 127] are the common case (dims, flags)


_SMALL_INTS = tuple(bytes((_SMALLINT, i + _SMALL_BIAS)) for i in range(-_SMALL_BIAS, _SMALL_BIAS))
_STRINGS: dict[str, bytes] = {}  # op names, dtype names, keyword names: a small set, sent often
_STRINGS_MAX = 1 << 12
_INT64 = (-(1 << 63), 1 << 63)


def encode_int(v: int) -> bytes:
    """encode(v) for an int, without the generic dispatch (storage ids in tensor references)."""
    if -_SMALL_BIAS <= v < _SMALL_BIAS:
        return _SMALL_INTS[v + _SMALL_BIAS]
    return b"\x03" + _Q.pack(v)


def tuple_header(n: int) -> bytes:
    """What encode() writes before the items of an n-tuple."""
    return b"\x08" + _I.pack(n)


def encode(value: Any) -> bytes:
    out = bytearray()
    _encode(value, out, 0)
    return bytes(out)


def _encode(v: Any, out: bytearray, depth: int) -> None:
    # the common types first: this runs for every value of every queued op
    t = type(v)
    if t is int:
        if -_SMALL_BIAS <= v < _SMALL_BIAS:
            out += _SMALL_INTS[v + _SMALL_BIAS]
        elif _INT64[0] <= v < _INT64[1]:
            out += b"\x03"
            out += _Q.pack(v)
        else:
            raise OverflowError(f"int {v} does not fit in 64 bits")
    elif t is tuple or t is list:
        if depth >= MAX_DEPTH:
            raise ValueError("value nested too deeply to encode")
        out += b"\x07" if t is list else b"\x08"
        out += _I.pack(len(v))
        for item in v:
            _encode(item, out, depth + 1)
    elif t is Raw:
        out += v
    elif v is None:
        out += b"\x00"
    elif t is str:
        cached = _STRINGS.get(v)
        if cached is None:
            raw = v.encode()
            cached = b"\x05" + _I.pack(len(raw)) + raw
            if len(raw) <= 64:
                if len(_STRINGS) >= _STRINGS_MAX:
                    _STRINGS.clear()
                _STRINGS[v] = cached
        out += cached
    elif t is bool:
        out += b"\x02" if v else b"\x01"
    elif t is float:
        out += b"\x04"
        out += _D.pack(v)
    elif t is dict:
        out += b"\x09"
        out += _I.pack(len(v))
        for key, item in v.items():
            if type(key) is not str:
                raise TypeError(f"dict keys must be str, got {type(key).__name__}")
            _encode(key, out, depth + 1)
            _encode(item, out, depth + 1)
    elif t is Ext:
        if depth >= MAX_DEPTH:
            raise ValueError("value nested too deeply to encode")
        out += bytes((_EXT, v.code))
        _encode(v.value, out, depth + 1)
    elif t is bytes or t is bytearray or t is memoryview:
        raw = bytes(v)
        out += b"\x06"
        out += _I.pack(len(raw))
        out += raw
    elif t is complex:
        out += b"\x0a"
        out += _DD.pack(v.real, v.imag)
    elif isinstance(v, int):  # IntEnum, numpy ints that subclass int
        _encode(int(v), out, depth)
    elif isinstance(v, tuple):  # NamedTuple other than Ext
        _encode(tuple(v), out, depth)
    else:
        raise TypeError(f"cannot encode a value of type {t.__name__}")


def decode(data) -> Any:
    """Decode one value that must fill `data` exactly."""
    buf = data if type(data) is bytes else bytes(data)
    value, pos = decode_at(buf, 0)
    if pos != len(buf):
        raise ProtocolError(f"{len(buf) - pos} trailing bytes after meta value")
    return value


def decode_at(data, pos: int) -> tuple[Any, int]:
    """Decode the one value that starts at byte `pos` of `data` (bytes or a buffer of
    bytes); (value, where it ends)."""
    if _native_decode_at is not None:
        try:
            return _native_decode_at(data, pos, Ext)
        except ValueError:
            pass  # malformed: the Python decoder says what is wrong
    return _Decoder(bytes(data)).read(pos, 0)


try:  # the same decoder in C (_codec.c), several times faster on the server's hot messages
    from ._codec import decode_at as _native_decode_at
except ImportError:  # a source tree that was not built: the Python decoder alone
    _native_decode_at = None


class _Decoder:
    __slots__ = ("buf", "items")

    def __init__(self, buf: bytes):
        self.buf = buf
        self.items = 0

    def _need(self, pos: int, n: int) -> None:
        if pos + n > len(self.buf):
            raise ProtocolError(f"meta truncated: need {n} bytes at offset {pos}, have {len(self.buf) - pos}")

    def _count(self, n: int) -> None:
        self.items += n
        if self.items > MAX_ITEMS:
            raise ProtocolError(f"meta holds more than {MAX_ITEMS} items")

    def read(self, pos: int, depth: int) -> tuple[Any, int]:
        if depth > MAX_DEPTH:
            raise ProtocolError("meta nested too deeply")
        buf = self.buf
        self._need(pos, 1)
        tag = buf[pos]
        pos += 1
        if tag == _SMALLINT:
            self._need(pos, 1)
            return buf[pos] - _SMALL_BIAS, pos + 1
        if tag == _NONE:
            return None, pos
        if tag == _FALSE:
            return False, pos
        if tag == _TRUE:
            return True, pos
        if tag == _INT:
            self._need(pos, 8)
            return _Q.unpack_from(buf, pos)[0], pos + 8
        if tag == _FLOAT:
            self._need(pos, 8)
            return _D.unpack_from(buf, pos)[0], pos + 8
        if tag == _COMPLEX:
            self._need(pos, 16)
            re, im = _DD.unpack_from(buf, pos)
            return complex(re, im), pos + 16
        if tag in (_STR, _BYTES):
            self._need(pos, 4)
            (n,) = _I.unpack_from(buf, pos)
            pos += 4
            self._need(pos, n)
            raw = buf[pos : pos + n]
            if tag == _BYTES:
                return raw, pos + n
            try:
                return raw.decode(), pos + n
            except UnicodeDecodeError:
                raise ProtocolError("meta string is not valid UTF-8") from None
        if tag in (_LIST, _TUPLE, _DICT):
            self._need(pos, 4)
            (n,) = _I.unpack_from(buf, pos)
            pos += 4
            # every item takes at least one byte: reject counts the input cannot hold
            self._need(pos, n)
            self._count(n)
            if tag == _DICT:
                out = {}
                for _ in range(n):
                    key, pos = self.read(pos, depth + 1)
                    if type(key) is not str:
                        raise ProtocolError("meta dict key is not a string")
                    out[key], pos = self.read(pos, depth + 1)
                return out, pos
            items = []
            for _ in range(n):
                item, pos = self.read(pos, depth + 1)
                items.append(item)
            return (items if tag == _LIST else tuple(items)), pos
        if tag == _EXT:
            self._need(pos, 1)
            code = buf[pos]
            value, pos = self.read(pos + 1, depth + 1)
            return Ext(code, value), pos
        raise ProtocolError(f"unknown meta tag {tag} at offset {pos - 1}")
