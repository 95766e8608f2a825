import json
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from trioserve import InvalidArgumentError
from trioserve._tensor import (
    DATATYPES,
    array_from_json,
    array_from_own_raw,
    array_from_raw,
    array_to_json,
    array_to_raw,
    datatype,
    datatype_of,
    deserialize_bytes,
    serialize_bytes,
)

FIXED = [name for name in DATATYPES if name != "BYTES"]
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)


def _arrays(name: str) -> st.SearchStrategy[np.ndarray]:
    return hnp.arrays(DATATYPES[name].dtype, shapes)


@pytest.mark.parametrize("name", FIXED)
@given(data=st.data())
def test_raw_round_trip_is_exact_and_zero_copy(name, data):
    dt = datatype(name)
    array = data.draw(_arrays(name))
    raw = bytes(array_to_raw(array, dt))
    assert len(raw) == array.size * dt.dtype.itemsize
    back = array_from_raw(dt, array.shape, raw, "x")
    assert back.shape == array.shape
    assert back.tobytes() == array.tobytes()  # bit-exact, NaNs included
    if back.size:
        assert not back.flags.owndata  # a view of the received buffer


@pytest.mark.parametrize("size", [3, 2000])  # a small array's raw is a copy, a large one's a view
@pytest.mark.parametrize("order", ["C", "F", "sliced", "big-endian"])
def test_raw_is_row_major_little_endian_whatever_the_layout(size, order):
    dt = datatype("INT32")
    rows = np.arange(2 * size, dtype="<i4").reshape(2, size)
    array = {
        "C": rows,
        "F": np.asfortranarray(rows),
        "sliced": np.repeat(rows, 2, axis=1)[:, ::2],  # a view with strides
        "big-endian": rows.astype(">i4"),
    }[order]
    raw = array_to_raw(array, dt)
    assert bytes(raw) == rows.tobytes()
    assert isinstance(raw, bytes) == (size == 3 and order != "big-endian")
    back = array_from_own_raw(dt, (2, size), raw)
    assert back.dtype == dt.dtype and (back == rows).all()


def test_own_raw_reads_bytes_tensors_and_refuses_a_wrong_size():
    items = np.array([b"a", b"", "é".encode()], dtype=object)
    back = array_from_own_raw(datatype("BYTES"), (1, 3), serialize_bytes(items))
    assert back.shape == (1, 3) and list(back[0]) == list(items)
    for size in (12, 20):  # too few bytes for the shape, or too many
        with pytest.raises(ValueError):  # a peer's bug, not a client's: no protocol error
            array_from_own_raw(datatype("FP32"), (2, 2), b"\x00" * size)


@pytest.mark.parametrize("name", [n for n in FIXED if DATATYPES[n].json_kinds])
@given(data=st.data())
def test_json_round_trip(name, data):
    dt = datatype(name)
    elements = (
        hnp.from_dtype(dt.dtype, allow_nan=False, allow_infinity=False)
        if dt.dtype.kind == "f"
        else hnp.from_dtype(dt.dtype)
    )
    array = data.draw(hnp.arrays(dt.dtype, shapes, elements=elements))
    wire = json.loads(json.dumps(array_to_json(array, dt, "x")))
    back = array_from_json(dt, array.shape, wire, "x")
    assert back.dtype == dt.dtype
    np.testing.assert_array_equal(back, array)


@given(st.lists(st.binary(max_size=20), max_size=10))
def test_bytes_round_trip(items):
    array = np.empty(len(items), dtype=object)
    array[:] = items
    raw = serialize_bytes(array)
    assert len(raw) == sum(4 + len(i) for i in items)
    back = deserialize_bytes(raw, len(items), "x")
    assert list(back) == items


def test_bytes_edge_cases():
    items = [b"", b"\x00", b"a\x00b", b"\xff\xfe", "é".encode()]
    array = np.array(items, dtype=object)
    raw = serialize_bytes(array)
    assert raw[:4] == struct.pack("<I", 0)
    assert list(array_from_raw(datatype("BYTES"), [5], raw, "x")) == items
    # Zero-length tensors of every rank.
    assert array_from_raw(datatype("BYTES"), [0, 3], b"", "x").shape == (0, 3)
    assert array_from_raw(datatype("FP32"), [2, 0], b"", "x").shape == (2, 0)


