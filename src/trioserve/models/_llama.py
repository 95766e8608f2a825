"""The Llama family's transformer (Llama, Mistral, Qwen2) over the paged KV cache.

Pre-norm decoder layers: RMSNorm, attention with rotary position embeddings (Hugging
Face's half-split rotation, with the config's scaling: ``_rope``) and grouped-query K/V
heads, optional q/k/v biases (Qwen2), and a SwiGLU
MLP; a final RMSNorm and the LM head (the embedding matrix when tied). Weights are
named as in a Hugging Face checkpoint, ``model.layers.{i}.self_attn.q_proj.weight``
and so on, each ``(out, in)``; they are kept transposed for ``x @ w``. Everything
computes in float32.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from .._generative import StepSequence
from ._gpu_forward import GpuLayer, GpuShape, GpuWeights
from ._paged_attention import Array, PagedAttention, StepLayout
from ._rope import Rope, RopeError, read_rope
from ._storage import to_storage

ARCHITECTURES = frozenset({"llama", "mistral", "qwen2"})


class CheckpointError(ValueError):
    """A checkpoint folder this server cannot serve, and why."""


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: Rope
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> LlamaConfig:
        """Read a Hugging Face ``config.json`` of the Llama family."""
        model_type = config.get("model_type")
        if model_type not in ARCHITECTURES:
            raise CheckpointError(
                f"model_type {model_type!r} is not served; supported: {sorted(ARCHITECTURES)}"
            )
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            head_dim = int(config.get("head_dim") or hidden // heads)
            read = cls(
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope=read_rope(config, head_dim),
                max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                attention_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
            )
        except RopeError as exc:
            raise CheckpointError(str(exc)) from None
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"config.json lacks or garbles {exc}") from None
        if read.num_heads % read.num_kv_heads:
            raise CheckpointError("num_attention_heads must be a multiple of num_key_value_heads")
        return read


class LlamaWeights:
    """A checkpoint's tensors on the array module, laid out for the forward pass: float32
    for the numpy forward, the GPU forward's storage dtype for it (``_storage.py``)."""

    def __init__(
        self,
        xp: ModuleType,
        config: LlamaConfig,
        tensors: Mapping[str, Any],
        dtype: DTypeLike = np.float32,
    ) -> None:
        def take(name: str, *, transpose: bool = False) -> Array:
            if name not in tensors:
                raise CheckpointError(f"the checkpoint lacks tensor {name!r}")
            array = to_storage(tensors[name], dtype)
            return xp.asarray(np.ascontiguousarray(array.T) if transpose else array)

        self.embed = take("model.embed_tokens.weight")
        self.norm = take("model.norm.weight")
        if config.tie_word_embeddings or "lm_head.weight" not in tensors:
            self.lm_head = self.embed.T
        else:
            self.lm_head = take("lm_head.weight", transpose=True)
        self.layers = []
        for i in range(config.num_layers):
            prefix = f"model.layers.{i}."
            attention = prefix + "self_attn."
            # q, k and v in one matrix: one matmul per layer instead of three.
            qkv = [take(f"{attention}{p}_proj.weight", transpose=True) for p in "qkv"]
            layer = {
                "input_norm": take(prefix + "input_layernorm.weight"),
                "qkv": xp.concatenate(qkv, axis=1),
                "o": take(attention + "o_proj.weight", transpose=True),
                "post_norm": take(prefix + "post_attention_layernorm.weight"),
                "gate_up": xp.concatenate(
                    [take(f"{prefix}mlp.{p}_proj.weight", transpose=True) for p in ("gate", "up")],
                    axis=1,
                ),
                "down": take(prefix + "mlp.down_proj.weight", transpose=True),
            }
            if config.attention_bias:
                layer["qkv_bias"] = xp.concatenate(
                    [take(f"{attention}{p}_proj.bias") for p in "qkv"]
                )
            self.layers.append(layer)


