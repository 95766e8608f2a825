"""A stand-in for cupy on the host, for the GPU forward's tests on machines with no GPU.

Arrays are numpy arrays with cupy's ``set``/``get`` and ``data.ptr`` (their address);
each kernel of ``_cuda_source.py`` is its numpy arithmetic (the sampler's in
``fake_sampling.py``), taking the same arguments in the same order as the CUDA function,
reading and writing the storage type as the CUDA code does (bfloat16 as ``uint16`` bit
patterns: ``_load``, ``_store``); ``cuda.cublas.gemmEx`` reads its pointer arguments as
cuBLAS does (column-major, leading dimensions). A stream captures what is launched on it
while capturing and a graph replays it, so a forward that reads anything but its
captured buffers goes wrong here as it would on a device. Allocation under
``using_allocator`` goes through the given allocator, as cupy's does.

There is no ``cuda.device``: the capture path's own libcublas handle
(``CapturingCublas.loaded``) stays out of reach, as it must (on a machine with a
libcublas it would be handed host pointers), and captured products go through
``cuda.cublas.gemmEx``, which records them as any launch.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import numpy as np

from .fake_sampling import sample_rows

float16, float32, int32 = np.float16, np.float32, np.int32


class DeviceArray(np.ndarray):
    @property
    def data(self) -> SimpleNamespace:
        return SimpleNamespace(ptr=self.ctypes.data)

    def set(self, host: Any, stream: Any = None) -> None:
        self[...] = host

    def get(self, stream: Any = None, out: Any = None) -> Any:
        if out is None:
            return np.array(self).view(np.ndarray)
        out[...] = self
        return out


class _State:
    recording: list[Callable[[], None]] | None = None
    allocator: Callable[[int], Any] | None = None
    launches = 0
    graph_launches = 0
    allocations = 0


state = _State()


def _device(array: Any) -> DeviceArray:
    return np.asarray(array).view(DeviceArray)


def _allocated(array: Any) -> DeviceArray:
    state.allocations += 1
    if state.allocator is not None:
        state.allocator(array.nbytes)
    return _device(array)


def zeros(shape: Any, dtype: Any = float) -> DeviceArray:
    return _allocated(np.zeros(shape, dtype))


def empty(shape: Any, dtype: Any = float) -> DeviceArray:
    """Floats filled with NaN where a device leaves what was there; uint16 arrays (the
    bfloat16 storage) with bfloat16's NaN."""
    if np.dtype(dtype) == np.uint16:
        return _allocated(np.full(shape, 0x7FC0, dtype))
    return _allocated(
        np.full(shape, np.nan, dtype) if np.dtype(dtype).kind == "f" else np.zeros(shape, dtype)
    )


def asarray(array: Any, dtype: Any = None) -> DeviceArray:
    return _allocated(np.array(array, dtype=dtype))


def ascontiguousarray(array: Any) -> DeviceArray:
    return _allocated(np.ascontiguousarray(array))


def arange(*args: Any, dtype: Any = None) -> DeviceArray:
    return _allocated(np.arange(*args, dtype=dtype))


allclose = np.allclose
array_equal = np.array_equal


def concatenate(arrays: Any, axis: int = 0) -> DeviceArray:
    return _allocated(np.concatenate(arrays, axis=axis))


def _run(operation: Callable[[], None]) -> None:
    """Launch on the stream: recorded while capturing, else run now."""
    if state.recording is not None:
        state.recording.append(operation)
    else:
        state.launches += 1
        operation()


def take(a: Any, indices: Any, axis: int, out: Any) -> Any:
    _run(lambda: np.take(a, indices, axis=axis, out=out))
    return out


def add(a: Any, b: Any, out: Any) -> Any:
    _run(lambda: np.add(a, b, out=out))
    return out


def copyto(destination: Any, source: Any) -> None:
    _run(lambda: np.copyto(destination, source, casting="same_kind"))


