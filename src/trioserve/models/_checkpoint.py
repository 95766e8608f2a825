"""A Hugging Face checkpoint folder on local disk, served as a generative model.

    load_checkpoint_model("/models/qwen2-0.5b", "qwen") -> CheckpointLM

The folder holds ``config.json`` (a Llama-family ``model_type``: llama, mistral, qwen2),
the weights as ``*.safetensors`` (read with the ``safetensors`` package, any of float32,
float16 or bfloat16), ``tokenizer.json`` (the ``tokenizers`` package) and optionally
``tokenizer_config.json`` (its ``chat_template`` and special tokens go to the chat
endpoint) and ``generation_config.json`` (its ``eos_token_id`` wins over config.json's).
Nothing is downloaded. The configuration and tokenizer are read at once, so that a bad
folder fails before serving starts (for the GPU, the weights' headers too: their dtype
sizes the default KV cache); the weights are read by ``load``.

With ``device="gpu"`` and cupy with a CUDA device, ``load`` builds the GPU forward
(``_gpu_forward.py``) instead of the numpy one, its weights, activations and KV cache in
the checkpoint's dtype (``gpu_dtype``: float32, float16 or bfloat16), and
``step_greedy`` serves.

The ``checkpoints`` extra installs ``safetensors`` and ``tokenizers``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from .._generative import GenerativeModel, StepSequence
from ._gpu_forward import GpuForward, ServedOnDevice
from ._llama import CheckpointError, LlamaConfig, LlamaForward, LlamaWeights, gpu_parts
from ._storage import BFLOAT16_BITS
from ._tiny_lm import Array, array_module

_DEFAULT_MAX_MODEL_LEN = 4096  # unless asked: a CPU has no use for 128k-token contexts
_DEFAULT_KV_CACHE_BYTES = 512 << 20


class CheckpointLM(ServedOnDevice, GenerativeModel):
    """A Llama-family checkpoint folder; see the module docstring."""

    def __init__(
        self,
        path: str | Path,
        name: str,
        *,
        max_model_len: int | None = None,
        num_kv_blocks: int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        versions: Sequence[str] = ("1",),
        device: Literal["cpu", "gpu"] = "cpu",
    ) -> None:
        self.path = Path(path)
        config_document = _json(self.path / "config.json")
        self.config = LlamaConfig.from_hf(config_document)
        self.tokenizer = _tokenizer(self.path / "tokenizer.json")
        tokenizer_config = _json(self.path / "tokenizer_config.json", required=False)
        generation = _json(self.path / "generation_config.json", required=False)
        eos = generation.get("eos_token_id", config_document.get("eos_token_id"))
        if isinstance(eos, list):
            eos = eos[0] if eos else None  # the engine stops on one token: the first
        if type(eos) is not int:
            raise CheckpointError(
                "neither generation_config.json nor config.json names eos_token_id"
            )
        length = max_model_len or min(self.config.max_position_embeddings, _DEFAULT_MAX_MODEL_LEN)
        rope = self.config.rope
        if rope.max_positions is not None and length > rope.max_positions:
            raise CheckpointError(
                f"rope type {rope.kind!r} is served up to max_position_embeddings "
                f"({rope.max_positions} tokens; past it a sequence's rotation would depend on "
                f"the other sequences of each step): max_model_len {length} is longer"
            )
        blocks_per_sequence = -(-length // block_size)
        # Read from the weights' headers now: the default cache size depends on it.
        self.gpu_storage = (
            gpu_dtype(stored_dtypes(_weight_files(self.path))) if device == "gpu" else None
        )
        if num_kv_blocks is None:
            c = self.config
            # In the GPU storage's bytes (a device that falls back to numpy keeps the count,
            # in float32); float32 on the CPU.
            element = 4 if self.gpu_storage is None else self.gpu_storage.itemsize
            block_bytes = 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * element
            num_kv_blocks = max(blocks_per_sequence, _DEFAULT_KV_CACHE_BYTES // block_bytes)
        super().__init__(
            name,
            eos_token_id=eos,
            max_model_len=length,
            num_kv_blocks=num_kv_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(max_num_batched_tokens, max_num_seqs),
            enable_prefix_caching=enable_prefix_caching,
            versions=versions,
            device=device,
            parameters={"checkpoint": str(self.path), "model_type": config_document["model_type"]},
        )
        self.vocab_size = self.config.vocab_size
        self.chat_template = _chat_template(tokenizer_config)
        self.special_tokens = {
            key: text
            for key in ("bos_token", "eos_token", "pad_token", "unk_token")
            if (text := _token_text(tokenizer_config.get(key))) is not None
        }
        self.forward: LlamaForward | None = None
        self.gpu: GpuForward | None = None
        self.k_cache: Array = None
        self.v_cache: Array = None

    def load(self) -> None:
        # ml_dtypes gives numpy the 'bfloat16' type that safetensors' numpy loader names
        # for bfloat16 tensors: without the import, such a checkpoint fails to load.
        import ml_dtypes  # noqa: F401
        from safetensors.numpy import load_file

        xp = array_module(self.device)
        tensors: dict[str, Any] = {}
        for file in _weight_files(self.path):
            tensors.update(load_file(file))
        c = self.config
        if xp is not np:
            assert self.gpu_storage is not None, "only device='gpu' loads on cupy"
            weights = LlamaWeights(xp, c, tensors, self.gpu_storage)
            self.gpu = GpuForward.serving(self, xp, *gpu_parts(xp, c, weights), c.num_layers)
            self.k_cache, self.v_cache = self.gpu.k_cache, self.gpu.v_cache
            return
        weights = LlamaWeights(xp, c, tensors)
        cache = (c.num_layers, self.num_kv_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        self.k_cache = xp.zeros(cache, dtype=xp.float32)
        self.v_cache = xp.zeros(cache, dtype=xp.float32)
        self.forward = LlamaForward(xp, c, weights, self.block_size)

    def unload(self) -> None:
        self.forward = self.gpu = None
        self.k_cache = self.v_cache = None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)

    def encode_chat(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def step(self, batch: Sequence[StepSequence]) -> np.ndarray[Any, Any]:
        if self.gpu is not None:
            return self.gpu.step(batch)
        assert self.forward is not None, "step before load"
        return self.forward(batch, self.k_cache, self.v_cache)


def load_checkpoint_model(path: str | Path, name: str, **settings: Any) -> CheckpointLM:
    """The checkpoint folder ``path`` served as model ``name``; ``settings`` size its
    engine (``max_model_len``, ``num_kv_blocks``, ``block_size``, ``max_num_seqs``...)."""
    return CheckpointLM(path, name, **settings)


def gpu_dtype(stored: Iterable[str]) -> np.dtype[Any]:
    """The GPU forward's storage dtype for a checkpoint whose tensors are ``stored`` as
    these safetensors dtypes ("F32", "F16", "BF16"...; integer ones do not count):
    float32 when every floating one is F32; else float16 when one is F16 (a float16
    tensor would lose 3 bits of its mantissa in bfloat16), bfloat16 (``BFLOAT16_BITS``)
    when one is BF16 (beside F32 ones, say its norms: their values fit bfloat16's range,
    not always float16's), float16 otherwise (F64, 8-bit floats)."""
    floating = {kind for kind in stored if kind.startswith(("F", "BF"))}
    if floating <= {"F32"}:
        return np.dtype(np.float32)
    if "BF16" in floating and "F16" not in floating:
        return BFLOAT16_BITS
    return np.dtype(np.float16)


def stored_dtypes(files: Sequence[Path]) -> set[str]:
    """The dtypes the safetensors ``files`` store their tensors as, from their headers
    alone (8 bytes, little-endian, of the JSON header's length, then the header)."""
    found: set[str] = set()
    for file in files:
        try:
            with file.open("rb") as stream:
                header = json.loads(stream.read(int.from_bytes(stream.read(8), "little")))
            found |= {entry["dtype"] for key, entry in header.items() if key != "__metadata__"}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"cannot read the header of {file}: {exc!r}") from None
    return found


def _weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors in {folder}")
    return files


def _json(path: Path, *, required: bool = True) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path} is missing")
        return {}
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    if not isinstance(document, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return document


def _tokenizer(path: Path) -> Any:
    from tokenizers import Tokenizer

    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


def _chat_template(tokenizer_config: dict[str, Any]) -> str | None:
    """``chat_template``: a string, or a list of named templates ("default" is used)."""
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_text(token: object) -> str | None:
    """A special token of tokenizer_config.json: a string, or an object with ``content``."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None
