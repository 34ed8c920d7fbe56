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
