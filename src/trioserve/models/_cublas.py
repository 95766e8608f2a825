"""Matrix products for the GPU forward: one cuBLAS GemmEx call each (float accumulation).

Eagerly, through cupy's binding (``cupy.cuda.cublas.gemmEx``, reached through the array
module: the tests' stand-in for cupy provides it) on cupy's handle and the current
stream. cupy refuses every cuBLAS call while a stream captures a CUDA graph, so
for a capture the same call goes, through ctypes, to the libcublas the process has
loaded, on a handle of our own bound to the capturing stream and to a workspace of our
own (cuBLAS may allocate none during a capture; the graph keeps using that workspace).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import numpy as np

from ._storage import BFLOAT16_BITS, to_storage

logger = logging.getLogger("trioserve.models")

Array = Any  # a cupy ndarray
WORKSPACE_BYTES = 32 << 20  # what cuBLAS asks of a user workspace on Hopper

_OP_N = 0
_COMPUTE_32F = 68  # CUBLAS_COMPUTE_32F
_ALGO_DEFAULT = -1  # CUBLAS_GEMM_DEFAULT


def loaded_library(prefix: str, maps: str) -> str | None:
    """The path of the first mapped file whose name starts with ``prefix`` in ``maps``
    (the text of ``/proc/self/maps``)."""
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and Path(fields[5]).name.startswith(prefix):
            return fields[5]
    return None


class CapturingCublas:
    """libcublas through ctypes, a handle of our own on ``stream`` with ``workspace``."""

    def __init__(self, library: ctypes.CDLL, stream_ptr: int, workspace: Array) -> None:
        self.library = library
        self.workspace = workspace  # the graphs use it for as long as they live
        pointer, integer = ctypes.c_void_p, ctypes.c_int
        library.cublasCreate_v2.argtypes = [ctypes.POINTER(pointer)]
        library.cublasSetStream_v2.argtypes = [pointer, pointer]
        library.cublasSetWorkspace_v2.argtypes = [pointer, pointer, ctypes.c_size_t]
        library.cublasGemmEx.argtypes = [
            pointer, integer, integer, integer, integer, integer,
            pointer, pointer, integer, integer, pointer, integer, integer,
            pointer, pointer, integer, integer, integer, integer,
        ]  # fmt: skip
        for function in ("cublasCreate_v2", "cublasSetStream_v2", "cublasSetWorkspace_v2",
                         "cublasGemmEx"):  # fmt: skip
            getattr(library, function).restype = integer
        self.handle = pointer()
        self._check("cublasCreate_v2", library.cublasCreate_v2(ctypes.byref(self.handle)))
        self._check("cublasSetStream_v2", library.cublasSetStream_v2(self.handle, stream_ptr))
        self._check(
            "cublasSetWorkspace_v2",
            library.cublasSetWorkspace_v2(self.handle, workspace.data.ptr, workspace.nbytes),
        )

    @classmethod
    def loaded(cls, cupy: ModuleType, stream: Any) -> CapturingCublas:
        """On the libcublas this process loaded (cupy's, found in /proc/self/maps)."""
        cupy.cuda.device.get_cublas_handle()  # cupy loads libcublas for its own handle
        path = loaded_library("libcublas.so", Path("/proc/self/maps").read_text())
        path = path or ctypes.util.find_library("cublas")
        if path is None:
            raise RuntimeError("libcublas is not loaded")
        workspace = cupy.empty(WORKSPACE_BYTES, np.uint8)
        return cls(ctypes.CDLL(path), stream.ptr, workspace)

    def gemm_ex(self, *args: Any) -> None:
        """cublasGemmEx on our handle; ``args`` as cupy's ``gemmEx`` after its handle."""
        self._check("cublasGemmEx", self.library.cublasGemmEx(self.handle, *args))

    @staticmethod
    def _check(function: str, status: int) -> None:
        if status != 0:
            raise RuntimeError(f"{function} failed: cuBLAS status {status}")


class Gemm:
    """``out = a @ b`` for C-contiguous 2-D arrays of one dtype: no temporary, no copy.
    Checked against ``cupy.matmul`` once, on ``stream`` (the current one); should cuBLAS
    refuse the direct call, every float product goes through ``cupy.matmul`` instead.
    bfloat16 products (``storage`` ``BFLOAT16_BITS``) have no such way round: they are
    checked once more, in bfloat16, and refused (an error) without the direct call."""

    _CUDA_TYPES: ClassVar = {
        np.dtype(np.float32): 0,  # CUDA_R_32F
        np.dtype(np.float16): 2,  # CUDA_R_16F
        BFLOAT16_BITS: 14,  # CUDA_R_16BF
    }

    def __init__(self, cupy: ModuleType, stream: Any, storage: np.dtype[Any]) -> None:
        self.cupy = cupy
        self.stream = stream
        self._one = np.ones(1, np.float32)  # host scalars: cuBLAS's default pointer mode
        self._zero = np.zeros(1, np.float32)
        self.direct = True
        self.unavailable = ""  # why the direct call is not used
        self._capturing: CapturingCublas | None = None
        self._for_capture: CapturingCublas | None = None
        try:
            a = cupy.arange(6, dtype=np.float16).reshape(2, 3)
            b = cupy.arange(12, dtype=np.float16).reshape(3, 4)
            out = cupy.empty((2, 4), np.float16)
            self(a, b, out)
            stream.synchronize()
            if not bool(cupy.array_equal(out, cupy.matmul(a, b))):
                raise RuntimeError("cuBLAS GemmEx disagrees with cupy.matmul")
        except Exception as exc:
            logger.warning("direct cuBLAS products unavailable, using cupy.matmul: %r", exc)
            self.direct = False
            self.unavailable = repr(exc)
        if storage == BFLOAT16_BITS:
            self._check_bfloat16()

    def _check_bfloat16(self) -> None:
        """Raise unless a bfloat16 product of small integers (exact in bfloat16) comes
        out exact: a model whose products cannot be made fails to load."""
        a, b = np.arange(6.0).reshape(2, 3), np.arange(12.0).reshape(3, 4)
        out = self.cupy.empty((2, 4), BFLOAT16_BITS)
        a_bits, b_bits = (self.cupy.asarray(to_storage(x, BFLOAT16_BITS)) for x in (a, b))
        self(a_bits, b_bits, out)
        self.stream.synchronize()
        if not np.array_equal(out.get(), to_storage(a @ b, BFLOAT16_BITS)):
            raise RuntimeError("cuBLAS GemmEx's bfloat16 product differs from the host's")

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """Products inside go to libcublas itself (see the module docstring); where it
        cannot be reached, they go as outside, which a real capture then refuses."""
        if self._for_capture is None and self.direct:
            try:
                self._for_capture = CapturingCublas.loaded(self.cupy, self.stream)
            except Exception as exc:
                logger.warning("libcublas unreachable for graph capture: %r", exc)
        self._capturing = self._for_capture
        try:
            yield
        finally:
            self._capturing = None

    def __call__(self, a: Array, b: Array, out: Array) -> None:
        if not self.direct:
            if a.dtype == BFLOAT16_BITS:  # cupy.matmul would multiply the bits as integers
                raise RuntimeError(
                    f"bfloat16 products need cuBLAS GemmEx, which is unavailable: {self.unavailable}"
                )
            self.cupy.matmul(a, b, out=out)
            return
        rows, inner = a.shape
        columns = b.shape[1]
        kind = self._CUDA_TYPES[np.dtype(a.dtype)]
        # Row-major out = a @ b is column-major out^T = b^T @ a^T: b first.
        args = (
            _OP_N, _OP_N, columns, rows, inner,
            self._one.ctypes.data, b.data.ptr, kind, columns,
            a.data.ptr, kind, inner,
            self._zero.ctypes.data, out.data.ptr, kind, columns,
            _COMPUTE_32F, _ALGO_DEFAULT,
        )  # fmt: skip
        if self._capturing is not None:
            self._capturing.gemm_ex(*args)
            return
        # cupy.cuda.cublas is cupy_backends.cuda.libs.cublas (what ``from cupy.cuda
        # import cublas`` gives) and cupy.cuda.get_cublas_handle is cupy.cuda.device's.
        cuda = self.cupy.cuda
        cuda.cublas.gemmEx(cuda.get_cublas_handle(), *args)
