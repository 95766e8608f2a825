"""The built-in models' forward on a CUDA device: cupy, fused kernels, CUDA graphs.

The numpy forward (``_llama.py``, ``_tiny_lm.py`` over ``_paged_attention.py``) is the
reference; this is the same arithmetic arranged for a GPU:

- weights, activations and the KV cache in the storage dtype (float32, float16, or
  bfloat16 kept as its bit patterns: ``_storage.py``), float accumulation in the norms,
  the softmax and attention, one cuBLAS GemmEx call per matrix product (``Gemm``);
- all of a step's sequences in one batched forward: each layer is an add+norm kernel, a
  QKV matmul, one kernel for biases, rotary and the KV-cache write, one paged-attention
  kernel for every token of every sequence, the output matmul, an add+norm, the MLP's
  two matmuls around one activation kernel (``_cuda_source.py`` has the kernels);
- the logits widened to float32 and each sequence's greedy token by a device argmax, so
  a step whose samples are all greedy copies back only token ids
  (``step(batch, greedy=True)``); a step of random draws (temperature, top-k, top-p,
  min-p, seeds, logprobs, penalties) draws them on the device too (``sample(batch, draws)``,
  ``_gpu_sampling.py``: tokens and the logprobs asked for come back), once the sampler
  has matched its numpy reference at load (else every such step copies back float32
  logits);
- with ``graphs=True``, a decode step (one token per sequence) runs as one CUDA graph
  launch: a graph is captured at load for each batch-size bucket (1, 2, 4, ...
  ``max_num_seqs``) over buffers of its own that live as long as the graph, the batch
  padded to its bucket; its integers are copied into the bucket's input buffer first
  (``_gpu_inputs.py``). Capture runs under an allocator that refuses every allocation,
  so no operation can leave the graph pointing into memory the pool hands out again;
  the products go to libcublas itself (``_cublas.py``: cupy refuses cuBLAS calls while
  capturing); a graph is kept only if its replay matches the eager forward, and a
  bucket without one runs eagerly (``graph_failures`` says why). Served models use
  them (``serving``): on an H200 every bucket captured and replayed the eager tokens,
  and a 1 B model's decode step went from 2.6 to 1.8 ms at batch 1.

A ``GpuForward`` owns the KV cache and is driven from one thread at a time (the
engine's steps never overlap); its work runs on a stream of its own.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import numpy as np

from .._generative import DeviceDraw, GenerativeModel, SampledTokens, StepSequence
from ._cublas import Gemm
from ._cuda_source import ATTENTION_WARPS, KERNEL_NAMES, MAX_HEAD_DIM, SOURCE
from ._gpu_inputs import bucket_for, decode_buckets, is_decode, pack_step, packed_size, part
from ._gpu_sampling import DeviceSampler, check_sampler
from ._storage import BFLOAT16_BITS, nan_of

logger = logging.getLogger("trioserve.models")

Array = Any  # a cupy ndarray
_NORM_MODES = {"rms": 0, "layer": 1}
_MLP_MODES = {"swiglu": 0, "relu": 1}
_THREADS = 256
_STORAGE_OPTIONS = {  # how _cuda_source.py's scalar_t is stored
    np.dtype(np.float32): (),
    np.dtype(np.float16): ("-DTS_HALF",),
    BFLOAT16_BITS: ("-DTS_BF16",),
}


@dataclass(frozen=True)
class GpuShape:
    """What the forward's buffers and kernels need to know of a model."""

    vocab: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_width: int  # the activation's output width (intermediate_size, d_ff)
    norm: Literal["rms", "layer"]  # RMSNorm times weight, or LayerNorm without weight
    eps: float
    mlp: Literal["swiglu", "relu"]
    inverse_frequencies: tuple[float, ...] | None = None  # rotary, or none
    attention_factor: float = 1.0


@dataclass(frozen=True)
class GpuLayer:
    input_norm: Array | None
    qkv: Array  # (hidden, (heads + 2 kv_heads) * head_dim): q, k, v side by side
    qkv_bias: Array | None
    o: Array
    post_norm: Array | None
    up: Array  # (hidden, 2 mlp_width) [gate | up] for SwiGLU, (hidden, mlp_width) for ReLU
    down: Array


