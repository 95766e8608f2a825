"""What tools/gpu_decode_check.py's sections share: trioserve's model modules imported
without the package's front ends, the models compared, greedy runs and timers."""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

SRC = Path(__file__).resolve().parent.parent / "src" / "trioserve"


def bare_packages() -> None:
    """Make ``trioserve`` and ``trioserve.models`` importable without running their
    ``__init__``: the package's starts with the server's front ends, whose packages
    (trio, protobuf at the version its generated code wants...) a GPU image may lack.
    The model modules need numpy and cupy alone; the engine section also needs trio,
    outcome and sniffio (pure-Python wheels on PYTHONPATH will do)."""
    for name, folder in (("trioserve", SRC), ("trioserve.models", SRC / "models")):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [str(folder)]
            sys.modules[name] = module


bare_packages()

from trioserve._generative import StepSequence  # noqa: E402
from trioserve.models._gpu_forward import GpuForward  # noqa: E402
from trioserve.models._llama import (  # noqa: E402
    LlamaConfig,
    LlamaForward,
    LlamaWeights,
    gpu_parts,
)

BLOCK = 16
SEQUENCES, CONTEXT = 64, 128  # the 1 B model's timed batch: 64 sequences of 128 tokens
ONE_B = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
SMALL = {**ONE_B, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
         "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2}  # fmt: skip


def emit(section: str, **fields: Any) -> None:
    print(json.dumps({"section": section, **fields}, default=str), flush=True)


@contextmanager
def guarded(section: str, **context: Any) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    except Exception as exc:
        emit(section, **context, error=repr(exc), traceback=traceback.format_exc()[-3000:])
    finally:
        emit("elapsed", of=section, **context, seconds=round(time.perf_counter() - started, 2))


def random_tensors(
    config: dict[str, Any], seed: int, dtype: Any, xp: Any = np
) -> dict[str, np.ndarray]:
    """A Hugging Face Llama state dict of random weights (std 0.02, norms near 1), drawn
    on ``xp`` (cupy draws a billion in a blink) and returned as numpy arrays."""
    rng = xp.random.default_rng(seed)
    h, i = config["hidden_size"], config["intermediate_size"]
    d = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * d

    def host(array: Any) -> np.ndarray:
        return array if isinstance(array, np.ndarray) else array.get()

    def normal(*shape: int) -> np.ndarray:
        return host((rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype))

    def norm() -> np.ndarray:
        return host((1 + 0.1 * rng.standard_normal(h, dtype=np.float32)).astype(dtype))

    tensors = {"model.embed_tokens.weight": normal(config["vocab_size"], h),
               "model.norm.weight": norm(), "lm_head.weight": normal(config["vocab_size"], h)}  # fmt: skip
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        tensors |= {
            p + "input_layernorm.weight": norm(),
            p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": normal(h, h),
            p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h),
            p + "self_attn.o_proj.weight": normal(h, h),
            p + "mlp.gate_proj.weight": normal(i, h),
            p + "mlp.up_proj.weight": normal(i, h),
            p + "mlp.down_proj.weight": normal(h, i),
        }
    return tensors


def gpu_llama(cp: Any, config: LlamaConfig, tensors: Any, dtype: Any, **sizes: Any) -> GpuForward:
    weights = LlamaWeights(cp, config, tensors, dtype)
    return GpuForward(cp, *gpu_parts(cp, config, weights), num_layers=config.num_layers, **sizes)


class NumpyLlama:
    def __init__(self, config: LlamaConfig, tensors: Any, num_blocks: int) -> None:
        self.forward = LlamaForward(np, config, LlamaWeights(np, config, tensors), BLOCK)
        c = config
        cache = (c.num_layers, num_blocks, BLOCK, c.num_kv_heads, c.head_dim)
        self.k, self.v = np.zeros(cache, np.float32), np.zeros(cache, np.float32)

    def __call__(self, batch: Sequence[StepSequence]) -> np.ndarray:
        return self.forward(batch, self.k, self.v)


def tables(lengths: Sequence[int], first: int = 0) -> list[list[int]]:
    """Consecutive cache blocks for sequences of ``lengths`` tokens."""
    out, block = [], first
    for length in lengths:
        count = -(-length // BLOCK)
        out.append(list(range(block, block + count)))
        block += count
    return out


def greedy(step: Callable[[list[StepSequence]], np.ndarray], prompts: list[list[int]],
           steps: int, tokens_only: bool = False,
           margins: list[list[float]] | None = None) -> list[list[int]]:  # fmt: skip
    """Greedy continuations of ``prompts`` (all in one batch) for ``steps`` steps;
    ``margins`` (from logits) collects each step's gap between the top two logits."""
    blocks = tables([len(p) + steps for p in prompts])
    batch = [StepSequence(p, 0, t) for p, t in zip(prompts, blocks, strict=True)]
    made: list[list[int]] = [[] for _ in prompts]
    if margins is not None:
        margins[:] = [[] for _ in prompts]
    for _ in range(steps):
        out = step(batch)
        chosen = out if tokens_only else out.argmax(axis=1)
        if margins is not None:
            top = np.sort(out, axis=1)[:, -2:]
            for row, gap in enumerate((top[:, 1] - top[:, 0]).tolist()):
                margins[row].append(round(gap, 5))
        for row, token in enumerate(chosen.tolist()):
            made[row].append(int(token))
        batch = [StepSequence([m[-1]], len(p) + len(m) - 1, t)
                 for p, m, t in zip(prompts, made, blocks, strict=True)]  # fmt: skip
    return made


def agreement(a: list[list[int]], b: list[list[int]],
              margins: list[list[float]] | None = None) -> dict[str, Any]:  # fmt: skip
    """How far two greedy runs agree: identical sequences, the first divergence, and
    there the gap between ``a``'s top two logits (``margins``: a near-tie flips on
    rounding) beside the median gap of the run."""
    first = [next((i for i, (x, y) in enumerate(zip(p, q, strict=True)) if x != y), None)
             for p, q in zip(a, b, strict=True)]  # fmt: skip
    found: dict[str, Any] = {"identical": sum(f is None for f in first), "of": len(a),
                             "first_divergence": first}  # fmt: skip
    if margins:
        found["margin_at_divergence"] = [None if f is None else m[f]
                                         for f, m in zip(first, margins, strict=True)]  # fmt: skip
        found["median_margin"] = round(statistics.median(g for m in margins for g in m), 5)
    return found


def mixed_batch(prompt_lengths: Sequence[int], decode_contexts: Sequence[int],
                vocab: int, seed: int) -> tuple[list[StepSequence], list[StepSequence]]:  # fmt: skip
    """A step that fills the caches (prompts), then one mixing chunks and decodes."""
    rng = np.random.default_rng(seed)
    lengths = [*prompt_lengths, *decode_contexts]
    blocks = tables([n + 40 for n in lengths])
    fill = [StepSequence(rng.integers(0, vocab, n).tolist(), 0, t)
            for n, t in zip(lengths, blocks, strict=True)]  # fmt: skip
    mixed = [StepSequence(rng.integers(0, vocab, 7).tolist(), n, t)
             for n, t in zip(prompt_lengths, blocks, strict=False)]  # fmt: skip
    mixed += [StepSequence([int(rng.integers(0, vocab))], n, t)
              for n, t in zip(decode_contexts, blocks[len(prompt_lengths):], strict=True)]  # fmt: skip
    return fill, mixed


def median_ms(run: Callable[[], Any], sync: Callable[[], Any], count: int = 50) -> float:
    for _ in range(3):
        run()
    sync()
    times = []
    for _ in range(count):
        started = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1000, 3)
