"""The capture path's cuBLAS calls (``_cublas.py``), on a stand-in for libcublas: which
functions, in which order, with which handle, stream and workspace."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from trioserve.models._cublas import CapturingCublas, loaded_library

MAPS = """\
7f00-7f01 r--p 00000000 fd:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6
7f02-7f03 r-xp 00000000 fd:01 2 /opt/venv/nvidia/cu13/lib/libcublasLt.so.13
7f04-7f05 r-xp 00000000 fd:01 3 /opt/venv/nvidia/cu13/lib/libcublas.so.13
7f06-7f07 rw-p 00000000 00:00 0
"""


def test_the_loaded_library_is_found_by_its_name() -> None:
    assert loaded_library("libcublas.so", MAPS) == "/opt/venv/nvidia/cu13/lib/libcublas.so.13"
    assert loaded_library("libcudnn.so", MAPS) is None


class Library:
    """Records each call; ``fail`` names a function that returns an error status."""

    def __init__(self, fail: str = "") -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        for name in ("cublasCreate_v2", "cublasSetStream_v2", "cublasSetWorkspace_v2",
                     "cublasGemmEx"):  # fmt: skip
            setattr(self, name, self._function(name, 13 if name == fail else 0))

    def _function(self, name: str, status: int) -> Any:
        def function(*args: Any) -> int:
            if name == "cublasCreate_v2":
                args[0]._obj.value = 0x1234  # the handle cuBLAS writes
            self.calls.append((name, args))
            return status

        return function


class Workspace:
    nbytes = 4096
    data = type("Pointer", (), {"ptr": 0x9000})()


def test_a_handle_of_our_own_on_the_stream_and_workspace() -> None:
    library = Library()
    cublas = CapturingCublas(library, 0x5000, Workspace())  # type: ignore[arg-type]
    assert [name for name, _ in library.calls] == [
        "cublasCreate_v2", "cublasSetStream_v2", "cublasSetWorkspace_v2",
    ]  # fmt: skip
    assert library.calls[1][1][1:] == (0x5000,)
    assert library.calls[2][1][1:] == (0x9000, 4096)
    assert cublas.handle.value == 0x1234
    assert library.cublasGemmEx.argtypes is not None and len(library.cublasGemmEx.argtypes) == 19
    cublas.gemm_ex(0, 0, 4, 2, 3, *range(14))
    name, args = library.calls[-1]
    assert name == "cublasGemmEx" and args[0] is cublas.handle and args[1:6] == (0, 0, 4, 2, 3)


def test_a_failing_call_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="cublasSetWorkspace_v2 failed: cuBLAS status 13"):
        CapturingCublas(Library(fail="cublasSetWorkspace_v2"), 0, Workspace())  # type: ignore[arg-type]
    cublas = CapturingCublas(Library(fail="cublasGemmEx"), 0, Workspace())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="cublasGemmEx failed"):
        cublas.gemm_ex(*np.zeros(18, int).tolist())
