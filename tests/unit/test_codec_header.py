"""dataplane/codec.h, the C++ side's one definition of the wire (the client's batch writer
and the server's batch reader), agrees with the Python codec and messages."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_accel.dataplane import codec
from remote_accel.torch_wire import values as torch_values
from remote_accel.dataplane import messages as m
from remote_accel.dataplane.wire import MsgType
from remote_accel.errors import ProtocolError

HEADER = Path(__file__).resolve().parents[2] / "src" / "remote_accel" / "dataplane" / "codec.h"


def constants() -> dict:
    text = HEADER.read_text()
    found = {name: int(value, 0) for name, value in re.findall(r"\b(k\w+) = (0x[0-9a-fA-F]+|\d+)\b", text)}
    shift = re.search(r"kMaxItems = int64_t\{1\} << (\d+);", text)
    found["kMaxItems"] = 1 << int(shift.group(1))
    return found


def test_tags_codes_and_types_match_python():
    c = constants()
    assert {k: c[k] for k in ("kNone", "kFalse", "kTrue", "kInt", "kFloat", "kStr", "kBytes", "kList", "kTuple",
                              "kDict", "kComplex", "kExt", "kSmallInt")} == {
        "kNone": codec._NONE, "kFalse": codec._FALSE, "kTrue": codec._TRUE, "kInt": codec._INT,
        "kFloat": codec._FLOAT, "kStr": codec._STR, "kBytes": codec._BYTES, "kList": codec._LIST,
        "kTuple": codec._TUPLE, "kDict": codec._DICT, "kComplex": codec._COMPLEX, "kExt": codec._EXT,
        "kSmallInt": codec._SMALLINT}
    assert (c["kSmallBias"], c["kMaxDepth"], c["kMaxItems"]) == (codec._SMALL_BIAS, codec.MAX_DEPTH, codec.MAX_ITEMS)
    assert (c["kExtTensor"], c["kExtCpuTensor"]) == (torch_values.TENSOR, torch_values.CPU_TENSOR)
    assert (c["kAlloc"], c["kFree"], c["kWrite"], c["kRun"], c["kRunGraph"], c["kRunPlanned"]) == (
        MsgType.ALLOC, MsgType.FREE, MsgType.WRITE, MsgType.RUN, MsgType.RUN_GRAPH, MsgType.RUN_PLANNED)
    assert {MsgType(c[k]) for k in ("kAlloc", "kFree", "kWrite", "kRun", "kRunGraph", "kRunPlanned")} == m.ONE_WAY_IN_BATCH


# -- the C++ reader accepts what the Python decoder accepts -----------------------------------------
def python_accepts(meta: bytes) -> bool:
    try:
        m.batch_items(m.decode(MsgType.BATCH, meta))
        return True
    except ProtocolError:
        return False


def cpp_accepts(meta: bytes) -> bool:
    from remote_accel.server import native  # the server's C++ executor

    return native.Executor("cpu", 1 << 20).scan(meta)


leaves = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | \
    st.text(max_size=6) | st.binary(max_size=6)
values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=3) | st.lists(inner, max_size=3).map(tuple)
                      | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)
fields = st.lists(values, max_size=8).map(tuple)
items = st.one_of(
    st.tuples(st.sampled_from([16, 17, 18, 32, 37, 38, 34, 99]), fields),
    st.tuples(st.just(18), st.tuples(st.integers(-5, 1 << 40), st.integers(-5, 1 << 40), st.integers(-5, 1 << 40))),
    st.tuples(st.just(37), st.tuples(st.integers(-5, 1 << 40), fields, fields, fields, fields)),  # a graph's rerun
    st.tuples(st.just(37), st.tuples(st.integers(-5, 9), fields, fields, fields, fields, values)),
    st.tuples(st.just(38), st.tuples(st.integers(-300, 300), st.lists(st.integers(-(2**63), 2**63 - 1) | st.binary(max_size=4),
                                                                          max_size=4).map(tuple))),
    st.tuples(st.just(16), st.tuples(st.integers(-(2**63), 2**63 - 1), st.integers(-5, 1 << 40))),
    st.tuples(st.just(32), st.tuples(st.text(max_size=12), fields, st.dictionaries(st.text(max_size=4), values,
                                                                                   max_size=2), fields)),
    values,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(items, max_size=5))
def test_the_cpp_reader_takes_exactly_what_python_takes(batch):
    meta = codec.encode((tuple(batch),))
    assert cpp_accepts(meta) == python_accepts(meta)


@settings(max_examples=300, deadline=None)
@given(st.lists(items, min_size=1, max_size=4), st.data())
def test_mangled_batches_taken_by_cpp_are_valid(batch, data):
    meta = bytearray(codec.encode((tuple(batch),)))
    for _ in range(data.draw(st.integers(1, 4))):
        meta[data.draw(st.integers(0, len(meta) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(meta)))
    for candidate in (bytes(meta), bytes(meta[:cut])):
        if cpp_accepts(candidate):
            assert python_accepts(candidate)


# -- Scalar arguments as values (SCALAR): what op_serve.cpp packs and executor.cpp reads -----------
@pytest.mark.parametrize("value, dtype, raw", [
    (-0.25, "float64", struct.pack("<d", -0.25)), (-0.0, "float64", struct.pack("<d", -0.0)),
    (7, "int64", struct.pack("<q", 7)), (True, "bool", b"\x01"),
    (1.5 - 2j, "complex128", struct.pack("<dd", 1.5, -2.0)),
])
def test_scalars_travel_by_their_bytes(value, dtype, raw):
    ext = torch_values.scalar_value(value)
    assert ext.code == torch_values.SCALAR and ext.value == (dtype, raw)
    back = torch_values.decode_value(codec.decode(codec.encode(ext)), None)
    assert type(back) is type(value) and back == value
    if dtype == "float64":
        assert struct.pack("<d", back) == raw  # -0.0 keeps its sign


@pytest.mark.parametrize("payload", [("float32", b"\0" * 4), ("float64", b"\0" * 4), ("int64", "x"), ("bool",),
                                     (None, b"\0")])
def test_malformed_scalars_are_refused(payload):
    with pytest.raises(ProtocolError):
        torch_values.decode_scalar(payload)
