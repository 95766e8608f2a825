"""Next-token choice from logits: greedy, temperature, top-k, top-p, seeded.

Each sample owns a ``numpy.random.Generator``: seeded requests get one from
``(seed, sample index)``, so a seeded request gives the same text whatever else runs
beside it; unseeded ones draw their seed from the engine's own generator. A step's
random draws are made together: one uniform number per sample from its own
generator, then one vectorized pass over all their logits rows.
"""

from __future__ import annotations

from collections.abc import Sequence
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


def sample_rows(logits: Array, params: Sequence[SamplingParams], uniforms: Array) -> list[int]:
    """One token id per row of ``logits``, each under its own parameters.

    Tokens are ranked by logit; top-k keeps the first k, top-p the shortest head whose
    probability reaches p (always at least one token); the uniform number of each row
    picks from what is kept by inverse CDF.
    """
    rows, vocab = logits.shape
    temperature = np.array([p.temperature for p in params])[:, None]
    top_k = np.array([p.top_k if p.top_k > 0 else vocab for p in params])[:, None]
    top_p = np.array([p.top_p for p in params])[:, None]
    scaled = logits.astype(np.float64) / temperature
    order = np.argsort(-scaled, axis=1, kind="stable")
    ranked = np.take_along_axis(scaled, order, axis=1)
    probs = np.exp(ranked - ranked[:, :1])
    probs /= probs.sum(axis=1, keepdims=True)
    mass_before = np.cumsum(probs, axis=1) - probs
    keep = (np.arange(vocab)[None, :] < top_k) & (mass_before < top_p)
    kept = np.cumsum(np.where(keep, probs, 0.0), axis=1)
    choice = (kept < (uniforms * kept[:, -1])[:, None]).sum(axis=1)
    choice = np.minimum(choice, vocab - 1)
    return order[np.arange(rows), choice].tolist()  # type: ignore[no-any-return]
