"""The GPU forward's CUDA source compiles with NVRTC, for each storage type.

NVRTC needs no driver and no device: with the ``nvidia-cuda-nvrtc-cu12`` wheel (or a
CUDA toolkit's libnvrtc on the loader's path) this runs on any machine; without it the
test is skipped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
from pathlib import Path

import pytest

from trioserve.models._cuda_source import KERNEL_NAMES, SOURCE


def _nvrtc() -> ctypes.CDLL | None:
    candidates = []
    spec = (
        importlib.util.find_spec("nvidia.cuda_nvrtc")
        if importlib.util.find_spec("nvidia")
        else None
    )
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidates += sorted(Path(folder, "lib").glob("libnvrtc.so*"))
    found = ctypes.util.find_library("nvrtc")
    if found:
        candidates.append(Path(found))
    for candidate in candidates:
        if "builtins" in candidate.name or ".alt." in candidate.name:
            continue
        try:
            return ctypes.CDLL(str(candidate))
        except OSError:
            continue
    return None


NVRTC = _nvrtc()
pytestmark = pytest.mark.skipif(NVRTC is None, reason="needs NVRTC (nvidia-cuda-nvrtc-cu12)")


def _compile(options: list[str]) -> tuple[int, str, bytes]:
    """NVRTC's result code, its log, and the PTX."""
    assert NVRTC is not None
    program = ctypes.c_void_p()
    status = NVRTC.nvrtcCreateProgram(
        ctypes.byref(program), SOURCE.encode(), b"kernels.cu", 0, None, None
    )
    assert status == 0
    try:
        encoded = [o.encode() for o in options]
        array = (ctypes.c_char_p * len(encoded))(*encoded)
        result = NVRTC.nvrtcCompileProgram(program, len(encoded), array)
        size = ctypes.c_size_t()
        NVRTC.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        NVRTC.nvrtcGetProgramLog(program, log)
        ptx = b""
        if result == 0:
            NVRTC.nvrtcGetPTXSize(program, ctypes.byref(size))
            buffer = ctypes.create_string_buffer(size.value)
            NVRTC.nvrtcGetPTX(program, buffer)
            ptx = buffer.value
        return result, log.value.decode(errors="replace"), ptx
    finally:
        NVRTC.nvrtcDestroyProgram(ctypes.byref(program))


STORAGE_OPTIONS = {"float": [], "half": ["-DTS_HALF"], "bfloat16": ["-DTS_BF16"]}


@pytest.mark.parametrize("storage", sorted(STORAGE_OPTIONS))
def test_kernels_compile_for_hopper(storage):
    result, log, ptx = _compile(["--gpu-architecture=compute_90", *STORAGE_OPTIONS[storage]])
    assert result == 0, log
    assert "warning" not in log.lower(), log
    for name in KERNEL_NAMES:  # every kernel the forward launches is in the module
        assert f".entry {name}(".encode() in ptx


def test_bfloat16_storage_needs_no_bfloat16_hardware():
    """Its conversions are integer arithmetic: Turing (no bfloat16 unit) compiles them."""
    result, log, ptx = _compile(["--gpu-architecture=compute_75", "-DTS_BF16"])
    assert result == 0, log
    assert "warning" not in log.lower(), log
    assert b".entry paged_attention(" in ptx


def test_a_broken_source_fails_to_compile():
    """The check can fail: NVRTC refuses what is not CUDA C."""
    assert NVRTC is not None
    program = ctypes.c_void_p()
    NVRTC.nvrtcCreateProgram(ctypes.byref(program), b"__global__ void f( {", b"x.cu", 0, None, None)
    try:
        options = (ctypes.c_char_p * 1)(b"--gpu-architecture=compute_90")
        assert NVRTC.nvrtcCompileProgram(program, 1, options) != 0
    finally:
        NVRTC.nvrtcDestroyProgram(ctypes.byref(program))
