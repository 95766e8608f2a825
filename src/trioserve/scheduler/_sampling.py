"""Next-token choice from logits: greedy, temperature, top-k, top-p, seeded.

Each sample owns a ``numpy.random.Generator``: seeded requests get one from
``(seed, sample index)``, so a seeded request gives the same text whatever else runs
beside it; unseeded ones draw their seed from the engine's own generator.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._generation import SamplingParams

Array = np.ndarray[Any, Any]


def sample_generator(
    params: SamplingParams, index: int, engine_rng: np.random.Generator
) -> np.random.Generator:
    if params.seed is not None:
        return np.random.default_rng([params.seed, index])
    return np.random.default_rng(engine_rng.integers(2**63))


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature == 0 or params.top_k == 1


def sample(logits: Array, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token id drawn from one row of logits."""
    if is_greedy(params):
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature
    vocab = scaled.shape[0]
    if 0 < params.top_k < vocab:
        # Everything below the k-th largest logit is out (ties at the k-th stay in).
        kth = np.partition(scaled, vocab - params.top_k)[vocab - params.top_k]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.top_p < 1:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        # Keep the smallest head whose mass reaches top_p (at least one token).
        keep = int(np.searchsorted(cumulative, params.top_p)) + 1
        kept = np.zeros_like(probs)
        kept[order[:keep]] = probs[order[:keep]]
        probs = kept / kept.sum()
    return int(rng.choice(vocab, p=probs))
