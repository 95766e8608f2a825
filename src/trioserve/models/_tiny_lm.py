"""``tiny_lm``: the built-in demo generative model, a small transformer over a paged KV cache.

Untrained: its weights come from a fixed seed, so the text it writes is noise. What is
real is the serving: a byte-level tokenizer (token = UTF-8 byte, 256 = end of
sequence), learned positions, pre-norm layers of multi-head causal attention and a
ReLU MLP, and attention that reads K/V from the engine's cache blocks through each
sequence's block table, exactly as a production model would.

It runs on numpy; with the ``gpu`` extra (cupy) and a CUDA device present and
``device="gpu"``, it runs on the GPU forward of the checkpoint models
(``_gpu_forward.py``: fused kernels, decode steps as CUDA graphs) in float32. Dimensions
are small so that a step of 64 decoding sequences takes a few milliseconds on a CPU,
which keeps benchmarks about the server rather than the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import numpy as np

from .._generative import GenerativeModel, StepSequence
from ._gpu_forward import GpuForward, GpuLayer, GpuShape, GpuWeights, ServedOnDevice
from ._paged_attention import PagedAttention, StepLayout

Array = Any  # numpy or cupy ndarray
EOS = 256
VOCAB = 257


def array_module(device: Literal["cpu", "gpu"]) -> ModuleType:
    """cupy for ``device="gpu"`` when cupy and a CUDA device are present, else numpy."""
    if device == "gpu":
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() > 0:
                return cupy  # type: ignore[no-any-return]
        except Exception:  # no cupy, no driver, no device: the CPU serves
            pass
    return np


@dataclass(frozen=True)
class TinyLMShape:
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 128

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class TinyLM(ServedOnDevice, GenerativeModel):
    vocab_size = VOCAB

    def __init__(
        self,
        name: str = "tiny_lm",
        *,
        shape: TinyLMShape | None = None,
        seed: int = 0,
        max_model_len: int = 1024,
        num_kv_blocks: int = 2048,
        block_size: int = 16,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        device: Literal["cpu", "gpu"] = "cpu",
    ) -> None:
        super().__init__(
            name,
            eos_token_id=EOS,
            max_model_len=max_model_len,
            num_kv_blocks=num_kv_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            device=device,
            parameters={"description": "untrained demo transformer (byte-level)"},
        )
        self.shape = shape or TinyLMShape()
        self.seed = seed
        self.xp: ModuleType = np
        self.weights: dict[str, Array] = {}
        self.k_cache: Array = None
        self.v_cache: Array = None
        self.gpu: GpuForward | None = None

    def load(self) -> None:
        xp = self.xp = array_module(self.device)
        s = self.shape
        rng = np.random.default_rng(self.seed)

        def init(*dims: int) -> Array:
            return xp.asarray(rng.normal(0, dims[0] ** -0.5, dims).astype(np.float32))

        # Untrained logits would mostly pick bytes that are not text; a fixed bias
        # towards printable ASCII makes the noise at least readable noise.
        bias = np.full(VOCAB, -2.0, dtype=np.float32)
        bias[32:127] = 2.0
        self.weights = {
            "embed": init(VOCAB, s.d_model) * s.d_model**0.5,
            "pos": init(self.max_model_len, s.d_model) * 0.1,
            "bias": xp.asarray(bias),
        }
        for layer in range(s.n_layers):
            self.weights |= {
                f"{layer}.qkv": init(s.d_model, 3 * s.d_model),
                f"{layer}.out": init(s.d_model, s.d_model),
                f"{layer}.up": init(s.d_model, s.d_ff),
                f"{layer}.down": init(s.d_ff, s.d_model),
            }
        if xp is not np:
            self.gpu = self.gpu_forward()
            self.k_cache, self.v_cache = self.gpu.k_cache, self.gpu.v_cache
            return
        cache = (s.n_layers, self.num_kv_blocks, self.block_size, s.n_heads, s.head_dim)
        self.k_cache = xp.zeros(cache, dtype=xp.float32)
        self.v_cache = xp.zeros(cache, dtype=xp.float32)

    def gpu_forward(self, graphs: bool = True) -> GpuForward:
        """The GPU forward over this model's weights (loaded on cupy)."""
        s, w = self.shape, self.weights
        shape = GpuShape(
            vocab=VOCAB,
            hidden=s.d_model,
            heads=s.n_heads,
            kv_heads=s.n_heads,
            head_dim=s.head_dim,
            mlp_width=s.d_ff,
            norm="layer",
            eps=1e-5,
            mlp="relu",
        )
        layers = [
            GpuLayer(
                input_norm=None,
                qkv=w[f"{layer}.qkv"],
                qkv_bias=None,
                o=w[f"{layer}.out"],
                post_norm=None,
                up=w[f"{layer}.up"],
                down=w[f"{layer}.down"],
            )
            for layer in range(s.n_layers)
        ]
        weights = GpuWeights(
            embed=w["embed"],
            positions=w["pos"],
            layers=layers,
            final_norm=None,
            lm_head=self.xp.ascontiguousarray(w["embed"].T),
            logit_bias=w["bias"],
        )
        return GpuForward.serving(self, self.xp, shape, weights, s.n_layers, graphs)

    def unload(self) -> None:
        self.weights = {}
        self.k_cache = self.v_cache = self.gpu = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: Sequence[int]) -> str:
        try:
            data = bytes(token_ids)
        except ValueError:  # EOS among them
            data = bytes(t for t in token_ids if t < EOS)
        return data.decode(errors="replace")

    def step(self, batch: Sequence[StepSequence]) -> np.ndarray[Any, Any]:
        if self.gpu is not None:
            return self.gpu.step(batch)
        xp, w, s = self.xp, self.weights, self.shape
        layout = StepLayout.of(xp, batch, self.block_size)
        attention = PagedAttention(xp, s.head_dim)
        x = w["embed"][xp.asarray(layout.tokens)] + w["pos"][xp.asarray(layout.positions)]
        for layer in range(s.n_layers):
            qkv = _norm(xp, x) @ w[f"{layer}.qkv"]
            q, k, v = (
                qkv[:, i * s.d_model : (i + 1) * s.d_model].reshape(-1, s.n_heads, s.head_dim)
                for i in range(3)
            )
            attended = attention(q, k, v, self.k_cache[layer], self.v_cache[layer], batch, layout)
            x = x + attended.reshape(-1, s.d_model) @ w[f"{layer}.out"]
            x = x + xp.maximum(_norm(xp, x) @ w[f"{layer}.up"], 0) @ w[f"{layer}.down"]
        logits: np.ndarray[Any, Any] = (
            _norm(xp, x[xp.asarray(layout.last_tokens)]) @ w["embed"].T + w["bias"]
        )
        return logits


def _norm(xp: ModuleType, x: Array) -> Array:
    mean = x.mean(axis=-1, keepdims=True)
    return (x - mean) / xp.sqrt(x.var(axis=-1, keepdims=True) + 1e-5)
