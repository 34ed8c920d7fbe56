"""The meta codec: exact round trips, and any bytes decode to a value or a ProtocolError."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_accel.dataplane import codec
from remote_accel.dataplane.codec import Ext
from remote_accel.errors import ProtocolError

scalars = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=20) | st.binary(max_size=40) | st.complex_numbers(allow_nan=False)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.lists(inner, max_size=5).map(tuple)
    | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    | st.builds(Ext, st.integers(0, 255), inner),
    max_leaves=30,
)


@given(values)
def test_round_trip(value):
    assert codec.decode(codec.encode(value)) == value


def test_round_trip_keeps_types():
    value = (1, -1, 200, -(2**63), 1.5, True, False, None, "ünï", b"\0\1", [1], (2,), {"k": (3,)}, 1j, Ext(3, ("x", 0)))
    back = codec.decode(codec.encode(value))
    assert back == value
    assert [type(v) for v in back] == [type(v) for v in value]
    assert math.copysign(1, codec.decode(codec.encode(-0.0))) == -1


@settings(max_examples=500)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_crash(data):
    try:
        codec.decode(data)
    except ProtocolError:
        pass


@given(values)
def test_truncations_are_protocol_errors(value):
    data = codec.encode(value)
    for cut in range(len(data)):
        with pytest.raises(ProtocolError):
            codec.decode(data[:cut])


def test_huge_counts_are_refused_without_allocating():
    # a list claiming 4 billion items in a 9-byte input
    with pytest.raises(ProtocolError, match="truncated"):
        codec.decode(b"\x07\xff\xff\xff\xff" + b"\x00" * 4)


def test_deep_nesting_is_refused():
    with pytest.raises(ProtocolError, match="deeply"):
        codec.decode(b"\x07\x01\x00\x00\x00" * 100 + b"\x00")


@pytest.mark.parametrize("bad", [object(), {1: 2}, 2**64])
def test_unencodable_values_raise(bad):
    with pytest.raises((TypeError, ValueError, OverflowError)):
        codec.encode(bad)


# -- the C decoder (_codec.c) against the Python one -------------------------------------------
# codec.decode runs the C decoder and, where it refuses the input, the Python one (which
# words the error). They must agree on every input: the same values and types, the same
# end, and refusing the same bytes.


def _by_python(data: bytes, pos: int = 0):
    try:
        value, end = codec._Decoder(bytes(data)).read(pos, 0)
    except ProtocolError:
        return None
    return codec.encode(value), end  # the encoding tells types apart (tuple/list, int/bool, ...)


def _by_c(data, pos: int = 0):
    try:
        value, end = codec._native_decode_at(data, pos, Ext)
    except ValueError:
        return None
    return codec.encode(value), end


def test_the_c_decoder_is_built():
    assert codec._native_decode_at is not None


@given(values, st.binary(max_size=8))
def test_c_decoder_gives_the_python_values(value, prefix):
    data = prefix + codec.encode(value) + b"\x00"
    assert _by_c(data, len(prefix)) == _by_python(data, len(prefix)) == (codec.encode(value), len(data) - 1)


@settings(max_examples=1000)
@given(st.binary(max_size=200))
def test_c_decoder_refuses_what_python_refuses(data):
    assert _by_c(data) == _by_python(data)


@settings(max_examples=300)
@given(values, st.data())
def test_c_decoder_agrees_on_damaged_encodings(value, draw):
    data = bytearray(codec.encode(value))
    for _ in range(draw.draw(st.integers(1, 3))):
        data[draw.draw(st.integers(0, len(data) - 1))] = draw.draw(st.integers(0, 255))
    assert _by_c(bytes(data)) == _by_python(bytes(data))


def test_c_decoder_builds_the_same_types():
    value = (1, 1.5, 1j, "s", b"b", [None, True], {"k": False}, Ext(9, (Ext(1, 2),)))
    back, end = codec._native_decode_at(codec.encode(value), 0, Ext)
    assert back == value and end == len(codec.encode(value))
    assert [type(v) for v in back] == [type(v) for v in value]
    assert type(back[-1].value[0]) is Ext and back[-1].code == 9


def test_c_decoder_takes_buffers_and_bounds_its_start():
    data = codec.encode((1, "x"))
    assert codec._native_decode_at(memoryview(data), 0, Ext) == ((1, "x"), len(data))
    assert codec._native_decode_at(bytearray(data), 0, Ext) == ((1, "x"), len(data))
    for pos in (-1, len(data), len(data) + 5):
        with pytest.raises(ValueError):
            codec._native_decode_at(data, pos, Ext)


def test_c_decoder_bounds_depth_items_and_utf8():
    deep = b"\x07\x01\x00\x00\x00" * (codec.MAX_DEPTH + 1) + b"\x00"
    many = b"\x08" + (codec.MAX_ITEMS + 1).to_bytes(4, "little") + b"\x00" * (codec.MAX_ITEMS + 1)
    bad_utf8 = b"\x05\x02\x00\x00\x00\xc3\x28"
    int_key = b"\x09\x01\x00\x00\x00\x0c\x81\x00"
    for data in (deep, many, bad_utf8, int_key):
        with pytest.raises(ValueError):
            codec._native_decode_at(data, 0, Ext)
        with pytest.raises(ProtocolError):
            codec.decode(data)
    ok = b"\x07\x01\x00\x00\x00" * codec.MAX_DEPTH + b"\x00"
    assert _by_c(ok) == _by_python(ok) is not None