def matmul(a: Any, b: Any, out: Any = None) -> Any:
    # cupy's would multiply bfloat16 bit patterns as integers: no caller may ask that.
    assert a.dtype.kind == b.dtype.kind == "f", f"matmul of {a.dtype} and {b.dtype}"
    if out is None:
        out = empty((a.shape[0], b.shape[1]), a.dtype)
    _run(lambda: np.matmul(a.astype(np.float64), b, out=out, casting="unsafe"))
    return out


# -- storage: bfloat16 as its bits, as _cuda_source.py's TS_BF16 --------------------------


def bfloat16_bits(values: Any) -> np.ndarray:
    """float32 ``values`` rounded to bfloat16 bit patterns: ``from_f`` of
    ``_cuda_source.py``'s ``TS_BF16`` branch, the same integer arithmetic (round to
    nearest even; a NaN keeps its sign and upper payload, made quiet)."""
    u = np.ascontiguousarray(values, np.float32).view(np.uint32)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # a NaN may wrap: replaced below
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16)


def bfloat16_values(bits: Any) -> np.ndarray:
    """bfloat16 bit patterns as float32: ``to_f`` of the ``TS_BF16`` branch."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def _load(array: Any) -> np.ndarray:
    """A storage (or float32) array's values, as float64."""
    if array.dtype == np.uint16:
        return bfloat16_values(array).astype(np.float64)
    return np.asarray(array, np.float64)


def _store(out: Any, values: Any) -> None:
    """``values`` into storage ``out``, rounded to its type (to nearest even)."""
    if out.dtype == np.uint16:
        out[...] = bfloat16_bits(values)
    else:
        out[...] = values


# -- cuBLAS ---------------------------------------------------------------------------

_CUDA_TYPES = {0: np.float32, 2: np.float16, 14: np.uint16}  # CUDA_R_32F, _16F, _16BF


def _column_major(pointer: int, kind: int, rows: int, columns: int, ld: int) -> np.ndarray:
    """The matrix at ``pointer`` as cuBLAS reads it: column-major, columns ``ld`` apart."""
    dtype = np.dtype(_CUDA_TYPES[kind])
    count = ld * (columns - 1) + rows
    memory = (ctypes.c_char * (count * dtype.itemsize)).from_address(pointer)
    flat = np.ctypeslib.as_array(memory).view(dtype)
    strides = (dtype.itemsize, ld * dtype.itemsize)
    return np.lib.stride_tricks.as_strided(flat, (rows, columns), strides)


def gemm_now(handle: Any, transa: int, transb: int, m: int, n: int, k: int, alpha: int,
             a: int, a_type: int, lda: int, b: int, b_type: int, ldb: int, beta: int,
             c: int, c_type: int, ldc: int, compute: int, algo: int) -> None:  # fmt: skip
    """cublasGemmEx's arithmetic, run now: C = alpha A B + beta C, float accumulation,
    A (m, k), B (k, n), C (m, n) column-major; alpha and beta host float32 pointers."""
    assert (transa, transb, compute) == (0, 0, 68), "untransposed, CUBLAS_COMPUTE_32F"
    product = _load(_column_major(a, a_type, m, k, lda)) @ _load(
        _column_major(b, b_type, k, n, ldb)
    )
    out = _column_major(c, c_type, m, n, ldc)
    result = ctypes.c_float.from_address(alpha).value * product
    scale = ctypes.c_float.from_address(beta).value
    _store(out, result + scale * _load(out) if scale else result)  # beta 0: C is not read


def _gemm_ex(*args: Any) -> None:
    _run(lambda: gemm_now(*args))


class _Graph:
    def __init__(self, operations: list[Callable[[], None]]) -> None:
        self.operations = operations

    def launch(self, stream: Any = None) -> None:
        state.graph_launches += 1
        for operation in self.operations:
            operation()


