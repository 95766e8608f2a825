"""The GPU forward's storage dtypes: float32, float16 and bfloat16.

cupy has no bfloat16 dtype, so a bfloat16 device array is a ``uint16`` array of the
bfloat16 bit patterns (a float32's upper half): throughout the GPU forward a storage
dtype of ``BFLOAT16_BITS`` means bfloat16. Only the kernels (``_cuda_source.py``,
compiled with ``-DTS_BF16``) and cuBLAS (``CUDA_R_16BF``) compute on such arrays:
anything else would take the bit patterns for integers (``cupy.matmul`` multiplies them
as such, ``fill(np.nan)`` writes no NaN).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import DTypeLike

BFLOAT16_BITS = np.dtype(np.uint16)
BFLOAT16_NAN = np.uint16(0x7FC0)  # the quiet NaN, float32's NaN rounded to bfloat16


def to_storage(array: Any, dtype: DTypeLike) -> np.ndarray[Any, Any]:
    """``array`` (host) in storage ``dtype``; to bfloat16 rounded to nearest even by
    ml_dtypes (the ``checkpoints`` extra), and a bfloat16 array (as safetensors reads
    one) as it is: its bits, no rounding."""
    host = np.asarray(array)
    if np.dtype(dtype) != BFLOAT16_BITS:
        return host.astype(dtype)
    import ml_dtypes

    return host.astype(ml_dtypes.bfloat16, copy=False).view(BFLOAT16_BITS)


def nan_of(dtype: DTypeLike) -> Any:
    """A NaN of storage ``dtype``, to fill a buffer of it with."""
    return BFLOAT16_NAN if np.dtype(dtype) == BFLOAT16_BITS else np.nan