@dataclass(frozen=True)
class GpuWeights:
    embed: Array
    positions: Array | None  # learned position rows (tiny_lm), or None
    layers: Sequence[GpuLayer]
    final_norm: Array | None
    lm_head: Array  # (hidden, vocab), contiguous
    logit_bias: Array | None


class _Kernels:
    """The module compiled for one storage dtype."""

    def __init__(self, cupy: ModuleType, dtype: np.dtype[Any]) -> None:
        module = cupy.RawModule(code=SOURCE, options=_STORAGE_OPTIONS[np.dtype(dtype)])
        self.functions = {name: module.get_function(name) for name in KERNEL_NAMES}

    def __call__(self, name: str, grid: tuple[int, ...], block: int, *args: Any) -> None:
        self.functions[name](grid, (block,), args)


class _Workspace:
    """Every buffer one forward of ``rows`` tokens and ``entries`` sequences writes."""

    def __init__(
        self, xp: ModuleType, shape: GpuShape, dtype: Any, rows: int, entries: int, width: int
    ) -> None:
        self.rows, self.entries, self.width = rows, entries, width
        self.ints = xp.zeros(packed_size(rows, entries, width), dtype=np.int32)
        s = shape
        qkv_width = (s.heads + 2 * s.kv_heads) * s.head_dim
        mlp_in = 2 * s.mlp_width if s.mlp == "swiglu" else s.mlp_width
        self.residual = xp.empty((rows, s.hidden), dtype)
        self.normed = xp.empty((rows, s.hidden), dtype)
        self.delta = xp.empty((rows, s.hidden), dtype)
        self.qkv = xp.empty((rows, qkv_width), dtype)
        self.q = xp.empty((rows, s.heads, s.head_dim), dtype)
        self.attended = xp.empty((rows, s.heads * s.head_dim), dtype)
        self.mlp_in = xp.empty((rows, mlp_in), dtype)
        self.mlp_out = xp.empty((rows, s.mlp_width), dtype)
        self.last = None if rows == entries else xp.empty((entries, s.hidden), dtype)
        self.logits = xp.empty((entries, s.vocab), dtype)
        self.logits32 = self.logits if dtype == np.float32 else xp.empty((entries, s.vocab), "f4")
        self.tokens = xp.empty(entries, np.int32)

    def part(self, name: str) -> Array:
        return part(self.ints, name, self.rows, self.entries, self.width)

    def intermediates(self) -> list[Array]:
        """The activation and logits buffers a forward writes before it reads them."""
        found = [self.residual, self.normed, self.delta, self.qkv, self.q, self.attended,
                 self.mlp_in, self.mlp_out, self.logits, self.logits32]  # fmt: skip
        return found if self.last is None else [*found, self.last]


class ServedOnDevice:
    """A generative model's device steps, for a model whose ``gpu`` is its forward
    once loaded on a GPU (None on the CPU): greedy tokens and device draws serve then."""

    gpu: GpuForward | None

    @property
    def greedy_on_device(self) -> bool:
        return self.gpu is not None

    @property
    def sampling_on_device(self) -> bool:
        return self.gpu is not None and self.gpu.samples_on_device

    def step_greedy(self, batch: Sequence[StepSequence]) -> np.ndarray[Any, Any]:
        assert self.gpu is not None, "greedy steps on the device only"
        return self.gpu.step(batch, greedy=True)

    def step_sample(
        self, batch: Sequence[StepSequence], draws: Sequence[DeviceDraw]
    ) -> SampledTokens:
        assert self.gpu is not None, "device draws on the device only"
        return self.gpu.sample(batch, draws)


def _refuse_allocation(size: int) -> Any:
    raise RuntimeError(f"an operation allocated {size} bytes during graph capture")


