"""Rotary position embeddings of the Llama family, as a Hugging Face ``config.json`` sets
them.

Two layouts are in use. transformers 5 writes ``rope_parameters``: ``rope_type``,
``rope_theta`` and the type's own keys in one object. Earlier versions wrote
``rope_theta`` at the top level and the scaling, if any, as ``rope_scaling`` (its kind
under ``rope_type`` or the older ``type``). Both are read; where a file has both,
``rope_parameters`` wins, as it does in transformers 5. Reading only the legacy keys of
a new checkpoint would serve it with θ = 10,000 and no scaling: wrong text, silently.

Types served: ``default``; ``linear`` (positions slowed by ``factor``); ``llama3`` (Llama
3.1's blend of slowed long wavelengths and kept short ones); ``yarn`` (NTK-by-parts
interpolation between ``beta_fast`` and ``beta_slow`` rotations, and its attention
factor on cos and sin); ``dynamic`` (NTK scaling whose base grows with the longest
sequence past ``max_position_embeddings``: up to that length its frequencies are the
default ones, so it is served exactly up to there and no further, since past it a
sequence's frequencies would depend on the other sequences of each step). Any other
type is refused with its name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np


class RopeError(ValueError):
    """Rotary settings this server cannot serve, and why."""


@dataclass(frozen=True)
class Rope:
    """What the forward pass needs: a frequency per pair of dimensions, a factor on cos
    and sin, and the longest sequence the frequencies serve (None: no bound of theirs)."""

    kind: str
    inverse_frequencies: tuple[float, ...]
    attention_factor: float = 1.0
    max_positions: int | None = None


def read_rope(config: Mapping[str, Any], head_dim: int) -> Rope:
    """The rotary embedding ``config`` (a ``config.json`` document) describes."""
    parameters = _parameters(config)
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if parameters.get("partial_rotary_factor", 1.0) != 1.0:
        raise RopeError("partial_rotary_factor (rotating part of each head) is not supported")
    theta = float(parameters.get("rope_theta", config.get("rope_theta", 10000.0)))
    inverse = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    max_positions = int(config.get("max_position_embeddings", 2048))
    if "original_max_position_embeddings" in config:  # where some configs keep it
        parameters = {"original_max_position_embeddings": config["original_max_position_embeddings"],
                      **parameters}  # fmt: skip
    try:
        if kind == "default":
            return Rope(kind, tuple(inverse))
        if kind == "linear":
            return Rope(kind, tuple(inverse / float(parameters["factor"])))
        if kind == "llama3":
            return Rope(kind, tuple(_llama3(inverse, parameters)))
        if kind == "yarn":
            frequencies, attention = _yarn(inverse, theta, head_dim, parameters, max_positions)
            return Rope(kind, tuple(frequencies), attention)
        if kind == "dynamic":
            float(parameters["factor"])  # required, though it changes nothing up to the bound
            return Rope(kind, tuple(inverse), max_positions=max_positions)
    except KeyError as exc:
        raise RopeError(f"rope type {kind!r} needs {exc}") from None
    raise RopeError(
        f"rope type {kind!r} is not supported (served: default, linear, dynamic, yarn, llama3)"
    )


def _parameters(config: Mapping[str, Any]) -> Mapping[str, Any]:
    parameters = config.get("rope_parameters")
    if parameters is None:
        parameters = config.get("rope_scaling") or {}
    if not isinstance(parameters, Mapping):
        raise RopeError("rope_parameters (or rope_scaling) must be an object")
    return parameters


def _llama3(inverse: np.ndarray[Any, Any], parameters: Mapping[str, Any]) -> np.ndarray[Any, Any]:
    """Long wavelengths slowed by ``factor``, short ones kept, a smooth blend between
    ``low_freq_factor`` and ``high_freq_factor``."""
    factor = float(parameters["factor"])
    low, high = float(parameters["low_freq_factor"]), float(parameters["high_freq_factor"])
    original = float(parameters["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inverse
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * inverse / factor + smooth * inverse
    scaled = np.where(wavelength > original / low, inverse / factor, inverse)
    middle = (wavelength <= original / low) & (wavelength >= original / high)
    return np.where(middle, blended, scaled)


def _yarn(
    inverse: np.ndarray[Any, Any],
    theta: float,
    head_dim: int,
    parameters: Mapping[str, Any],
    max_positions: int,
) -> tuple[np.ndarray[Any, Any], float]:
    """YaRN: dimensions that turn fewer than ``beta_slow`` times over the original context
    are interpolated (slowed by ``factor``), those that turn more than ``beta_fast`` times
    are kept, a linear ramp between; cos and sin grow by the attention factor."""
    original = float(parameters["original_max_position_embeddings"])
    factor = parameters.get("factor")
    factor = max_positions / original if factor is None else float(factor)
    attention = parameters.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = parameters.get("mscale"), parameters.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = _mscale(factor, float(mscale)) / _mscale(factor, float(mscale_all_dim))
        else:
            attention = _mscale(factor, 1.0)
    fast = float(parameters.get("beta_fast") or 32)
    slow = float(parameters.get("beta_slow") or 1)

    def dimension(rotations: float) -> float:
        """The dimension whose pair turns ``rotations`` times over the original context."""
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(fast), dimension(slow)
    if parameters.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of no width would divide by zero
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # 1 where the pair turns fast enough to keep its frequency
    return inverse / factor * (1 - kept) + inverse * kept, float(attention)


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
