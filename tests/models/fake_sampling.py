"""``sample_rows`` (``_sampling_kernel.py``) for the stand-in device, as the CUDA code
does it: the packed parameter rows read back, the k-th value and the top-p boundary
found by the same 8-bit radix passes over the ordered bits (not by sorting, as
``_gpu_sampling.reference_draws`` does), the Gumbel race and the logprob passes. The
Philox numbers come from ``_gpu_sampling.philox_first`` (checked against the
generator's published answers in ``test_gpu_sampling.py``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from trioserve.models._gpu_sampling import philox_first
from trioserve.models._sampling_kernel import DETAIL_WIDTH, MAX_TOP_LOGPROBS, PARAM_WIDTH


def _ordered(values: Any) -> Any:
    bits = np.asarray(values, np.float32).view(np.uint32)
    return np.where(bits & 0x80000000, ~bits, bits | 0x80000000).astype(np.uint32)


def _kth_largest(keys: Any, k: int) -> int:
    prefix, mask, remaining = 0, 0, k
    for shift in (24, 16, 8, 0):
        inside = keys[(keys & mask) == prefix]
        count = np.bincount((inside >> shift) & 255, minlength=256)
        digit = 255
        while digit > 0 and count[digit] < remaining:
            remaining -= count[digit]
            digit -= 1
        prefix |= digit << shift
        mask |= 255 << shift
    return prefix


def _top_p_boundary(keys: Any, weights: Any, target: float) -> int:
    prefix, mask, above = 0, 0, np.float32(0)
    for shift in (24, 16, 8, 0):
        inside = (keys & mask) == prefix
        digits = (keys[inside] >> shift) & 255
        count = np.bincount(digits, minlength=256)
        mass = np.bincount(digits, weights=weights[inside], minlength=256).astype(np.float32)
        before, kept, kept_before = above, -1, above
        for digit in range(255, -1, -1):
            if count[digit] == 0:
                continue
            if kept >= 0 and before >= target:
                break
            kept, kept_before = digit, before
            before = np.float32(before + mass[digit])
        prefix |= kept << shift
        mask |= 255 << shift
        above = kept_before
    return prefix


def _token(row: Any, p: Any) -> int:
    floats = p.view(np.float32)
    temperature, top_p, min_p = floats[7], floats[8], floats[9]
    top_k = int(p[1])
    if temperature <= 0 or top_k == 1:
        return int(np.argmax(row))
    vocab = row.size
    scaled = row / temperature
    top = scaled.max()
    floor = top + np.float32(math.log(min_p)) if min_p > 0 else np.float32(-np.inf)
    keys = _ordered(scaled)
    k_key = _kth_largest(keys, top_k) if 0 < top_k < vocab else 0
    p_key = 0
    if top_p < 1:
        inside = scaled >= floor
        weights = np.exp(scaled[inside] - top)
        target = top_p * np.float32(weights.sum(dtype=np.float32))
        p_key = _top_p_boundary(keys[inside], weights, target)
    kept = (scaled >= floor) & (keys >= k_key) & (keys >= p_key)
    ids = np.flatnonzero(kept)
    words = p.view(np.uint32)
    bits = philox_first((ids, words[5], words[4], 0), (int(words[2]), int(words[3])))
    uniform = (bits.astype(np.float64) + 0.5) * 2.0**-32
    scores = (scaled[ids] - top) + (-np.log(-np.log(uniform))).astype(np.float32)
    return int(ids[np.argmax(scores)]) if ids.size else 0


def _penalised(raw: Any, scratch: Any, p: Any, seen: Any) -> Any:
    """The kernel's ``penalised``: the row copied to ``scratch``, then each seen token."""
    floats = p.view(np.float32)
    presence, frequency, repetition = floats[10], floats[11], floats[12]
    scratch[...] = raw
    for token, count in seen.reshape(-1, 2)[p[13] : p[13] + p[14]]:
        v = scratch[token]
        if repetition != 1:
            v = v / repetition if v > 0 else v * repetition
        cut = float(frequency) * int(count) + (float(presence) if count > 0 else 0.0)
        scratch[token] = np.float32(float(v) - cut)
    return scratch


def sample_rows(grid: Any, logits: Any, vocab: Any, params: Any, seen: Any, scratch: Any,
                out: Any, draws: Any) -> None:  # fmt: skip
    rows = np.asarray(logits, np.float32).reshape(-1, int(vocab))
    packed = np.asarray(params).reshape(-1, PARAM_WIDTH)
    for draw in range(grid[0]):
        p = packed[draw]
        raw = row = rows[p[0]]
        if p[14] > 0:
            row = _penalised(raw, scratch[draw * int(vocab) : (draw + 1) * int(vocab)], p, seen)
        token = out[draw] = _token(row, p)
        asked = int(p[6])
        if asked < 0:
            continue
        norm = raw.max() + np.log(np.exp(raw - raw.max()).sum(dtype=np.float32))
        detail = out[draws + draw * DETAIL_WIDTH : draws + (draw + 1) * DETAIL_WIDTH]
        values = detail.view(np.float32)
        values[0] = raw[token] - norm
        last_value, last_index = np.float32(np.inf), -1
        ids = np.arange(raw.size)
        for n in range(min(asked, MAX_TOP_LOGPROBS)):
            after = (raw < last_value) | ((raw == last_value) & (ids > last_index))
            candidates = np.flatnonzero(after)
            last_index = int(candidates[np.argmax(raw[candidates])])
            last_value = raw[last_index]
            detail[1 + n] = last_index
            values[1 + MAX_TOP_LOGPROBS + n] = last_value - norm
