"""What crosses between the server and a Python-backend instance process, besides the
frames' kinds: tensors as (name, datatype, shape, place) with their bytes in an arena,
and errors as (class name, message). Both sides import it: the standard library,
numpy and the trio-free parts of trioserve only.

On the busy paths (a batch, its answer, a decoupled response, blocks given back) tensors
and blocks cross as plain tuples (``frame_tensor``, ``blocks_to_wire``): pickle takes a
tuple of ints and strings several times faster than a class instance, named tuples
included, and both frames of every batch carry them. A batch's inputs, its outputs and
a decoupled model's responses (``frame_tensor``) ride in the frame itself when smaller
than ``INLINE_BELOW`` bytes: for them a copy through pickle costs less than placing,
reading and freeing a block.

A fixed-size tensor is read in place: a read-only numpy view of the writer's block. A
BYTES tensor travels as Triton's length-prefixed elements and is read into an object
array (a copy, as any BYTES decoding is).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np

from .. import _errors
from .._errors import InferenceServerError, InternalError
from .._tensor import DATATYPES, array_from_raw, array_to_raw, datatype
from ..ipc._arena import Arena, Block

Array = np.ndarray[Any, Any]


class WireTensor(NamedTuple):
    name: str
    datatype: str  # the wire name: "FP32", "BYTES"
    shape: tuple[int, ...]
    block: Block


# A WireTensor flat, (name, datatype, shape, segment, offset, size), or (name,
# datatype, shape, bytes) for one that rides in the frame.
FrameTensor = tuple[Any, ...]
RawBlock = tuple[int, int, int]
ARENA_LABEL = "trioserve-python-backend"  # /proc's name for the arenas' segments
# Measured, one FP32 tensor through pickle against through a block (placed, read,
# freed): 4 us against 8 at 1-16 KiB, even near 64 KiB; a block wins beyond, and the
# frame's bytes also cross the socket twice, hence the margin.
INLINE_BELOW = 16 * 1024

WireError = tuple[str, str]  # an InferenceServerError's class name, and its message


def put_tensor(arena: Arena, name: str, datatype_name: str, array: Array) -> WireTensor:
    """Write ``array`` into a new block of ``arena``."""
    block = arena.write(array_to_raw(array, datatype(datatype_name)))
    return WireTensor(name, datatype_name, tuple(array.shape), block)


def blocks_to_wire(blocks: Iterable[Block]) -> list[RawBlock]:
    return [(b.segment, b.offset, b.size) for b in blocks]


def blocks_from_wire(raw: Iterable[RawBlock]) -> list[Block]:
    return [Block(g, o, z) for g, o, z in raw]


def frame_tensor(
    arena: Arena, name: str, datatype_name: str, array: Array, blocks: list[Block]
) -> FrameTensor:
    """``array`` for a batch's frame: inline when small, else in a new block of
    ``arena`` (appended to ``blocks``)."""
    raw = array_to_raw(array, DATATYPES[datatype_name])
    shape = tuple(array.shape)
    if memoryview(raw).nbytes < INLINE_BELOW:
        return (name, datatype_name, shape, bytes(raw))
    block = arena.write(raw)
    blocks.append(block)
    return (name, datatype_name, shape, *block)


def frame_block(tensor: FrameTensor) -> WireTensor | None:
    """The tensor as it lies in a block; None for one inline (or in a client's region)."""
    if len(tensor) != 6:
        return None
    name, datatype_name, shape, segment, offset, size = tensor
    return WireTensor(name, datatype_name, shape, Block(segment, offset, size))


def read_inline(tensor: FrameTensor) -> Array:
    """The array of an inline tensor: read-only, over the frame's bytes unless BYTES."""
    name, datatype_name, shape, data = tensor
    dt = DATATYPES[datatype_name]
    if dt.is_bytes:
        array = array_from_raw(dt, shape, data, name)
        array.flags.writeable = False
        return array
    # Written by ``frame_tensor`` from an array of this shape: its size is right. numpy
    # makes an array over ``bytes`` read-only.
    return np.frombuffer(data, dt.dtype).reshape(shape)


def read_tensor(tensor: WireTensor, view: memoryview) -> Array:
    """The array ``view`` (the tensor's block) holds: read-only, in place unless BYTES."""
    array = array_from_raw(DATATYPES[tensor.datatype], tensor.shape, view, tensor.name)
    array.flags.writeable = False
    return array


class _Lease:
    """Owns a view of one block of an arena: numpy arrays made from it keep it alive."""

    def __init__(self, array: Array) -> None:
        self._array = array
        self.__array_interface__ = array.__array_interface__


def leased(array: Array, give_back: Callable[..., Any], *args: Any) -> Array:
    """``array`` (a view of an arena's block), calling ``give_back(*args)`` once the last
    array viewing it is gone."""
    lease = _Lease(array)
    weakref.finalize(lease, give_back, *args)
    return np.asarray(lease)


def error_to_wire(exc: BaseException) -> WireError:
    if isinstance(exc, InferenceServerError):
        return type(exc).__name__, exc.message
    return InternalError.__name__, f"{type(exc).__name__}: {exc}"


def error_from_wire(error: WireError) -> InferenceServerError:
    kind = getattr(_errors, error[0], None)
    if not (isinstance(kind, type) and issubclass(kind, InferenceServerError)):
        kind = InternalError
    return kind(error[1])
