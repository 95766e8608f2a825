"""The response cache on its own: keys, least-recently-used eviction within a byte limit."""

from __future__ import annotations

import numpy as np
import pytest

from trioserve import (
    InferenceRequest,
    InferenceResponse,
    InputTensor,
    OutputTensor,
    RequestedOutput,
)
from trioserve._tensor import datatype
from trioserve.scheduler._cache import (
    _ENTRY_OVERHEAD_BYTES,
    ResponseCache,
    cache_key,
    cache_size_from_flags,
)

INT32 = datatype("INT32")


def request(values, *, name="X", dt="INT32", outputs=(), **parameters) -> InferenceRequest:
    data = np.asarray(values, dtype=object if dt == "BYTES" else datatype(dt).dtype)
    tensor = InputTensor(name, datatype(dt), data.shape, data)
    return InferenceRequest(
        "m", "", {name: tensor}, [RequestedOutput(o) for o in outputs], parameters=parameters
    )


def response(values, name="Y") -> InferenceResponse:
    return InferenceResponse("m", "1", [OutputTensor(name, INT32, np.asarray(values, np.int32))])


def test_key_covers_everything_that_decides_the_result():
    base = cache_key(request([1, 2]), "m", "1")
    assert cache_key(request([1, 2]), "m", "1") == base
    assert (
        cache_key(request([1, 2], priority=1, timeout=5, binary_data_output=True), "m", "1") == base
    )
    different = [
        cache_key(request([1, 2]), "other", "1"),
        cache_key(request([1, 2]), "m", "2"),
        cache_key(request([1, 3]), "m", "1"),
        cache_key(request([[1, 2]]), "m", "1"),  # shape
        cache_key(request([1, 2], dt="UINT32"), "m", "1"),  # datatype, same bytes
        cache_key(request([1, 2], name="W"), "m", "1"),
        cache_key(request([1, 2], outputs=["Y"]), "m", "1"),
        cache_key(request([1, 2], scale=2), "m", "1"),  # a parameter the model may read
    ]
    assert len({base, *different}) == len(different) + 1
    assert cache_key(request([b"a", b"b"], dt="BYTES"), "m", "1") != cache_key(
        request([b"ab", b""], dt="BYTES"), "m", "1"
    )


def test_hits_answer_with_the_new_request_id_and_frozen_copies():
    cache = ResponseCache(1 << 20)
    source = response([1, 2, 3])
    cache.insert(b"k", source)
    source.outputs[0].data[0] = 99  # the model's buffer changes later: the entry must not
    asked = request([0])
    asked.id = "second"
    hit = cache.lookup(b"k", asked)
    assert hit is not None and hit.id == "second" and hit.model_version == "1"
    assert hit.outputs[0].data.tolist() == [1, 2, 3]
    assert not hit.outputs[0].data.flags.writeable
    assert cache.lookup(b"missing", asked) is None


def test_least_recently_used_goes_first_within_the_byte_limit():
    entry = _ENTRY_OVERHEAD_BYTES + 4 * 4  # four int32
    cache = ResponseCache(3 * entry)
    for key in (b"a", b"b", b"c"):
        cache.insert(key, response([1, 2, 3, 4]))
    assert cache.lookup(b"a", request([0])) is not None  # a is now the most recent
    cache.insert(b"d", response([5, 6, 7, 8]))  # evicts b, the least recently used
    assert cache.lookup(b"b", request([0])) is None
    assert all(cache.lookup(k, request([0])) is not None for k in (b"a", b"c", b"d"))
    stats = cache.statistics()
    assert (stats.entries, stats.used_bytes, stats.evictions) == (3, 3 * entry, 1)
    cache.insert(b"huge", response(list(range(1000))))  # larger than the cache: not stored
    assert cache.lookup(b"huge", request([0])) is None and cache.statistics().evictions == 1


def test_cache_flags():
    assert cache_size_from_flags([]) == 0
    assert cache_size_from_flags(["local,size=1048576"]) == 1048576
    for bad, message in [
        (["redis,size=5"], "only the 'local'"),
        (["local,bytes=5"], "local,size=BYTES"),
        (["local,size=-1"], "number of bytes"),
    ]:
        with pytest.raises(ValueError, match=message):
            cache_size_from_flags(bad)
    with pytest.raises(ValueError, match="size in bytes"):
        ResponseCache(0)
