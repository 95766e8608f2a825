"""Tensors between the protocol's shapes and an ONNX graph's, as Triton moves them.

A config tensor's ``dims`` are what clients send and read (batch dimension left out);
its ``reshape`` is what the graph takes or gives. Triton maps one onto the other keeping
the variable (-1) sizes in order: with ``dims: [-1, 2]`` and ``reshape: [2, -1]`` an
item of shape [5, 2] reaches the graph as [2, 5]. Auto-complete writes
``dims: [1]`` with ``reshape: { shape: [] }`` for a batching model's 1-D tensors,
so a request's [B, 1] runs as [B] and the graph's [B] answers as [B, 1].

A graph tensor of rank 0 that the config describes as ``dims: [1]`` without a reshape
(a model that does not batch) is fed as a scalar and answered with the config's dims,
as Triton's ONNX Runtime backend does.

A batch runs as one session call: each request's inputs are mapped, then concatenated;
each output is split back by the requests' batch sizes, then mapped, whatever its rank.
BYTES travel to ONNX Runtime's Python API as text: it reads strings as UTF-8 (raw bytes
in an object array would arrive as their ``repr``), so an element that is not UTF-8
fails its own request with a clear error.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import InternalError, InvalidArgumentError, UnsupportedError
from .._model import Outputs, Result, batch_size
from .._types import InferenceRequest
from .._validation import fits_dims

Array = np.ndarray[Any, Any]


@dataclass(frozen=True)
class Layout:
    """How one config tensor maps onto its graph tensor."""

    name: str
    dims: tuple[int, ...]  # the client's item shape (-1: any size)
    model_dims: tuple[int, ...] | None  # the graph's item shape: the reshape, or None
    scalar: bool  # the graph tensor has rank 0 and no reshape says otherwise

    def to_model(self, item: tuple[int, ...]) -> tuple[int, ...]:
        if self.model_dims is not None:
            return _remap(item, self.dims, self.model_dims)
        return () if self.scalar else item

    def to_client(self, item: tuple[int, ...], where: str) -> tuple[int, ...]:
        if self.model_dims is not None:
            if not fits_dims(self.model_dims, item):
                raise InternalError(
                    f"{where}: output '{self.name}' has item shape {list(item)}, the "
                    f"reshape says {list(self.model_dims)}"
                )
            return _remap(item, self.model_dims, self.dims)
        if not item and self.scalar:
            return tuple(1 if d == -1 else d for d in self.dims)
        return item


def check_reshape(name: str, dims: Sequence[int], reshape: Sequence[int]) -> str | None:
    """Why ``reshape`` cannot stand for ``dims`` (None: it can): the same number of
    variable sizes and, between them, the same number of elements."""
    if list(dims).count(-1) != list(reshape).count(-1):
        return f"'{name}': reshape {list(reshape)} and dims {list(dims)} differ in variable sizes"
    if _segments(dims) != _segments(reshape):
        return f"'{name}': reshape {list(reshape)} does not hold the elements of dims {list(dims)}"
    return None


def _segments(dims: Sequence[int]) -> list[int]:
    """Element counts of the fixed runs between variable sizes."""
    counts = [1]
    for d in dims:
        if d == -1:
            counts.append(1)
        else:
            counts[-1] *= d
    return counts


def _remap(shape: tuple[int, ...], source: Sequence[int], target: Sequence[int]) -> tuple[int, ...]:
    variable = iter([s for s, d in zip(shape, source, strict=True) if d == -1])
    return tuple(next(variable) if d == -1 else d for d in target)


class Batch:
    """The feeds of one session call for ``requests``, and their outputs split back.

    A request whose inputs cannot be fed fails alone; the others still run."""

    def __init__(
        self, requests: Sequence[InferenceRequest], inputs: Mapping[str, Layout], batching: bool
    ) -> None:
        self._batching = batching
        self._results: list[Result | None] = [None] * len(requests)
        self._sizes: list[int] = []
        mapped: list[dict[str, Array]] = []
        for index, request in enumerate(requests):
            try:
                mapped.append(_request_feeds(request, inputs, batching))
            except InvalidArgumentError as exc:
                self._results[index] = exc
                continue
            self._sizes.append(batch_size(request) if batching else 1)
        self.feeds: dict[str, Array] = {}
        if len(mapped) == 1:
            self.feeds = mapped[0]
        elif mapped:
            names = mapped[0]
            self.feeds = {n: np.concatenate([m[n] for m in mapped]) for n in names}

    @property
    def runs(self) -> bool:
        """Whether any request is left to run."""
        return bool(self._sizes)

    def results(self, outputs: Sequence[Layout], arrays: Sequence[Any], model: str) -> list[Result]:
        """Each request's outputs (or its own error), in request order."""
        per_request = iter(self._split(outputs, arrays, model))
        return [next(per_request) if r is None else r for r in self._results]

    def _split(
        self, layouts: Sequence[Layout], arrays: Sequence[Any], model: str
    ) -> Iterator[Outputs]:
        where = f"model '{model}'"
        total = sum(self._sizes)
        checked = [np.asarray(a) for a in arrays]
        for layout, array in zip(layouts, checked, strict=True):
            if self._batching and (array.ndim == 0 or array.shape[0] != total):
                raise InternalError(
                    f"{where}: output '{layout.name}' has shape {list(array.shape)}, not a "
                    f"batch of {total}"
                )
        start = 0
        for size in self._sizes:
            outputs: dict[str, Array] = {}
            for layout, array in zip(layouts, checked, strict=True):
                if self._batching:
                    part = array[start : start + size]
                    item = layout.to_client(part.shape[1:], where)
                    outputs[layout.name] = part.reshape((size, *item))
                else:
                    outputs[layout.name] = array.reshape(layout.to_client(array.shape, where))
                outputs[layout.name] = _bytes_out(outputs[layout.name])
            start += size
            yield outputs