class LlamaForward:
    """One engine step of a Llama-family model: logits of each entry's last token."""

    def __init__(
        self, xp: ModuleType, config: LlamaConfig, weights: LlamaWeights, block_size: int
    ) -> None:
        self.xp = xp
        self.config = config
        self.weights = weights
        self.block_size = block_size
        self.attention = PagedAttention(xp, config.head_dim)
        self.inverse_frequencies = np.array(config.rope.inverse_frequencies)

    def __call__(
        self, batch: Sequence[StepSequence], k_cache: Array, v_cache: Array
    ) -> np.ndarray[Any, Any]:
        xp, c, w = self.xp, self.config, self.weights
        layout = StepLayout.of(xp, batch, self.block_size)
        cos, sin = self._rotation(layout.positions)
        q_width = c.num_heads * c.head_dim
        kv_width = c.num_kv_heads * c.head_dim
        x = w.embed[xp.asarray(layout.tokens)]
        for i, layer in enumerate(w.layers):
            qkv = self._rms_norm(x, layer["input_norm"]) @ layer["qkv"]
            if "qkv_bias" in layer:
                qkv = qkv + layer["qkv_bias"]
            q = _rotate(xp, qkv[:, :q_width].reshape(-1, c.num_heads, c.head_dim), cos, sin)
            k = _rotate(
                xp,
                qkv[:, q_width : q_width + kv_width].reshape(-1, c.num_kv_heads, c.head_dim),
                cos,
                sin,
            )
            v = qkv[:, q_width + kv_width :].reshape(-1, c.num_kv_heads, c.head_dim)
            attended = self.attention(q, k, v, k_cache[i], v_cache[i], batch, layout)
            x = x + attended.reshape(-1, q_width) @ layer["o"]
            gate, up = xp.split(self._rms_norm(x, layer["post_norm"]) @ layer["gate_up"], 2, axis=1)
            x = x + (gate / (1 + xp.exp(-gate)) * up) @ layer["down"]
        last = self._rms_norm(x[xp.asarray(layout.last_tokens)], w.norm)
        logits = last @ w.lm_head
        return logits.get() if xp is not np else logits  # type: ignore[no-any-return]

    def _rms_norm(self, x: Array, weight: Array) -> Array:
        variance = (x * x).mean(axis=-1, keepdims=True)
        return x / self.xp.sqrt(variance + self.config.rms_norm_eps) * weight

    def _rotation(self, positions: np.ndarray[Any, Any]) -> tuple[Array, Array]:
        angles = positions[:, None].astype(np.float64) * self.inverse_frequencies[None, :]
        angles = np.concatenate([angles, angles], axis=1)[:, None, :]  # (tokens, 1, head_dim)
        factor = self.config.rope.attention_factor
        return (
            self.xp.asarray((np.cos(angles) * factor).astype(np.float32)),
            self.xp.asarray((np.sin(angles) * factor).astype(np.float32)),
        )


def gpu_parts(
    xp: ModuleType, config: LlamaConfig, weights: LlamaWeights
) -> tuple[GpuShape, GpuWeights]:
    """What the GPU forward takes, from weights loaded on cupy (``xp``)."""
    c = config
    shape = GpuShape(
        vocab=c.vocab_size,
        hidden=c.hidden_size,
        heads=c.num_heads,
        kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        mlp_width=c.intermediate_size,
        norm="rms",
        eps=c.rms_norm_eps,
        mlp="swiglu",
        inverse_frequencies=c.rope.inverse_frequencies,
        attention_factor=c.rope.attention_factor,
    )
    layers = [
        GpuLayer(
            input_norm=layer["input_norm"],
            qkv=layer["qkv"],
            qkv_bias=layer.get("qkv_bias"),
            o=layer["o"],
            post_norm=layer["post_norm"],
            up=layer["gate_up"],
            down=layer["down"],
        )
        for layer in weights.layers
    ]
    return shape, GpuWeights(
        embed=weights.embed,
        positions=None,
        layers=layers,
        final_norm=weights.norm,
        lm_head=xp.ascontiguousarray(weights.lm_head),  # a tied head is the embedding's .T
        logit_bias=None,
    )


def _rotate(xp: ModuleType, x: Array, cos: Array, sin: Array) -> Array:
    """Rotary embedding, Hugging Face's layout: dimension i pairs with i + head_dim / 2."""
    half = x.shape[-1] // 2
    return x * cos + xp.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin
