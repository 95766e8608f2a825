"""``pb_utils``'s data half: tensors, errors and datatype conversions, as Triton's
``triton_python_backend_utils`` names them. Nothing here touches the server: a process
running model code could use this module as it is.

Triton numbers datatypes as ``TRITONSERVER_DataType`` does (BOOL 1 ... BYTES 13, BF16 14):
``Tensor.triton_dtype()``, ``numpy_to_triton_type`` and ``triton_to_numpy_type`` speak
those numbers.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from .._errors import (
    AlreadyExistsError,
    CancelledError,
    InferenceServerError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
    UnsupportedError,
)
from .._tensor import DATATYPES, Datatype, datatype_from_config, datatype_of, serialize_bytes

Array = np.ndarray[Any, Any]

# TRITONSERVER_DataType's numbers, by wire name.
_CODES = {
    "BOOL": 1, "UINT8": 2, "UINT16": 3, "UINT32": 4, "UINT64": 5, "INT8": 6, "INT16": 7,
    "INT32": 8, "INT64": 9, "FP16": 10, "FP32": 11, "FP64": 12, "BYTES": 13, "BF16": 14,
}  # fmt: skip
_BY_CODE = {code: DATATYPES[name] for name, code in _CODES.items()}

TRITON_STRING_TO_NUMPY: dict[str, Any] = {
    t.config_name: (bool if t.name == "BOOL" else np.object_ if t.is_bytes else t.dtype.type)
    for t in DATATYPES.values()
    if t.name != "BF16"  # numpy has no bfloat16
}


class TritonModelException(Exception):
    """Raised by a model: its message fails the requests of the execution."""

    def message(self) -> str:
        return str(self)


class TritonError:
    """An error carried by a response (or raised from BLS), with Triton's codes."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __str__(self) -> str:
        return self._message

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, {self._code})"


_ERROR_BY_CODE: dict[int, type[InferenceServerError]] = {
    TritonError.INTERNAL: InternalError,
    TritonError.NOT_FOUND: NotFoundError,
    TritonError.INVALID_ARG: InvalidArgumentError,
    TritonError.UNAVAILABLE: UnavailableError,
    TritonError.UNSUPPORTED: UnsupportedError,
    TritonError.ALREADY_EXISTS: AlreadyExistsError,
    TritonError.CANCELLED: CancelledError,
}
_CODE_BY_ERROR = {kind: code for code, kind in _ERROR_BY_CODE.items()}


def server_error(error: TritonError) -> InferenceServerError:
    return _ERROR_BY_CODE.get(error.code(), InternalError)(error.message())


def triton_error(error: InferenceServerError) -> TritonError:
    return TritonError(str(error), _CODE_BY_ERROR.get(type(error), TritonError.UNKNOWN))


def _datatype(triton_dtype: str | int) -> Datatype:
    if isinstance(triton_dtype, int):
        found = _BY_CODE.get(triton_dtype)
        if found is None:
            raise TritonModelException(f"unknown Triton datatype {triton_dtype}")
        return found
    return DATATYPES[triton_dtype]


class _Capsule:
    """Hands a DLPack capsule to numpy, which consumes objects with ``__dlpack__``."""

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, **_: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU


class Tensor:
    """A named tensor on the host."""

    def __init__(self, name: str, data: Any, *, triton_dtype: str | int | None = None) -> None:
        array = np.asarray(data)
        if array.dtype.kind in "SU":  # BYTES travel as an object array of bytes
            array = np.array(
                [x.encode() if isinstance(x, str) else bytes(x) for x in array.reshape(-1)],
                dtype=np.object_,
            ).reshape(array.shape)
        self._name = name
        self._array = array
        self._datatype = datatype_of(array) if triton_dtype is None else _datatype(triton_dtype)

    @classmethod
    def _received(cls, name: str, array: Array, datatype_name: str) -> Tensor:
        """An input as the server sent it: its array and datatype were checked there."""
        tensor = cls.__new__(cls)
        tensor._name = name
        tensor._array = array
        tensor._datatype = DATATYPES[datatype_name]
        return tensor

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> Array:
        return self._array

    def triton_dtype(self) -> int:
        """The datatype as ``TRITONSERVER_DataType`` numbers it (FP32 is 11)."""
        return _CODES[self._datatype.name]

    def datatype_name(self) -> str:
        """The wire name ("FP32"): what the server carries."""
        return self._datatype.name

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        """A DLPack capsule sharing the tensor's memory. Inputs are read-only (they lie in
        the server's memory, or the request's own bytes): a DLPack 1.0 capsule, which
        says so, carries them (numpy 2.1 and later; an older numpy exports a copy)."""
        if self._array.flags.writeable:
            return self._array.__dlpack__()
        try:
            return self._array.__dlpack__(max_version=(1, 0))
        except (TypeError, BufferError):  # a numpy without DLPack 1.0
            return self._array.copy().__dlpack__()

    def __dlpack__(self, **kwargs: Any) -> Any:
        """The protocol, as its consumer asks for it (``max_version``, ``stream``...)."""
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        source = capsule if hasattr(capsule, "__dlpack__") else _Capsule(capsule)
        return Tensor(name, np.from_dlpack(source))

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, {self._datatype.name}, shape={self.shape()})"


def triton_string_to_numpy(triton_type: str) -> Any:
    """``TYPE_FP32`` -> ``numpy.float32``; ``TYPE_STRING`` -> ``numpy.object_``."""
    found = datatype_from_config(triton_type)
    return np.object_ if found.is_bytes else found.dtype.type


def triton_to_numpy_type(data_type: int) -> Any:
    """A ``TRITONSERVER_DataType`` number -> its numpy type (13, BYTES: ``numpy.object_``);
    None for a number numpy has no type for."""
    found = _BY_CODE.get(data_type)
    if found is None or found.name == "BF16":
        return None
    return np.object_ if found.is_bytes else found.dtype.type


def numpy_to_triton_type(data_type: Any) -> int | None:
    """A numpy dtype (or type) -> its ``TRITONSERVER_DataType`` number; None for one the
    server cannot carry."""
    try:
        found = datatype_of(np.empty(0, dtype=data_type))
    except Exception:
        return None
    return _CODES[found.name]


def serialize_byte_tensor(input_tensor: Array) -> bytes | tuple[()] | None:
    """BYTES elements in C order, each a 4-byte little-endian length and its bytes, as
    Triton's helper gives them: ``()`` for an empty tensor, None for a non-BYTES one."""
    if input_tensor.size == 0:
        return ()
    if input_tensor.dtype != np.object_ and input_tensor.dtype.type != np.bytes_:
        return None
    return serialize_bytes(input_tensor)


_LENGTH = struct.Struct("<I")


def deserialize_bytes_tensor(encoded_tensor: bytes) -> Array:
    """What ``serialize_byte_tensor`` wrote -> a 1-D object array of bytes."""
    view = memoryview(encoded_tensor).cast("B")
    items: list[bytes] = []
    offset = 0
    while offset < len(view):
        (length,) = _LENGTH.unpack_from(view, offset)
        offset += _LENGTH.size
        if offset + length > len(view):
            raise TritonModelException("deserialize_bytes_tensor: an element runs past the data")
        items.append(bytes(view[offset : offset + length]))
        offset += length
    result = np.empty(len(items), dtype=np.object_)
    result[:] = items
    return result