def _request_feeds(
    request: InferenceRequest, layouts: Mapping[str, Layout], batching: bool
) -> dict[str, Array]:
    feeds: dict[str, Array] = {}
    for name, tensor in request.inputs.items():
        data = tensor.data
        layout = layouts.get(name)  # None: a sequence control or state, fed as it is
        if layout is not None:
            if batching:
                data = data.reshape((data.shape[0], *layout.to_model(data.shape[1:])))
            else:
                data = data.reshape(layout.to_model(data.shape))
        feeds[name] = _text_in(name, data)
    return feeds


def _text_in(name: str, array: Array) -> Array:
    """BYTES elements as the UTF-8 text ONNX Runtime's Python API takes."""
    if array.dtype != np.object_:
        return array
    flat = array.reshape(-1)
    texts = np.empty(flat.shape, dtype=object)
    for index, element in enumerate(flat):
        try:
            texts[index] = element.decode("utf-8") if isinstance(element, bytes) else element
        except UnicodeDecodeError:
            raise InvalidArgumentError(
                f"input '{name}' element {index} is not UTF-8: ONNX Runtime's Python API "
                "takes strings as UTF-8 text"
            ) from None
    return texts.reshape(array.shape)


def _bytes_out(array: Array) -> Array:
    """ONNX Runtime's string outputs (text) as the bytes a BYTES tensor carries."""
    if array.dtype != np.object_:
        return array
    flat = [e.encode("utf-8") if isinstance(e, str) else e for e in array.reshape(-1)]
    out = np.empty(len(flat), dtype=object)
    out[:] = flat
    return out.reshape(array.shape)


def string_output_error(model: str, exc: UnicodeDecodeError) -> UnsupportedError:
    """A string output ONNX Runtime's Python API cannot hand over (not UTF-8)."""
    return UnsupportedError(
        f"model '{model}': a string output is not UTF-8, which ONNX Runtime's Python API "
        f"cannot return ({exc.reason})"
    )
