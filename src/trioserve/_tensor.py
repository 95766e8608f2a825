"""Tensor datatypes and the codecs between numpy and the wire.

Wire facts (Open Inference Protocol plus Triton's binary extension):
- Fixed-size types travel little-endian, row-major, unpadded; BOOL is one byte.
- BYTES elements travel as a 4-byte little-endian length followed by the bytes.
- BF16 has no numpy dtype: it is carried as 2-byte words (``<u2``), opaque to us.

Raw buffers become arrays without copying (``np.frombuffer``); the arrays are then
read-only views of the received body, which is what models get.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np

from ._errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class Datatype:
    """One wire datatype: its protocol name, numpy dtype and Triton config name."""

    name: str
    dtype: np.dtype[Any]
    config_name: str  # the enum name in Triton's ModelConfig (TYPE_FP32, TYPE_STRING, ...)
    json_kinds: str  # numpy kinds accepted from JSON data ("" = not allowed in JSON)
    bounds: tuple[int, int] | None = None  # integer types: the values JSON data may hold
    # A field, not a property: it is asked several times per request, and a property
    # is a Python call each time.
    is_bytes: bool = False


def _fixed(name: str, dtype: str, kinds: str) -> Datatype:
    numpy_dtype = np.dtype(dtype)
    bounds = None
    if kinds == _INTEGER_KINDS:
        info = np.iinfo(numpy_dtype)
        bounds = (int(info.min), int(info.max))
    return Datatype(name, numpy_dtype, f"TYPE_{name}", kinds, bounds)


_INTEGER_KINDS = "iu"
_NUMBER_KINDS = "iuf"

DATATYPES: dict[str, Datatype] = {
    t.name: t
    for t in (
        _fixed("BOOL", "?", "b"),
        _fixed("UINT8", "<u1", _INTEGER_KINDS),
        _fixed("UINT16", "<u2", _INTEGER_KINDS),
        _fixed("UINT32", "<u4", _INTEGER_KINDS),
        _fixed("UINT64", "<u8", _INTEGER_KINDS),
        _fixed("INT8", "<i1", _INTEGER_KINDS),
        _fixed("INT16", "<i2", _INTEGER_KINDS),
        _fixed("INT32", "<i4", _INTEGER_KINDS),
        _fixed("INT64", "<i8", _INTEGER_KINDS),
        _fixed("FP16", "<f2", _NUMBER_KINDS),
        _fixed("FP32", "<f4", _NUMBER_KINDS),
        _fixed("FP64", "<f8", _NUMBER_KINDS),
        _fixed("BF16", "<u2", ""),
        Datatype("BYTES", np.dtype(object), "TYPE_STRING", "U", is_bytes=True),
    )
}

_BY_CONFIG_NAME = {t.config_name: t for t in DATATYPES.values()}
_BY_DTYPE = {t.dtype: t for t in DATATYPES.values() if t.name not in ("BF16", "BYTES")}


def datatype(name: object) -> Datatype:
    """The datatype called ``name`` on the wire; INVALID_ARG if there is none."""
    found = DATATYPES.get(name) if isinstance(name, str) else None
    if found is None:
        raise InvalidArgumentError(f"invalid datatype '{name}'")
    return found


def datatype_from_config(config_name: str) -> Datatype:
    """The datatype of a Triton config enum name such as ``TYPE_FP32``."""
    try:
        return _BY_CONFIG_NAME[config_name]
    except KeyError:
        raise InvalidArgumentError(f"invalid config datatype '{config_name}'") from None


def datatype_of(array: np.ndarray[Any, Any]) -> Datatype:
    """The wire datatype for a numpy array a model produced (object/str/bytes -> BYTES)."""
    dtype = array.dtype
    found = _BY_DTYPE.get(dtype)  # a native dtype, as nearly every array's: no new one made
    if found is not None:
        return found
    kind = dtype.kind
    if kind in "OSU":
        return DATATYPES["BYTES"]
    found = _BY_DTYPE.get(dtype.newbyteorder("<") if kind != "b" else dtype)
    if found is None:
        raise InvalidArgumentError(f"numpy dtype {array.dtype} has no wire datatype")
    return found


def element_count(shape: Sequence[int]) -> int:
    return prod(shape)


MAX_DIMS = 64
"""The most dimensions a tensor may have: numpy's own limit."""
_MAX_EXTENT = (1 << 63) // 16
"""Bound on the product of a shape's non-zero dimensions: numpy refuses an array whose
dimensions, zeros set aside, multiply past its index range in bytes (16-byte elements at
most), even an empty one."""


def check_shape(shape: Any, what: str) -> tuple[int, ...]:
    """A client-sent shape as a tuple of non-negative ints numpy can make an array of
    (at most ``MAX_DIMS`` of them, not too large together), or INVALID_ARG."""
    if isinstance(shape, list | tuple):
        extent = 1
        for d in shape:  # a plain loop: no generator to set up for the usual two dims
            if type(d) is not int or d < 0:
                break
            if d:
                extent *= d
        else:
            if len(shape) > MAX_DIMS:
                raise InvalidArgumentError(
                    f"{what}: shape has {len(shape)} dimensions, at most {MAX_DIMS} are allowed"
                )
            if extent > _MAX_EXTENT:
                raise InvalidArgumentError(f"{what}: shape {list(shape)} is too large")
            return tuple(shape)
    raise InvalidArgumentError(
        f"{what}: shape must be a list of non-negative integers, got {shape!r}"
    )


# --- BYTES -------------------------------------------------------------------------

_LENGTH = struct.Struct("<I")


def serialize_bytes(array: np.ndarray[Any, Any]) -> bytes:
    """BYTES elements, C order, each as a 4-byte LE length then its bytes."""
    parts: list[bytes] = []
    for item in array.reshape(-1):
        data = _element_bytes(item)
        parts.append(_LENGTH.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def _element_bytes(item: Any) -> bytes:
    if isinstance(item, bytes):
        return item
    if isinstance(item, str):
        return item.encode()
    if isinstance(item, np.bytes_ | bytearray | memoryview):
        return bytes(item)
    # Numbers and other scalars become their decimal text, as Triton's clients do.
    return str(item).encode()


def deserialize_bytes(
    buffer: bytes | bytearray | memoryview, count: int, what: str
) -> np.ndarray[Any, Any]:
    """Exactly ``count`` length-prefixed elements filling ``buffer``, as an object array."""
    view = memoryview(buffer).cast("B")
    items: list[bytes] = []
    offset = 0
    end = len(view)
    for _ in range(count):
        if offset + 4 > end:
            raise InvalidArgumentError(
                f"{what}: BYTES data holds fewer than the {count} elements its shape declares"
            )
        (length,) = _LENGTH.unpack_from(view, offset)
        offset += 4
        if offset + length > end:
            raise InvalidArgumentError(f"{what}: BYTES element length runs past the data")
        items.append(bytes(view[offset : offset + length]))
        offset += length
    if offset != end:
        raise InvalidArgumentError(
            f"{what}: BYTES data holds more than the {count} elements its shape declares"
        )
    result = np.empty(count, dtype=object)
    result[:] = items
    return result


# --- raw (binary extension, gRPC raw contents, shared memory) ------------------------


def array_from_raw(
    dt: Datatype, shape: Sequence[int], buffer: bytes | bytearray | memoryview, what: str
) -> np.ndarray[Any, Any]:
    """The tensor ``buffer`` holds, without copying fixed-size data."""
    if dt.is_bytes:
        return deserialize_bytes(buffer, element_count(shape), what).reshape(shape)
    count = prod(shape)
    size = memoryview(buffer).nbytes
    if size != count * dt.dtype.itemsize:  # checked here, the call only to say why
        check_raw_size(dt, shape, size, what)
    array = np.frombuffer(buffer, dt.dtype)  # the whole buffer: its size was just checked
    if dt.name == "BOOL" and count and array.view(np.uint8).max() > 1:
        raise InvalidArgumentError(f"{what}: BOOL data must be bytes 0 or 1")
    return array.reshape(shape)


def array_from_own_raw(
    dt: Datatype, shape: tuple[int, ...], buffer: bytes | memoryview
) -> np.ndarray[Any, Any]:
    """The tensor another process of this server wrote with ``array_to_raw`` from an
    array of ``shape``: its size and values were checked where it was made (a front-end
    worker's decoded input, a model's output), so not again; no copy either."""
    if dt.is_bytes:
        return deserialize_bytes(buffer, prod(shape), "a forwarded tensor").reshape(shape)
    if type(buffer) is bytes and len(buffer) == prod(shape) * dt.dtype.itemsize:
        return np.ndarray(shape, dt.dtype, buffer)  # one numpy call, not two as below
    # A wrong size raises ValueError here (``np.ndarray`` would read a longer buffer's
    # start). Over a memoryview, an array from ``np.ndarray`` would have the view's
    # exporter for its base, not the view that ``root_in_place`` looks for.
    return np.frombuffer(buffer, dt.dtype).reshape(shape)


def check_raw_size(dt: Datatype, shape: Sequence[int], size: int, what: str) -> int:
    """The element count of ``shape``; INVALID_ARG unless ``size`` bytes are exactly that
    many elements of the fixed-size ``dt``."""
    count = prod(shape)  # not element_count: a call less, on every raw tensor
    expected = count * dt.dtype.itemsize
    if size != expected:
        raise InvalidArgumentError(
            f"{what}: got {size} bytes of {dt.name} data, shape {list(shape)} needs {expected}"
        )
    return count


_COPY_BELOW = 4096
"""Arrays smaller than this many bytes go raw as a copy: one call, where a view of the
array takes four, and a copy this small costs less than they do."""


def array_to_raw(array: np.ndarray[Any, Any], dt: Datatype) -> bytes | memoryview:
    """The raw form of ``array``; a view (no copy) when it is already contiguous LE, a
    copy when it is small."""
    if dt.is_bytes:
        return serialize_bytes(array)
    if array.nbytes < _COPY_BELOW and array.dtype == dt.dtype:
        return array.tobytes()  # row-major whatever the array's strides
    return np.ascontiguousarray(array, dt.dtype).reshape(-1).view(np.uint8).data


# --- JSON --------------------------------------------------------------------------


def array_from_json(
    dt: Datatype, shape: Sequence[int], data: Any, what: str
) -> np.ndarray[Any, Any]:
    """The tensor that JSON ``data`` (flat or nested) holds, with strict type checks."""
    if not dt.json_kinds:
        raise InvalidArgumentError(f"{what}: {dt.name} data can only be sent as binary")
    if not isinstance(data, list):
        data = [data]
    count = element_count(shape)
    if dt.is_bytes:
        return _bytes_from_json(data, count, what).reshape(shape)
    if len(data) == count <= _SMALL and set(map(type, data)) <= _PLAIN_TYPES[dt.json_kinds]:
        # The common small flat list: checking element types in Python is cheaper than
        # letting numpy infer a dtype and then checking it with reductions. numpy checks
        # the integer range itself, raising OverflowError.
        try:
            with _float_overflow_raises(dt):
                return np.array(data, dtype=dt.dtype).reshape(shape)
        except (OverflowError, FloatingPointError):
            raise InvalidArgumentError(f"{what}: value out of range for {dt.name}") from None
    try:
        parsed = _array_in_slices(data)
    except ValueError:
        raise InvalidArgumentError(f"{what}: data is not a rectangular array") from None
    if parsed.size != count:
        raise InvalidArgumentError(
            f"{what}: data holds {parsed.size} elements, shape {list(shape)} needs {count}"
        )
    if count == 0:
        return np.zeros(shape, dtype=dt.dtype)
    if dt.bounds is not None and parsed.dtype.kind in "fO":
        parsed = _big_integers(dt, data, parsed.shape, what)
    if parsed.dtype.kind not in dt.json_kinds:
        raise InvalidArgumentError(f"{what}: data must be {_json_kind_words(dt)} for {dt.name}")
    if dt.bounds is not None and parsed.dtype != dt.dtype:
        low, high = dt.bounds
        if parsed.min() < low or parsed.max() > high:
            raise InvalidArgumentError(f"{what}: value out of range for {dt.name}")
    try:
        with _float_overflow_raises(dt):
            return parsed.astype(dt.dtype, copy=False).reshape(shape)
    except FloatingPointError:
        raise InvalidArgumentError(f"{what}: value out of range for {dt.name}") from None


JSON_SLICE = 32768
"""Elements converted per call between JSON and numpy for long data (both ways): one
call holds the GIL, and large messages are handled in a worker thread while the event
loop waits for the GIL."""


def _array_in_slices(data: list[Any]) -> np.ndarray[Any, Any]:
    """``np.array(data)``, in slices of the outer list when it is long."""
    if len(data) <= JSON_SLICE:
        return np.array(data)
    return np.concatenate(
        [np.array(data[i : i + JSON_SLICE]) for i in range(0, len(data), JSON_SLICE)]
    )


def _float_overflow_raises(dt: Datatype) -> contextlib.AbstractContextManager[object]:
    """For float datatypes, a number past the type's range (1e39 for FP32, 70000 for FP16)
    raises ``FloatingPointError`` instead of silently becoming infinity with a warning:
    it is refused as out of range, as integers past theirs are."""
    return np.errstate(over="raise") if dt.dtype.kind == "f" else contextlib.nullcontext()


_SMALL = 256
_PLAIN_TYPES = {"b": frozenset({bool}), "iu": frozenset({int}), "iuf": frozenset({int, float})}


def _big_integers(
    dt: Datatype, data: list[Any], shape: tuple[int, ...], what: str
) -> np.ndarray[Any, Any]:
    """Integers past int64 make numpy guess float64 or object: check them exactly against
    ``dt``'s range (numpy would raise OverflowError), then convert."""
    flat = _flatten(data)
    if not all(type(x) is int for x in flat):
        return np.array(flat, dtype=object)  # not all integers: fails the kind check
    assert dt.bounds is not None
    low, high = dt.bounds
    if min(flat) < low or max(flat) > high:
        raise InvalidArgumentError(f"{what}: value out of range for {dt.name}")
    return np.array(flat, dtype=dt.dtype).reshape(shape)


def _json_kind_words(dt: Datatype) -> str:
    if dt.name == "BOOL":
        return "true/false"
    return "integers" if dt.json_kinds == _INTEGER_KINDS else "numbers"


def _bytes_from_json(data: list[Any], count: int, what: str) -> np.ndarray[Any, Any]:
    flat = _flatten(data)
    if len(flat) != count:
        raise InvalidArgumentError(
            f"{what}: data holds {len(flat)} elements, its shape needs {count}"
        )
    result = np.empty(count, dtype=object)
    for i, item in enumerate(flat):
        if not isinstance(item, str):
            raise InvalidArgumentError(f"{what}: BYTES data must be strings")
        try:
            result[i] = item.encode()
        except UnicodeEncodeError:  # a lone surrogate: JSON can escape one, UTF-8 cannot
            raise InvalidArgumentError(f"{what}: BYTES data is not valid Unicode text") from None
    return result


def _flatten(data: list[Any]) -> list[Any]:
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


def array_to_json(array: np.ndarray[Any, Any], dt: Datatype, what: str) -> list[Any]:
    """Flat JSON data for ``array`` (the OIP response form)."""
    if not dt.json_kinds:
        raise InvalidArgumentError(
            f"{what}: {dt.name} output can only be returned as binary; request binary_data"
        )
    if not dt.is_bytes:
        return array.reshape(-1).tolist()
    out: list[str] = []
    for item in array.reshape(-1):
        try:
            out.append(_element_bytes(item).decode())
        except UnicodeDecodeError:
            raise InvalidArgumentError(
                f"{what}: BYTES output is not UTF-8 text; request it as binary_data"
            ) from None
    return out