class GpuForward:
    """One model's forward on the device; see the module docstring."""

    def __init__(
        self,
        cupy: ModuleType,
        shape: GpuShape,
        weights: GpuWeights,
        *,
        num_layers: int,
        num_kv_blocks: int,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        graphs: bool = False,
    ) -> None:
        if shape.head_dim > MAX_HEAD_DIM or shape.head_dim % 2:
            raise ValueError(f"head_dim {shape.head_dim}: the GPU forward serves even ones <= 256")
        if num_kv_blocks * block_size >= 2**31:
            raise ValueError("the KV cache's slots must fit int32")
        self.xp = cupy
        self.shape = shape
        self.weights = weights
        self.dtype = weights.embed.dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.table_width = -(-max_model_len // block_size)
        self.buckets = decode_buckets(max_num_seqs)
        self.use_graphs = graphs  # False: every step eager (a comparison)
        self.graph_failures: dict[int, str] = {}
        # bucket: (buffers, graph or None)
        self._decode: dict[int, tuple[_Workspace, Any]] = {}
        self._pinned: dict[tuple[int, int], np.ndarray[Any, Any]] = {}
        self._turn = 0
        self.kernels = _Kernels(cupy, self.dtype)
        # All of the forward's work, allocations included, runs on its own stream, which
        # does not wait for the legacy default one: the weights, copied there by the
        # loading thread, are waited for here once.
        cupy.cuda.Device().synchronize()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        with self.stream:
            cache = (num_layers, num_kv_blocks, block_size, shape.kv_heads, shape.head_dim)
            self.k_cache = cupy.zeros(cache, self.dtype)
            self.v_cache = cupy.zeros(cache, self.dtype)
            self.gemm = Gemm(cupy, self.stream, self.dtype)
            self._nothing = cupy.zeros(1, self.dtype)
            self._nothing_f32 = cupy.zeros(1, np.float32)
            self.cos, self.sin = self._rotation_tables()
            if graphs:
                for bucket in self.buckets:
                    self._capture(bucket)
            self.sampler = DeviceSampler(cupy, self.kernels, self.stream, shape.vocab)
            self.sampling_failure = self._check_sampler()
        self.stream.synchronize()

    @classmethod
    def serving(
        cls,
        model: GenerativeModel,
        cupy: ModuleType,
        shape: GpuShape,
        weights: GpuWeights,
        num_layers: int,
        graphs: bool = True,
    ) -> GpuForward:
        """The forward of ``model``: its cache and decode graphs sized by the model's
        engine settings (``graphs=False``: every step eager)."""
        return cls(
            cupy,
            shape,
            weights,
            num_layers=num_layers,
            num_kv_blocks=model.num_kv_blocks,
            block_size=model.block_size,
            max_model_len=model.max_model_len,
            max_num_seqs=model.max_num_seqs,
            graphs=graphs,
        )

    # -- the engine's side ----------------------------------------------------------

    def step(self, batch: Sequence[StepSequence], *, greedy: bool = False) -> np.ndarray[Any, Any]:
        """Logits (entries, vocab) as float32 on the host, or with ``greedy`` only each
        entry's argmax token (entries,). The logits array is reused two steps later."""
        entries = len(batch)
        with self.stream:
            workspace = self._forward(batch)
            if greedy:
                tokens: np.ndarray[Any, Any] = workspace.tokens[:entries].get(stream=self.stream)
                self.stream.synchronize()
                return tokens
            host = self._host_logits(entries)
            workspace.logits32[:entries].get(stream=self.stream, out=host)
            self.stream.synchronize()
            return host

    def sample(self, batch: Sequence[StepSequence], draws: Sequence[DeviceDraw]) -> SampledTokens:
        """The step's forward, then each draw's token chosen on the device
        (``_gpu_sampling``): only tokens and the logprobs asked for are copied back."""
        with self.stream:
            return self.sampler.sample(self._forward(batch).logits32, draws)

    @property
    def samples_on_device(self) -> bool:
        """Whether the device sampler passed its check at load (``sampling_failure``)."""
        return self.sampling_failure is None

    def _forward(self, batch: Sequence[StepSequence]) -> _Workspace:
        """Launch the step's forward on the current stream (the forward's); its
        workspace holds the logits once the stream gets there."""
        bucket = bucket_for(len(batch), self.buckets) if is_decode(batch) else None
        if bucket is not None:  # padded to its bucket, over the bucket's buffers
            workspace, graph = self._bucket(bucket)
            packed = pack_step(batch, self.block_size, pad_to=bucket, width=workspace.width)
            workspace.ints.set(packed.ints, stream=self.stream)
            if graph is not None and self.use_graphs:
                graph.launch(self.stream)
            else:
                self._launch(workspace)
            return workspace
        packed = pack_step(batch, self.block_size)
        workspace = _Workspace(
            self.xp, self.shape, self.dtype, packed.rows, packed.entries, packed.width
        )
        workspace.ints.set(packed.ints, stream=self.stream)
        self._launch(workspace)
        return workspace

    def _check_sampler(self) -> str | None:
        """Why the device sampler cannot serve (it disagrees with its numpy reference
        on fixed draws, or fails), or None: a wrong kernel serves no token."""
        try:
            failure = check_sampler(self.sampler.sample, self.xp, self.shape.vocab)
        except Exception as exc:
            failure = repr(exc)
        if failure is not None:
            logger.warning("device sampler not used, tokens are drawn on the host: %s", failure)
        return failure

    def _host_logits(self, entries: int) -> np.ndarray[Any, Any]:
        """A pinned host buffer for a step's logits: two of each size, used in turn, so
        the array a step returns stays intact while the engine samples from it."""
        self._turn ^= 1
        key = (entries, self._turn)
        if key not in self._pinned:
            nbytes = entries * self.shape.vocab * 4
            memory = self.xp.cuda.alloc_pinned_memory(nbytes)
            array = np.frombuffer(memory, np.float32, entries * self.shape.vocab)
            self._pinned[key] = array.reshape(entries, self.shape.vocab)
        return self._pinned[key]

    @property
    def graphed(self) -> list[int]:
        """The buckets whose decode steps run as one graph launch."""
        return sorted(b for b, (_, graph) in self._decode.items() if graph is not None)

    def graph(self, bucket: int) -> Any:
        """The decode graph of ``bucket`` (None: none was captured)."""
        return self._decode.get(bucket, (None, None))[1]

    def _bucket(self, bucket: int) -> tuple[_Workspace, Any]:
        """A decode bucket's buffers (made at first use when eager) and its graph, if
        one was captured: decode steps allocate nothing."""
        if bucket not in self._decode:
            workspace = _Workspace(
                self.xp, self.shape, self.dtype, bucket, bucket, self.table_width
            )
            self._decode[bucket] = (workspace, None)
        return self._decode[bucket]

    # -- the forward ----------------------------------------------------------------

    def _launch(self, ws: _Workspace) -> None:
        """Every kernel and matmul of one forward, on the current stream."""
        xp, s, w, run, gemm = self.xp, self.shape, self.weights, self.kernels, self.gemm
        rows = ws.rows
        learned = w.positions is not None
        run(
            "embed", (rows,), _THREADS,
            ws.part("tokens"), ws.part("positions"), w.embed,
            w.positions if learned else self._nothing, np.int32(learned),
            ws.residual, np.int32(s.hidden),
        )  # fmt: skip
        for i, layer in enumerate(w.layers):
            self._add_norm(ws, i > 0, layer.input_norm)
            gemm(ws.normed, layer.qkv, ws.qkv)
            biased = layer.qkv_bias is not None
            roped = s.inverse_frequencies is not None
            run(
                "rope_cache_write", (rows,), 128,
                ws.qkv, layer.qkv_bias if biased else self._nothing, np.int32(biased),
                self.cos, self.sin, np.int32(roped),
                ws.part("positions"), ws.part("slots"),
                ws.q, self.k_cache[i], self.v_cache[i],
                np.int32(s.heads), np.int32(s.kv_heads), np.int32(s.head_dim),
            )  # fmt: skip
            run(
                "paged_attention", (rows, s.heads), 32 * ATTENTION_WARPS,
                ws.q, ws.attended, self.k_cache[i], self.v_cache[i],
                ws.part("token_rows"), ws.part("positions"), ws.part("block_tables"),
                np.int32(ws.width), np.int32(s.heads), np.int32(s.kv_heads),
                np.int32(s.head_dim), np.int32(self.block_size), np.float32(s.head_dim**-0.5),
            )  # fmt: skip
            gemm(ws.attended, layer.o, ws.delta)
            self._add_norm(ws, True, layer.post_norm)
            gemm(ws.normed, layer.up, ws.mlp_in)
            run(
                "activate", (min(-(-rows * s.mlp_width // _THREADS), 65535),), _THREADS,
                ws.mlp_in, ws.mlp_out, np.int64(rows), np.int32(s.mlp_width),
                np.int32(_MLP_MODES[s.mlp]),
            )  # fmt: skip
            gemm(ws.mlp_out, layer.down, ws.delta)
        self._add_norm(ws, True, w.final_norm)
        last = ws.normed
        if ws.last is not None:
            last = xp.take(ws.normed, ws.part("last_rows"), axis=0, out=ws.last)
        gemm(last, w.lm_head, ws.logits)
        biased = w.logit_bias is not None
        if biased or ws.logits32 is not ws.logits:
            total = ws.entries * s.vocab
            run(
                "widen_logits", (min(-(-total // _THREADS), 65535),), _THREADS,
                ws.logits, w.logit_bias if biased else self._nothing_f32, np.int32(biased),
                ws.logits32, np.int64(total), np.int32(s.vocab),
            )  # fmt: skip
        run("argmax_rows", (ws.entries,), _THREADS, ws.logits32, ws.tokens, np.int32(s.vocab))

    def _add_norm(self, ws: _Workspace, add: bool, weight: Array | None) -> None:
        self.kernels(
            "add_norm", (ws.rows,), _THREADS,
            ws.residual, ws.delta, np.int32(add),
            self._nothing if weight is None else weight, ws.normed,
            np.int32(self.shape.hidden), np.float32(self.shape.eps),
            np.int32(_NORM_MODES[self.shape.norm]),
        )  # fmt: skip

    def _rotation_tables(self) -> tuple[Array, Array]:
        """cos and sin (positions, head_dim / 2) as Hugging Face computes them: the angle
        a float32 product, the attention factor applied in float32."""
        frequencies = self.shape.inverse_frequencies
        if frequencies is None:
            return self._nothing_f32, self._nothing_f32
        positions = np.arange(self.max_model_len, dtype=np.float32)
        angles = positions[:, None] * np.asarray(frequencies, dtype=np.float32)[None, :]
        factor = np.float32(self.shape.attention_factor)
        return (
            self.xp.asarray(np.cos(angles) * factor),
            self.xp.asarray(np.sin(angles) * factor),
        )

    # -- CUDA graphs ----------------------------------------------------------------

    def _capture(self, bucket: int) -> None:
        """The decode graph of ``bucket`` sequences, over buffers of its own (on the
        forward's stream, the current one), kept only if its replay gives what the
        eager forward gives."""
        cupy = self.xp
        ws = _Workspace(cupy, self.shape, self.dtype, bucket, bucket, self.table_width)
        ws.part("slots")[...] = -1  # the warm-up and the capture write no cache slot
        ws.part("token_rows")[...] = cupy.arange(bucket, dtype=np.int32)
        ws.part("last_rows")[...] = cupy.arange(bucket, dtype=np.int32)
        stream = self.stream
        try:
            self._launch(ws)  # loads every kernel, lets cuBLAS settle its choices
            stream.synchronize()
            mode = getattr(cupy.cuda.runtime, "streamCaptureModeRelaxed", None)
            # capturing() first: it may allocate cuBLAS's workspace, which the refusing
            # allocator would not let it do.
            with self.gemm.capturing(), cupy.cuda.using_allocator(_refuse_allocation):
                if mode is None:
                    stream.begin_capture()
                else:
                    stream.begin_capture(mode)
                try:
                    self._launch(ws)
                except BaseException:
                    with contextlib.suppress(Exception):  # the launch's error is the one told
                        stream.end_capture()
                    raise
                graph = stream.end_capture()
            stream.synchronize()
            self._check_replay(ws, graph)
        except Exception as exc:
            logger.warning("decode graph for %d sequences not captured: %r", bucket, exc)
            self.graph_failures[bucket] = repr(exc)
            return
        self._decode[bucket] = (ws, graph)

    def _check_replay(self, ws: _Workspace, graph: Any) -> None:
        """Raise unless a replay of ``graph`` computes the eager forward's logits: for
        distinct tokens, over buffers first filled with NaN, so that a product or kernel
        the capture missed (run at capture time instead of recorded) shows."""
        cupy = self.xp
        rows = ws.rows
        ws.part("tokens")[...] = cupy.arange(1, rows + 1, dtype=np.int32) % self.shape.vocab
        self._launch(ws)
        expected = ws.logits32.copy()
        for buffer in ws.intermediates():
            buffer.fill(nan_of(buffer.dtype))
        ws.tokens.fill(-1)
        graph.launch(self.stream)
        self.stream.synchronize()
        if not bool(cupy.allclose(ws.logits32, expected, rtol=1e-2, atol=1e-2)):
            raise RuntimeError("the graph's replay differs from the eager forward")
        ws.part("tokens")[...] = 0
