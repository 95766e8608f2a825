"""The device sampler's host side, its numpy reference, and the check it passes at load.

``DeviceSampler.sample`` packs a step's draws (``DeviceDraw``, one int32 row each),
launches ``sample_rows`` (``_sampling_kernel.py``) on the forward's stream over the
step's float32 logits, and copies back the tokens only, or with the logprobs' part
when a draw asked for them: never the logits.

``reference_draws`` is the kernel's arithmetic in numpy, rule for rule: the same
penalties, scaling, filters and tie rules, the same Philox-4x32-10 numbers, the same float32
operations where the kernel's result depends on them. It is what the device is held
to: ``check_sampler`` runs a fixed set of draws (greedy, temperature, top-k, top-p,
min-p, logprobs, penalties) over fixed logits on the device at load and compares; a model whose
sampler disagrees samples on the host instead (``GpuForward.sampling_failure`` says
why).

The random numbers are not those of the host sampler (``scheduler/_sampling.py``, one
numpy ``Generator`` per sample and an inverse CDF): a seed gives repeatable tokens on
the device and repeatable tokens on the host, not the same ones.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from .._generative import DeviceDraw, SampledTokens
from ._sampling_kernel import (
    DETAIL_WIDTH,
    MAX_TOP_LOGPROBS,
    PARAM_FREQUENCY,
    PARAM_LOGPROBS,
    PARAM_MIN_P,
    PARAM_POSITION,
    PARAM_PRESENCE,
    PARAM_REPETITION,
    PARAM_ROW,
    PARAM_SEED_HIGH,
    PARAM_SEED_LOW,
    PARAM_SEEN,
    PARAM_SEEN_AT,
    PARAM_STREAM,
    PARAM_TEMPERATURE,
    PARAM_TOP_K,
    PARAM_TOP_P,
    PARAM_WIDTH,
    PHILOX_KEY_STEPS,
    PHILOX_MULTIPLIERS,
    SAMPLE_THREADS,
)

Array = Any  # a cupy ndarray
HostArray = np.ndarray[Any, Any]
_WORD = 0xFFFFFFFF


def pack_draws(draws: Sequence[DeviceDraw], vocab: int) -> tuple[HostArray, HostArray]:
    """The kernel's parameter rows (int32; the floats as their bits), and the (token id,
    count in the output) pairs of the penalised draws' seen tokens, one run per draw
    (ids past the vocabulary left out, as the host sampler does)."""
    packed = np.zeros((len(draws), PARAM_WIDTH), np.int32)
    floats = packed.view(np.float32)
    words = packed.view(np.uint32)
    pairs: list[HostArray] = [np.zeros((1, 2), np.int32)]  # never empty: a buffer to pass
    at = 1
    for i, d in enumerate(draws):
        packed[i, PARAM_ROW] = d.row
        # top_k past int32 keeps everything, as 0 does
        packed[i, PARAM_TOP_K] = d.top_k if 0 < d.top_k < 2**31 else 0
        words[i, PARAM_SEED_LOW] = d.seed & _WORD
        words[i, PARAM_SEED_HIGH] = (d.seed >> 32) & _WORD
        words[i, PARAM_STREAM] = d.stream & _WORD
        words[i, PARAM_POSITION] = d.position & _WORD
        packed[i, PARAM_LOGPROBS] = min(d.logprobs, MAX_TOP_LOGPROBS)
        floats[i, PARAM_TEMPERATURE] = d.temperature
        floats[i, PARAM_TOP_P] = d.top_p
        floats[i, PARAM_MIN_P] = d.min_p
        floats[i, PARAM_PRESENCE] = d.presence_penalty
        floats[i, PARAM_FREQUENCY] = d.frequency_penalty
        floats[i, PARAM_REPETITION] = d.repetition_penalty
        seen = _seen_pairs(d, vocab)
        if len(seen):
            packed[i, PARAM_SEEN_AT], packed[i, PARAM_SEEN] = at, len(seen)
            pairs.append(seen)
            at += len(seen)
    return packed, np.concatenate(pairs)


def _seen_pairs(d: DeviceDraw, vocab: int) -> HostArray:
    """(token id, count in the output) of each token ``d`` penalises (int32; none when
    it has no penalty): ids in the vocabulary, each once (the kernel updates each in
    its own thread), the first count given for it."""
    if not (d.presence_penalty or d.frequency_penalty or d.repetition_penalty != 1):
        return np.zeros((0, 2), np.int32)
    ids, counts = np.asarray(d.seen, np.int64), np.asarray(d.output_counts, np.int64)
    seen = np.column_stack([ids, counts]).reshape(-1, 2)
    seen = seen[(seen[:, 0] >= 0) & (seen[:, 0] < vocab)]
    first = np.unique(seen[:, 0], return_index=True)[1]
    pairs: HostArray = seen[np.sort(first)].astype(np.int32)
    return pairs


def penalised_row(row: HostArray, d: DeviceDraw) -> HostArray:
    """``row`` (float32) with ``d``'s penalties, as the kernel's ``penalised`` applies
    them (the penalties as float32, the subtraction in double)."""
    seen = _seen_pairs(d, row.size)
    if not len(seen):
        return row
    row = row.copy()
    ids, counts = seen[:, 0], seen[:, 1].astype(np.int64)
    values = row[ids]
    repetition = np.float32(d.repetition_penalty)
    if repetition != 1:
        values = np.where(values > 0, values / repetition, values * repetition)
    presence, frequency = (np.float64(np.float32(v)) for v in (d.presence_penalty,
                                                               d.frequency_penalty))  # fmt: skip
    cut = frequency * counts + np.where(counts > 0, presence, 0.0)
    row[ids] = (values.astype(np.float64) - cut).astype(np.float32)
    return row


def philox_first(counter: Sequence[Any], key: tuple[int, int]) -> HostArray:
    """Philox-4x32-10's first output word (uint32) for each counter (four words, each an
    integer or an array of them) under a 64-bit key (two words)."""
    c0, c1, c2, c3 = (np.asarray(c, np.uint64) & _WORD for c in np.broadcast_arrays(*counter))
    k0, k1 = key
    (m0, m1), (w0, w1) = PHILOX_MULTIPLIERS, PHILOX_KEY_STEPS
    for _ in range(10):
        p0, p1 = np.uint64(m0) * c0, np.uint64(m1) * c2
        c0, c1, c2, c3 = (
            (p1 >> np.uint64(32)) ^ c1 ^ np.uint64(k0),
            p1 & np.uint64(_WORD),
            (p0 >> np.uint64(32)) ^ c3 ^ np.uint64(k1),
            p0 & np.uint64(_WORD),
        )
        k0, k1 = (k0 + w0) & _WORD, (k1 + w1) & _WORD
    first: HostArray = c0.astype(np.uint32)
    return first


def _ordered(values: HostArray) -> HostArray:
    """float32 values' bits as uint32 ordered as the floats are (the kernel's ``ordered``)."""
    bits = values.astype(np.float32).view(np.uint32)
    ordered: HostArray = np.where(bits & 0x80000000, ~bits, bits | 0x80000000).astype(np.uint32)
    return ordered


def _reference_token(raw: HostArray, d: DeviceDraw) -> int:
    row = penalised_row(raw, d)
    if np.float32(d.temperature) <= 0 or d.top_k == 1:  # as the kernel reads it
        return int(np.argmax(row))
    vocab = row.size
    scaled = row / np.float32(d.temperature)  # float32, as the kernel divides
    top = scaled.max()
    floor = np.float32(-np.inf)
    if d.min_p > 0:
        floor = top + np.float32(math.log(np.float32(d.min_p)))
    keys = _ordered(scaled)
    keep = scaled >= floor
    if 0 < d.top_k < vocab:
        keep &= keys >= np.sort(keys)[vocab - d.top_k]
    if np.float32(d.top_p) < 1:
        inside = scaled >= floor
        weights = np.exp(scaled[inside] - top)
        target = np.float32(d.top_p) * np.float32(weights.sum(dtype=np.float64))
        # Each distinct value's mass and the mass strictly above it; top-p keeps the
        # values whose mass above stays below the target.
        distinct, group = np.unique(keys[inside], return_inverse=True)
        mass = np.bincount(group, weights=weights)[::-1]
        above = np.cumsum(mass) - mass
        keep &= keys >= distinct[::-1][above < target].min()
    ids = np.flatnonzero(keep)
    bits = philox_first((ids, d.position, d.stream, 0), (d.seed & _WORD, d.seed >> 32 & _WORD))
    uniform = (bits.astype(np.float64) + 0.5) * 2.0**-32
    gumbel = (-np.log(-np.log(uniform))).astype(np.float32)
    scores = (scaled[ids] - top) + gumbel
    return int(ids[np.argmax(scores)])


def reference_draws(logits: HostArray, draws: Sequence[DeviceDraw]) -> SampledTokens:
    """What ``sample_rows`` returns for ``draws`` over float32 ``logits`` (rows, vocab),
    computed on the host (logprobs in float64: the kernel's are within float32's error)."""
    rows = np.asarray(logits, np.float32)
    tokens = np.array([_reference_token(rows[d.row], d) for d in draws], np.int32)
    if not any(d.logprobs >= 0 for d in draws):
        return SampledTokens(tokens)
    wide = rows.astype(np.float64)
    peak = wide.max(axis=1, keepdims=True)
    logp = wide - (peak + np.log(np.exp(wide - peak).sum(axis=1, keepdims=True)))
    count = max(min(d.logprobs, MAX_TOP_LOGPROBS) for d in draws)
    top_tokens = np.zeros((len(draws), count), np.int32)
    top_logprobs = np.zeros((len(draws), count), np.float32)
    for i, d in enumerate(draws):
        n = min(max(d.logprobs, 0), count)
        ranked = np.lexsort((np.arange(rows.shape[1]), -rows[d.row]))[:n]  # ties: lower id
        top_tokens[i, :n] = ranked
        top_logprobs[i, :n] = logp[d.row, ranked]
    chosen = logp[[d.row for d in draws], tokens].astype(np.float32)
    return SampledTokens(tokens, chosen, top_tokens, top_logprobs)


class DeviceSampler:
    """``sample_rows`` launched on ``stream`` with ``launch`` (``_Kernels``' call)."""

    def __init__(
        self, xp: ModuleType, launch: Callable[..., None], stream: Any, vocab: int
    ) -> None:
        self.xp, self.launch, self.stream, self.vocab = xp, launch, stream, vocab

    def sample(self, logits: Array, draws: Sequence[DeviceDraw]) -> SampledTokens:
        """Each draw's token from float32 ``logits`` (rows, vocab) on the device, after
        the work already on the sampler's stream; waits for it."""
        count = len(draws)
        if not count:
            self.stream.synchronize()  # the step's forward, as with draws
            return SampledTokens(np.zeros(0, np.int32))
        with self.stream:
            return self._sample(logits, draws, count)

    def _sample(self, logits: Array, draws: Sequence[DeviceDraw], count: int) -> SampledTokens:
        packed, pairs = pack_draws(draws, self.vocab)
        params, seen = self.xp.asarray(packed), self.xp.asarray(pairs)
        # a row per draw for the penalised copies, when a draw has some
        scratch = self.xp.empty(count * self.vocab if len(pairs) > 1 else 1, np.float32)
        asked = max(min(d.logprobs, MAX_TOP_LOGPROBS) for d in draws)
        out = self.xp.empty(count * (1 + DETAIL_WIDTH) if asked >= 0 else count, np.int32)
        self.launch(
            "sample_rows", (count,), SAMPLE_THREADS,
            logits, np.int32(self.vocab), params, seen, scratch, out, np.int32(count),
        )  # fmt: skip
        host = out.get(stream=self.stream)
        self.stream.synchronize()
        tokens = host[:count].copy()
        if asked < 0:
            return SampledTokens(tokens)
        detail = host[count:].reshape(count, DETAIL_WIDTH)
        values = detail.view(np.float32)
        return SampledTokens(
            tokens,
            values[:, 0].copy(),
            detail[:, 1 : 1 + asked].copy(),
            values[:, 1 + MAX_TOP_LOGPROBS : 1 + MAX_TOP_LOGPROBS + asked].copy(),
        )


def check_draws(vocab: int) -> tuple[HostArray, list[DeviceDraw]]:
    """The load check's fixed logits (8 rows) and draws: every rule, alone and mixed,
    several seeds, positions and streams, logprobs, penalties."""
    rng = np.random.default_rng(20261126)
    logits = (rng.standard_normal((8, vocab)) * 3).astype(np.float32)
    settings = [
        (0.0, 0, 1.0, 0.0),  # greedy
        (0.7, 1, 1.0, 0.0),  # top_k 1: greedy
        (1.0, 0, 1.0, 0.0),
        (0.8, 0, 0.9, 0.0),
        (1.3, min(40, vocab), 1.0, 0.0),
        (1.0, 0, 1.0, 0.1),
        (0.9, min(50, vocab), 0.8, 0.05),
        (2.0, 0, 0.5, 0.0),
    ]
    draws = []
    for i, (temperature, top_k, top_p, min_p) in enumerate(settings * 4):
        draws.append(
            DeviceDraw(
                row=(i * 3) % 8,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                min_p=min_p,
                seed=(i * 0x9E3779B97F4A7C15) % 2**64,
                stream=i % 3,
                position=7 + i,
                logprobs=(-1, 0, 5, MAX_TOP_LOGPROBS)[i % 4],
            )
        )
    # Every fifth draw with penalties over 30 tokens, some of them in the output.
    seen = rng.choice(vocab, min(30, vocab), replace=False).tolist()
    counts = rng.integers(0, 3, len(seen)).tolist()
    for i in range(4, len(draws), 5):
        draws[i] = dataclasses.replace(
            draws[i], seen=seen, output_counts=counts,
            presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3,
        )  # fmt: skip
    return logits, draws


def check_sampler(
    sample: Callable[[Array, Sequence[DeviceDraw]], SampledTokens], xp: ModuleType, vocab: int
) -> str | None:
    """Why ``sample`` (the device's) does not do what ``reference_draws`` does on the
    fixed draws, or None when it does: every greedy token equal, at most one other
    token apart (a score within float rounding of another's may go either way), logprobs
    within 1e-3 and the same top tokens."""
    logits, draws = check_draws(vocab)
    got = sample(xp.asarray(logits), draws)
    wanted = reference_draws(logits, draws)
    differ = np.flatnonzero(np.asarray(got.tokens) != wanted.tokens)
    greedy = [
        int(i) for i in differ if np.float32(draws[i].temperature) <= 0 or draws[i].top_k == 1
    ]
    if greedy or len(differ) > 1:
        return f"tokens {np.asarray(got.tokens).tolist()}, expected {wanted.tokens.tolist()}"
    asked = [i for i, d in enumerate(draws) if d.logprobs >= 0 and i not in differ]
    for i in asked:
        n = draws[i].logprobs
        if not _same_logprobs(got, wanted, i, n):
            return f"draw {i}: logprobs differ"
    return None


def _same_logprobs(got: SampledTokens, wanted: SampledTokens, i: int, n: int) -> bool:
    """Whether draw ``i``'s logprobs and its ``n`` top tokens agree (within 1e-3)."""
    if got.logprobs is None or got.top_tokens is None or got.top_logprobs is None:
        return False
    assert wanted.logprobs is not None
    assert wanted.top_tokens is not None
    assert wanted.top_logprobs is not None
    return (
        abs(float(got.logprobs[i]) - float(wanted.logprobs[i])) <= 1e-3
        and got.top_tokens[i, :n].tolist() == wanted.top_tokens[i, :n].tolist()
        and bool(np.allclose(got.top_logprobs[i, :n], wanted.top_logprobs[i, :n], atol=1e-3))
    )
