"""Which tensors cross a worker's link as bytes in the frame (``inline_tensors``), and
that what crosses reads back as the tensor it was."""

from __future__ import annotations

from typing import Any

import numpy as np

from trioserve._tensor import DATATYPES, array_from_own_raw, array_to_raw
from trioserve._types import OutputTensor
from trioserve.workers._wire import INLINE_BYTES, inline_tensors


def _tensor(name: str, datatype: str, data: np.ndarray[Any, Any]) -> OutputTensor:
    return OutputTensor(name, DATATYPES[datatype], data, {"kept": name})


def test_small_tensors_of_their_datatype_cross_as_their_row_major_bytes() -> None:
    square = np.arange(16, dtype=np.float32).reshape(4, 4)
    tensors = [
        _tensor("A", "INT32", np.arange(6, dtype=np.int32).reshape(2, 3)),
        _tensor("B", "FP32", square.T),  # not contiguous: its bytes in row-major order
    ]
    carried = inline_tensors(tensors)
    assert carried is not None
    assert [(name, dt, shape, params) for name, dt, shape, _, params in carried] == [
        ("A", "INT32", (2, 3), {"kept": "A"}),
        ("B", "FP32", (4, 4), {"kept": "B"}),
    ]
    for (_, dt, shape, payload, _), tensor in zip(carried, tensors, strict=True):
        assert type(payload) is bytes
        assert payload == array_to_raw(tensor.data, tensor.datatype)  # as the general way
        np.testing.assert_array_equal(
            array_from_own_raw(DATATYPES[dt], shape, payload), tensor.data
        )


def test_a_large_a_bytes_or_an_unconverted_tensor_sends_all_the_general_way() -> None:
    small = _tensor("A", "INT32", np.zeros(4, np.int32))
    large = _tensor("L", "UINT8", np.zeros(INLINE_BYTES, np.uint8))
    just_under = _tensor("U", "UINT8", np.zeros(INLINE_BYTES - 1, np.uint8))
    text = _tensor("T", "BYTES", np.array([b"a", b"bc"], dtype=object))
    wider = _tensor("W", "INT32", np.zeros(4, np.int64))  # not yet of its datatype
    assert inline_tensors([small, just_under]) is not None
    for odd in (large, text, wider):
        assert inline_tensors([small, odd]) is None