class _Stream:
    ptr = 0

    def __init__(self, non_blocking: bool = False) -> None:
        pass

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def begin_capture(self, mode: Any = None) -> None:
        state.recording = []

    def end_capture(self) -> _Graph:
        recorded, state.recording = state.recording or [], None
        return _Graph(recorded)


@contextmanager
def _using_allocator(allocator: Callable[[int], Any]) -> Iterator[None]:
    state.allocator = allocator
    try:
        yield
    finally:
        state.allocator = None


cuda = SimpleNamespace(
    Stream=_Stream,
    Device=lambda: SimpleNamespace(synchronize=lambda: None),
    using_allocator=_using_allocator,
    alloc_pinned_memory=lambda nbytes: bytearray(nbytes),
    runtime=SimpleNamespace(streamCaptureModeRelaxed=1),
    cublas=SimpleNamespace(gemmEx=_gemm_ex),
    get_cublas_handle=lambda: 0x1,
)


# -- the kernels, argument for argument as in _cuda_source.py -------------------------


def _embed(grid: Any, tokens: Any, positions: Any, table: Any, position_table: Any,
           learned: Any, out: Any, hidden: Any) -> None:  # fmt: skip
    rows = grid[0]
    x = _load(table[tokens[:rows]])
    if learned:
        x = x + _load(position_table[positions[:rows]])
    _store(out[:rows], x)


def _add_norm(grid: Any, residual: Any, delta: Any, has_delta: Any, weight: Any, out: Any,
              hidden: Any, eps: Any, mode: Any) -> None:  # fmt: skip
    rows = grid[0]
    if has_delta:
        _store(residual[:rows], _load(residual[:rows]) + _load(delta[:rows]))
    x = _load(residual[:rows])
    if mode == 1:
        normed = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)
    else:
        normed = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * _load(weight)
    _store(out[:rows], normed)


def _rope_cache_write(grid: Any, qkv: Any, bias: Any, has_bias: Any, cos: Any, sin: Any,
                      use_rope: Any, positions: Any, slots: Any, q_out: Any, k_cache: Any,
                      v_cache: Any, heads: Any, kv_heads: Any, head_dim: Any) -> None:  # fmt: skip
    rows = grid[0]
    x = _load(qkv[:rows])
    if has_bias:
        x = x + _load(bias)
    x = x.reshape(rows, heads + 2 * kv_heads, head_dim)
    half = head_dim // 2
    if use_rope:
        c = cos[positions[:rows]][:, None, :]
        s = sin[positions[:rows]][:, None, :]
        first, second = x[..., :half].copy(), x[..., half:].copy()
        rotating = slice(0, heads + kv_heads)
        x[:, rotating, :half] = (first * c - second * s)[:, rotating]
        x[:, rotating, half:] = (second * c + first * s)[:, rotating]
    _store(q_out[:rows], x[:, :heads])
    k_rows = k_cache.reshape(-1, kv_heads, head_dim)
    v_rows = v_cache.reshape(-1, kv_heads, head_dim)
    for row in range(rows):
        if slots[row] >= 0:
            _store(k_rows[slots[row]], x[row, heads : heads + kv_heads])
            _store(v_rows[slots[row]], x[row, heads + kv_heads :])


def _activate(grid: Any, inputs: Any, out: Any, rows: Any, width: Any, mode: Any) -> None:
    x = _load(inputs[:rows])
    if mode == 0:
        gate, up = x[:, :width], x[:, width:]
        _store(out[:rows], gate / (1 + np.exp(-gate)) * up)
    else:
        _store(out[:rows], np.maximum(x, 0))


