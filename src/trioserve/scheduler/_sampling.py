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

    top-k keeps the k highest logits, top-p the shortest run of most likely tokens whose
    probability reaches p (always at least one token); each row's uniform number picks
    from what is kept by inverse CDF. Rows with top-p are ranked by a full sort; the
    others skip it (a sort over the vocabulary is most of the cost), so whether a row
    is sorted depends only on its own parameters, and a seeded request stays repeatable.
    """
    rows, vocab = logits.shape
    # float32: exp over the vocabulary costs a quarter of float64, and is precise enough.
    temperature = np.array([p.temperature for p in params], dtype=np.float32)[:, None]
    scaled = logits.astype(np.float32) / temperature
    top_k = np.array([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    nucleus = np.array([p.top_p < 1 for p in params])
    tokens = np.empty(rows, dtype=np.int64)
    if nucleus.any():
        tokens[nucleus] = _sorted_draw(
            scaled[nucleus],
            top_k[nucleus],
            np.array([p.top_p for p in params])[nucleus],
            uniforms[nucleus],
        )
    if not nucleus.all():
        rest = ~nucleus
        tokens[rest] = _unsorted_draw(scaled[rest], top_k[rest], uniforms[rest])
    return tokens.tolist()  # type: ignore[no-any-return]


def _sorted_draw(scaled: Array, top_k: Array, top_p: Array, uniforms: Array) -> Array:
    order = np.argsort(-scaled, axis=1)  # deterministic per row; a stable sort costs 2x
    ranked = np.take_along_axis(scaled, order, axis=1)
    probs = np.exp(ranked - ranked[:, :1])
    probs /= probs.sum(axis=1, keepdims=True)
    mass_before = np.cumsum(probs, axis=1) - probs
    keep = (np.arange(scaled.shape[1])[None, :] < top_k[:, None]) & (mass_before < top_p[:, None])
    return np.take_along_axis(order, _inverse_cdf(np.where(keep, probs, 0.0), uniforms), axis=1)[
        :, 0
    ]


def _unsorted_draw(scaled: Array, top_k: Array, uniforms: Array) -> Array:
    vocab = scaled.shape[1]
    limited = top_k < vocab
    if limited.any():
        # The k-th largest logit of each limited row; everything below it is out.
        kth = np.array(
            [
                np.partition(row, vocab - k)[vocab - k]
                for row, k in zip(scaled[limited], top_k[limited], strict=True)
            ]
        )
        scaled[limited] = np.where(scaled[limited] < kth[:, None], -np.inf, scaled[limited])
    probs = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    return _inverse_cdf(probs, uniforms)[:, 0]


def _inverse_cdf(weights: Array, uniforms: Array) -> Array:
    """Per row, the first index whose cumulative weight reaches ``uniform * total``."""
    cumulative = np.cumsum(weights, axis=1)
    chosen = (cumulative < (uniforms * cumulative[:, -1])[:, None]).sum(axis=1)
    clipped: Array = np.minimum(chosen, weights.shape[1] - 1)[:, None]
    return clipped