@pytest.mark.parametrize(
    ("raw", "count", "message"),
    [
        (b"\x01\x00\x00", 1, "fewer"),
        (struct.pack("<I", 5) + b"abc", 1, "runs past"),
        (struct.pack("<I", 1) + b"a" + b"\x00", 1, "more than"),
    ],
)
def test_bytes_malformed(raw, count, message):
    with pytest.raises(InvalidArgumentError, match=message):
        deserialize_bytes(raw, count, "x")


def test_raw_length_must_match_shape():
    with pytest.raises(InvalidArgumentError, match="needs 64"):
        array_from_raw(datatype("INT32"), [16], b"\x00" * 60, "x")
    # A shape far larger than the data is refused without allocating it.
    with pytest.raises(InvalidArgumentError):
        array_from_raw(datatype("FP32"), [2**40, 2**20], b"\x00" * 4, "x")


def test_bool_raw_must_be_zero_or_one():
    with pytest.raises(InvalidArgumentError, match="0 or 1"):
        array_from_raw(datatype("BOOL"), [2], b"\x01\x02", "x")


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        ("INT32", [1.5, 2], "integers"),
        ("INT32", ["1", 2], "integers"),
        ("UINT8", [256], "out of range"),
        ("INT8", [-129], "out of range"),
        ("UINT32", [-1], "out of range"),
        ("INT64", [2**63], "out of range"),
        ("UINT64", [2**64], "out of range"),
        ("INT32", [[2**31]], "out of range"),  # nested: numpy's own conversion path
        ("FP16", [70000], "out of range"),  # would round to infinity
        ("FP32", [3.4028235677973366e38], "out of range"),
        ("FP32", [[1e39]], "out of range"),
        ("BOOL", [1, 0], "true/false"),
        ("FP32", ["x"], "numbers"),
        ("FP32", [[1, 2], [3]], "rectangular"),
        ("BYTES", [1], "strings"),
        ("BF16", [1], "only be sent as binary"),
        ("INT32", [1, 2, 3], "needs 4"),
    ],
)
def test_json_type_errors(name, data, message):
    shape = [4] if message == "needs 4" else [len(data)]
    with pytest.raises(InvalidArgumentError, match=message):
        array_from_json(datatype(name), shape, data, "x")


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("INT8", [-128, 127]),
        ("UINT8", [0, 255]),
        ("INT64", [-(2**63), 2**63 - 1]),
        ("UINT64", [0, 2**64 - 1]),
        ("FP16", [-65504.0, 65504.0]),
        ("FP32", [-3.4028234663852886e38, 3.4028234663852886e38]),
    ],
)
def test_json_integers_at_the_ends_of_their_range_are_exact(name, data):
    array = array_from_json(datatype(name), [2], data, "x")
    assert array.dtype == datatype(name).dtype
    assert array.tolist() == data


def test_json_nested_data_is_accepted():
    array = array_from_json(datatype("INT64"), [2, 2], [[1, 2], [3, 4]], "x")
    assert array.tolist() == [[1, 2], [3, 4]]
    strings = array_from_json(datatype("BYTES"), [2, 1], [["a"], ["b"]], "x")
    assert strings.reshape(-1).tolist() == [b"a", b"b"]


def test_non_utf8_bytes_cannot_be_json():
    array = np.array([b"\xff"], dtype=object)
    with pytest.raises(InvalidArgumentError, match="binary_data"):
        array_to_json(array, datatype("BYTES"), "x")


def test_datatype_lookup():
    with pytest.raises(InvalidArgumentError, match="invalid datatype"):
        datatype("FLOAT")
    assert datatype_of(np.zeros(1, np.float32)).name == "FP32"
    assert datatype_of(np.zeros(1, bool)).name == "BOOL"
    assert datatype_of(np.array(["a"])).name == "BYTES"
    assert datatype_of(np.zeros(1, ">i4")).name == "INT32"