def _paged_attention(grid: Any, q: Any, out: Any, k_cache: Any, v_cache: Any, token_rows: Any,
                     positions: Any, block_tables: Any, width: Any, heads: Any, kv_heads: Any,
                     head_dim: Any, block_size: Any, scale: Any) -> None:  # fmt: skip
    rows = grid[0]
    tables = block_tables[: block_tables.size // width * width].reshape(-1, width)
    k_rows = k_cache.reshape(-1, kv_heads, head_dim)
    v_rows = v_cache.reshape(-1, kv_heads, head_dim)
    query = q.reshape(-1, heads, head_dim)
    result = out.reshape(-1, heads, head_dim)
    for token in range(rows):
        context = np.arange(positions[token] + 1)
        table = tables[token_rows[token]]
        slots = table[context // block_size] * block_size + context % block_size
        for head in range(heads):
            kv = head // (heads // kv_heads)
            scores = _load(k_rows[slots, kv]) @ _load(query[token, head]) * scale
            weights = np.exp(scores - scores.max())
            _store(result[token, head], weights / weights.sum() @ _load(v_rows[slots, kv]))


def _widen_logits(grid: Any, logits: Any, bias: Any, has_bias: Any, out: Any, total: Any,
                  vocab: Any) -> None:  # fmt: skip
    widened = _load(logits.reshape(-1, vocab)).astype(np.float32)
    out.reshape(-1, vocab)[...] = widened + bias if has_bias else widened


def _argmax_rows(grid: Any, logits: Any, tokens: Any, vocab: Any) -> None:
    tokens[: grid[0]] = logits[: grid[0]].argmax(axis=1)


_KERNELS = {
    "embed": _embed,
    "add_norm": _add_norm,
    "rope_cache_write": _rope_cache_write,
    "activate": _activate,
    "paged_attention": _paged_attention,
    "widen_logits": _widen_logits,
    "argmax_rows": _argmax_rows,
    "sample_rows": sample_rows,  # the device sampler (fake_sampling.py)
}


def signatures(code: str, storage: Any) -> dict[str, list[tuple[str, Any]]]:
    """Each kernel's parameters in ``code``: (name, what it takes: an array's dtype for a
    pointer, a numpy scalar type otherwise)."""
    found = {}
    for match in re.finditer(r'extern "C" __global__ void (\w+)\(([^)]*)\)', code):
        params = []
        for param in match.group(2).split(","):
            words = param.replace("const ", "").split()
            kind, name = " ".join(words[:-1]), words[-1]
            pointer = kind.endswith("*") or name.startswith("*")
            base = kind.rstrip("*").strip()
            dtype = {"scalar_t": storage, "float": np.float32, "int": np.int32,
                     "long long": np.int64}[base]  # fmt: skip
            params.append((name.lstrip("*"), ("array", np.dtype(dtype)) if pointer else dtype))
        found[match.group(1)] = params
    return found


class RawModule:
    """Checks every launch against the CUDA signature (an array of the right dtype,
    C-contiguous, for a pointer; a numpy scalar of the exact type otherwise), then runs
    the kernel's numpy arithmetic."""

    def __init__(self, code: str, options: tuple[str, ...] = ()) -> None:
        storages = {"-DTS_HALF": np.float16, "-DTS_BF16": np.uint16}  # bfloat16's bits
        storage = next((storages[o] for o in options if o in storages), np.float32)
        self.signatures = signatures(code, storage)

    def get_function(self, name: str) -> Callable[..., None]:
        kernel, signature = _KERNELS[name], self.signatures[name]

        def launch(grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...]) -> None:
            assert len(args) == len(signature), f"{name}: {len(args)} arguments"
            for (param, wanted), arg in zip(signature, args, strict=True):
                if isinstance(wanted, tuple):
                    assert isinstance(arg, DeviceArray), f"{name}.{param}: {type(arg)}"
                    assert arg.dtype == wanted[1], f"{name}.{param}: {arg.dtype}"
                    assert arg.flags.c_contiguous, f"{name}.{param} is not contiguous"
                else:
                    assert type(arg) is wanted, f"{name}.{param}: {type(arg)}, not {wanted}"
            _run(lambda: kernel(grid, *args))

        return launch
