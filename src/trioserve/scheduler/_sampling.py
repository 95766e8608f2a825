"""Next-token choice from logits: penalties, greedy, temperature, min-p, top-k, top-p, seeded.

Each sample owns a ``numpy.random.Generator``: seeded requests get one from
``(seed, sample index)``, so a seeded request gives the same text whatever else runs
beside it; unseeded ones draw their seed from the engine's own generator. A step's
random draws are made together: one uniform number per sample from its own
generator, then one vectorized pass over all their logits rows. Greedy samples (a
temperature below ``GREEDY_BELOW``, as vLLM counts it, or ``top_k == 1``) take the
argmax and draw nothing.

Penalties are vLLM's, applied to a copy of a sample's logits before anything else (so
to greedy samples too): ``repetition_penalty`` divides the positive logits of every
token seen in the prompt or the output and multiplies the negative ones;
``frequency_penalty`` subtracts itself once per time a token is in the output,
``presence_penalty`` once if it is there at all. Logprobs stay those of the logits as
the model gave them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ._generation import TokenLogprob
from ._sampling_params import SamplingParams

Array = np.ndarray[Any, Any]
GREEDY_BELOW = 1e-5  # vLLM's bound; logits divided by less could overflow float32


class TokenHistory:
    """A penalised sample's tokens as penalties read them: the distinct ids of its
    prompt and output, and how often each is in the output. Kept up as tokens are added
    (``add``: a dict lookup and a store or two), not counted again every step: at 64
    sequences of 2,000 tokens, counting afresh cost milliseconds of host work per step.
    The ids are in no particular order."""

    __slots__ = ("_counts", "_places", "_seen", "_size")

    def __init__(self, token_ids: Sequence[int], prompt_len: int) -> None:
        seen, where = np.unique(np.asarray(token_ids, np.int64), return_inverse=True)
        capacity = max(16, 2 * seen.size)
        self._size = seen.size
        self._seen = np.zeros(capacity, np.int64)
        self._seen[: seen.size] = seen
        self._counts = np.zeros(capacity, np.int64)
        self._counts[: seen.size] = np.bincount(where[prompt_len:], minlength=seen.size)
        self._places = dict(zip(seen.tolist(), range(seen.size), strict=True))

    def add(self, token: int) -> None:
        """A token added to the output."""
        place = self._places.get(token)
        if place is None:
            place = self._size
            if place == self._seen.size:  # full: twice the room
                self._seen = np.concatenate([self._seen, np.zeros_like(self._seen)])
                self._counts = np.concatenate([self._counts, np.zeros_like(self._counts)])
            self._seen[place] = token
            self._places[token] = place
            self._size += 1
        self._counts[place] += 1

    def arrays(self) -> tuple[Array, Array]:
        """The distinct ids and their output counts, copies the caller may keep (a
        device's model may still read them after later tokens are added)."""
        return self._seen[: self._size].copy(), self._counts[: self._size].copy()

    def vocabulary_counts(self, vocab: int) -> tuple[Array, Array]:
        """Over a vocabulary of ``vocab`` ids: which were seen, and the output's counts
        (ids outside it, which a model's narrower logits do not have, left out)."""
        ids, output_counts = self._seen[: self._size], self._counts[: self._size]
        inside = (ids >= 0) & (ids < vocab)
        seen = np.zeros(vocab, bool)
        seen[ids[inside]] = True
        counts = np.zeros(vocab, np.int64)
        counts[ids[inside]] = output_counts[inside]
        return seen, counts


class Draw(NamedTuple):
    """What one sample's next token is drawn from."""

    row: int  # its row of the step's logits
    params: SamplingParams
    rng: np.random.Generator
    token_ids: Sequence[int]  # its tokens so far, prompt then output
    history: TokenHistory | None  # for penalties (None: the sample has none)


def sample_generator(
    params: SamplingParams, index: int, engine_rng: np.random.Generator
) -> np.random.Generator:
    if params.seed is not None:
        return np.random.default_rng([params.seed, index])
    return np.random.default_rng(engine_rng.integers(2**63))


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_BELOW or params.top_k == 1


def is_penalised(params: SamplingParams) -> bool:
    return bool(
        params.repetition_penalty != 1 or params.frequency_penalty or params.presence_penalty
    )


def choose_tokens(logits: Array, draws: Sequence[Draw]) -> list[int]:
    """The next token of each draw: argmax for greedy ones, the rest in one pass.

    Extreme values in range (a temperature of 1e300, a repetition penalty of 1e-300)
    overflow float32 into inf or nan: the draw still picks a token, so numpy is not to
    warn of it.
    """
    with np.errstate(all="ignore"):
        return _choose_tokens(logits, draws)


def _choose_tokens(logits: Array, draws: Sequence[Draw]) -> list[int]:
    if any(is_penalised(d.params) for d in draws):
        logits = _penalised(logits, draws)  # one row per draw
        draws = [d._replace(row=i) for i, d in enumerate(draws)]
    greedy = logits.argmax(axis=1).tolist()
    tokens = [greedy[d.row] for d in draws]
    random = [i for i, d in enumerate(draws) if not is_greedy(d.params)]
    if random:
        chosen = sample_rows(
            logits[[draws[i].row for i in random]],
            [draws[i].params for i in random],
            np.array([draws[i].rng.random() for i in random]),
        )
        for i, token in zip(random, chosen, strict=True):
            tokens[i] = token
    return tokens


def _penalised(logits: Array, draws: Sequence[Draw]) -> Array:
    """Each draw's logits row, penalised as its parameters ask (a copy)."""
    rows = logits[[d.row for d in draws]].astype(np.float32)
    vocab = rows.shape[1]
    for row, draw in zip(rows, draws, strict=True):
        params = draw.params
        if draw.history is None or not is_penalised(params):
            continue
        seen, counts = draw.history.vocabulary_counts(vocab)
        if params.repetition_penalty != 1:
            penalty = params.repetition_penalty
            row[seen] = np.where(row[seen] > 0, row[seen] / penalty, row[seen] * penalty)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return rows


def sample_rows(logits: Array, params: Sequence[SamplingParams], uniforms: Array) -> list[int]:
    """One token id per row of ``logits``, each under its own parameters.

    min-p drops the tokens less likely than min_p times the likeliest, then top-k keeps
    the k highest logits, top-p the shortest run of most likely tokens whose probability
    reaches p (always at least one token); each row's uniform number picks from what is
    kept by inverse CDF. Rows with top-p are ranked by a full sort; the
    others skip it (a sort over the vocabulary is most of the cost), so whether a row
    is sorted depends only on its own parameters, and a seeded request stays repeatable.
    """
    rows, vocab = logits.shape
    # float32: exp over the vocabulary costs a quarter of float64, and is precise enough.
    temperature = np.array([p.temperature for p in params], dtype=np.float32)[:, None]
    scaled = logits.astype(np.float32) / temperature
    top_k = np.array([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    min_p = np.array([p.min_p for p in params], dtype=np.float32)
    if min_p.any():
        # p / p_max < min_p is logit < max + log(min_p); log(0) = -inf keeps every token.
        with np.errstate(divide="ignore"):
            cut = scaled.max(axis=1) + np.log(min_p)
        scaled = np.where(scaled < cut[:, None], -np.inf, scaled)
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


def draws_logprobs(
    logits: Array, draws: Sequence[Draw], tokens: Sequence[int]
) -> list[TokenLogprob | None]:
    """The logprobs of each draw's token (logits row, parameters, generator), for the
    draws that asked; most ask nothing, which costs one pass over the draws."""
    asked = [i for i, d in enumerate(draws) if d.params.logprobs is not None]
    found: list[TokenLogprob | None] = [None] * len(draws)
    if asked:
        computed = token_logprobs(
            logits[[draws[i].row for i in asked]],
            [tokens[i] for i in asked],
            [draws[i].params.logprobs or 0 for i in asked],
        )
        for i, entry in zip(asked, computed, strict=True):
            found[i] = entry
    return found


def token_logprobs(
    logits: Array, tokens: Sequence[int], top_counts: Sequence[int]
) -> list[TokenLogprob]:
    """Per row of ``logits``: the log-softmax value of its chosen token and of its
    ``top_counts`` most likely tokens. Only rows that asked for logprobs come here."""
    rows = logits.astype(np.float64)  # a few rows: the precision costs nothing
    peak = rows.max(axis=1, keepdims=True)
    logp = rows - (peak + np.log(np.exp(rows - peak).sum(axis=1, keepdims=True)))
    k = min(max(top_counts), rows.shape[1])
    top = np.zeros((len(rows), 0), dtype=np.int64)
    if k:
        top = np.argpartition(-logp, k - 1, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(logp, top, axis=1), axis=1, kind="stable")
        top = np.take_along_axis(top, order, axis=1)
    found = []
    for row, (token, count) in enumerate(zip(tokens, top_counts, strict=True)):
        ids = top[row, :count].tolist()
        values = logp[row, ids].tolist()
        found.append(
            TokenLogprob(token, float(logp[row, token]), tuple(zip(ids, values, strict=True)))
        )
    return found


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
