"""The response cache: whole responses by a hash of what a request asks, LRU, bytes-bounded.

One cache per server instance, shared by the model versions that opt in
(``Model.response_cache``); its size limit is server-wide (``--cache-config
local,size=N``, as in Triton). A key hashes the model name and version, each input's
name, datatype, shape and bytes, the outputs asked for and the request parameters a model
can read. Only successful responses are stored: a failure is never cached.

Stored arrays are copies, read-only, so that neither the model nor a caller can change
an entry after the fact; a hit hands out those arrays without copying again.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._tensor import Datatype, array_to_raw
from .._types import InferenceRequest, InferenceResponse, OutputTensor

# Request parameters that steer only scheduling or the wire encoding, never the result.
_NOT_IN_KEY = frozenset({"priority", "timeout", "binary_data_output"})

# What an entry costs beyond its tensors: key, bookkeeping (an estimate, so that a
# cache of many tiny responses still respects its limit).
_ENTRY_OVERHEAD_BYTES = 128


@dataclass(frozen=True, slots=True)
class _Entry:
    model_name: str
    version: str
    outputs: tuple[tuple[str, Datatype, np.ndarray[Any, Any]], ...]
    byte_size: int
    parameters: Mapping[str, Any]  # the response's own


@dataclass(frozen=True, slots=True)
class CacheStatistics:
    entries: int
    used_bytes: int
    capacity_bytes: int
    evictions: int


def cache_key(request: InferenceRequest, model_name: str, version: str) -> bytes:
    """A 128-bit hash of everything that decides the response's tensors."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{model_name}\0{version}\0".encode())
    for name in sorted(request.inputs):
        tensor = request.inputs[name]
        h.update(f"{name}\0{tensor.datatype.name}\0{tensor.shape}\0".encode())
        h.update(array_to_raw(tensor.data, tensor.datatype))
    h.update(repr(sorted(o.name for o in request.outputs)).encode())
    h.update(
        repr(sorted((k, v) for k, v in request.parameters.items() if k not in _NOT_IN_KEY)).encode()
    )
    return h.digest()


class ResponseCache:
    """Least recently used responses within ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError("the response cache needs a size in bytes > 0")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._used = 0
        self._evictions = 0

    def statistics(self) -> CacheStatistics:
        return CacheStatistics(len(self._entries), self._used, self.capacity_bytes, self._evictions)

    def lookup(self, key: bytes, request: InferenceRequest) -> InferenceResponse | None:
        """The cached response for ``key``, answering ``request`` (its id and output
        parameters); None on a miss."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        wanted = {o.name: o.parameters for o in request.outputs}
        outputs = [
            OutputTensor(name, dt, array, wanted.get(name, {})) for name, dt, array in entry.outputs
        ]
        return InferenceResponse(
            entry.model_name, entry.version, outputs, id=request.id, parameters=entry.parameters
        )

    def insert(self, key: bytes, response: InferenceResponse) -> None:
        """Store a copy of ``response``'s tensors, evicting the least recently used
        entries to make room; a response larger than the whole cache is not stored."""
        if key in self._entries:
            return  # identical requests in one batch: the first one stored it
        outputs = tuple((t.name, t.datatype, _frozen_copy(t.data)) for t in response.outputs)
        size = _ENTRY_OVERHEAD_BYTES + sum(_byte_size(array) for _, _, array in outputs)
        if size > self.capacity_bytes:
            return
        while self._used + size > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._used -= evicted.byte_size
            self._evictions += 1
        self._entries[key] = _Entry(
            response.model_name, response.model_version, outputs, size, dict(response.parameters)
        )
        self._used += size


def cache_size_from_flags(options: Sequence[str]) -> int:
    """Each ``--cache-config local,size=N`` (Triton's syntax); the size of the response
    cache in bytes, 0 when no cache is configured."""
    size = 0
    for option in options:
        name, _, setting = option.partition(",")
        if name != "local":
            raise ValueError(f"unsupported cache {name!r}: only the 'local' cache exists")
        key, sep, value = setting.partition("=")
        if key != "size" or not sep:
            raise ValueError(f"--cache-config expects local,size=BYTES, got {option!r}")
        if not value.isdigit():
            raise ValueError(f"the cache size must be a number of bytes, got {value!r}")
        size = int(value)
    return size


def _frozen_copy(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    copy = np.array(array, copy=True)
    copy.flags.writeable = False
    return copy


def _byte_size(array: np.ndarray[Any, Any]) -> int:
    if array.dtype == object:  # BYTES: the elements' own sizes, plus a reference each
        return sum(len(x) if isinstance(x, bytes | str) else 8 for x in array.flat) + array.nbytes
    return array.nbytes
