"""Marks for the tests that need a CUDA device, or its absence."""

from __future__ import annotations

from typing import TypeVar

import pytest

T = TypeVar("T")


def cuda_devices() -> int:
    """How many CUDA devices cupy sees (0 without cupy)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def on_a_device(test: T) -> T:
    """gpu-marked, and skipped without cupy and a CUDA device."""
    skipped = pytest.mark.skipif(cuda_devices() == 0, reason="needs cupy and a CUDA device")
    return pytest.mark.gpu(skipped(test))  # type: ignore[no-any-return]
