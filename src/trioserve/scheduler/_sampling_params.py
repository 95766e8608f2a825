"""The sampling-parameter table: every parameter a generative request may carry, once.

Each row names a parameter (vLLM's name, the ``SamplingParams`` field), its type, its
range and what each front end calls it. Every front end reads a request's parameters
through ``read_parameters`` with its dialect, so a value is checked where it enters,
by the same rule on every protocol, and a refusal names the parameter as the client
spelled it (``ParameterError.param``; OpenAI's error object shows it):

- ``vllm``: OIP inference (REST and gRPC ``parameters``, the ``sampling_parameters``
  input), gRPC ModelStreamInfer, Triton's generate endpoints, the in-process API;
- ``completions`` and ``chat``: the OpenAI endpoints.

``null`` reads as absent. Booleans are not integers, integers are numbers, and numbers
must be finite. ``n`` is checked against the model's ``max_num_seqs`` here too, before
anything is allocated per sample. Defaults are ``SamplingParams``' (and, for
``priority``, ``GenerationRequest``'s).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from .._errors import InvalidArgumentError
from .._types import UINT64_MAX

Dialect = Literal["vllm", "completions", "chat"]
Kind = Literal["int", "number", "bool", "stops"]

MAX_LOGPROBS = 20  # the most alternatives a token's logprobs may list (OpenAI's limit)
INT64_MAX = 2**63 - 1


class ParameterError(InvalidArgumentError):
    """A bad request parameter; ``param`` is its name as the client sent it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Parameter:
    """One row of the table."""

    name: str  # vLLM's name: the field of SamplingParams (or GenerationRequest)
    kind: Kind
    low: float | None = None  # the range, for "int" and "number"
    high: float | None = None
    low_open: bool = False  # (low, high] rather than [low, high]
    # The names each dialect reads it under, the first given winning; a dialect not
    # listed uses ``name``, and () means the dialect does not take it.
    names: Mapping[Dialect, tuple[str, ...]] = field(default_factory=dict)

    def wire_names(self, dialect: Dialect) -> tuple[str, ...]:
        return self.names.get(dialect, (self.name,))

    def read(self, wire: str, value: Any) -> Any:
        """``value`` checked (sent as ``wire``), as SamplingParams holds it."""
        kind = self.kind
        if kind == "bool" and type(value) is bool:
            return value
        if kind == "stops":
            stops = [value] if isinstance(value, str) else value
            if isinstance(stops, list) and all(isinstance(s, str) and s for s in stops):
                return tuple(stops)
        elif kind == "int" and type(value) is int and self._in_range(value):
            return value
        elif kind == "number" and type(value) in (int, float) and self._in_range(value):
            try:
                return float(value)
            except OverflowError:
                pass  # an integer past any float
        raise ParameterError(wire, f"parameter '{wire}' must be {self.expected()}")

    def expected(self) -> str:
        """What a valid value is, in words (the refusal's message, and the docs)."""
        if self.kind == "bool":
            return "a boolean"
        if self.kind == "stops":
            return "a non-empty string or a list of non-empty strings"
        what = "an integer" if self.kind == "int" else "a finite number"
        if self.high is None:
            return f"{what} {'>' if self.low_open else '>='} {_figure(self.low)}"
        opening = "(" if self.low_open else "["
        return f"{what} in {opening}{_figure(self.low)}, {_figure(self.high)}]"

    def _in_range(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False  # (an int is finite, and may be too large to make a float of)
        low, high = self.low, self.high
        above = low is None or (value > low if self.low_open else value >= low)
        return above and (high is None or value <= high)


def _figure(bound: float | None) -> str:
    """A bound as the docs write it: the wire types' limits as powers of two."""
    if bound is None or bound != int(bound):
        return str(bound)
    whole = int(bound)
    if abs(whole) < 2**32:
        return str(whole)
    power = f"2**{(abs(whole) + 1).bit_length() - 1}"
    return f"-{power}" if whole < 0 else f"{power} - 1"


# The table. Ranges are vLLM's, bounded where a wire type or numpy bounds them.
PARAMETERS: tuple[Parameter, ...] = (
    Parameter(
        "max_tokens", "int", 1, INT64_MAX, names={"chat": ("max_completion_tokens", "max_tokens")}
    ),
    Parameter("temperature", "number", 0),
    Parameter("top_p", "number", 0, 1, low_open=True),
    Parameter("top_k", "int", -1, INT64_MAX),
    Parameter("min_p", "number", 0, 1),
    Parameter("seed", "int", 0, UINT64_MAX),
    Parameter("stop", "stops"),
    Parameter("ignore_eos", "bool"),
    Parameter("n", "int", 1, INT64_MAX),
    # Only the OpenAI endpoints answer logprobs; chat asks through ``top_logprobs`` with
    # ``logprobs: true`` (the endpoint checks that flag).
    Parameter("logprobs", "int", 0, MAX_LOGPROBS, names={"vllm": (), "chat": ("top_logprobs",)}),
    Parameter("presence_penalty", "number", -2, 2),
    Parameter("frequency_penalty", "number", -2, 2),
    Parameter("repetition_penalty", "number", 0, low_open=True),
    # Not sampling: the request's scheduling priority (lower first, vLLM's convention).
    Parameter("priority", "int", -INT64_MAX - 1, INT64_MAX),
)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample (vLLM's names and defaults). A temperature below 1e-5 (the
    sampler's ``GREEDY_BELOW``) or ``top_k == 1`` is greedy. Built unchecked: requests'
    values come through the table."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: all tokens
    min_p: float = 0.0  # tokens less likely than min_p times the likeliest are out
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    # Each output token's log-probability and this many of the most likely ones beside
    # it (None: none; the OpenAI front end sets it).
    logprobs: int | None = None
    # vLLM's penalties (the sampler applies them): presence and frequency on the output's
    # tokens, repetition on the prompt's and the output's.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0


class RequestParameters(NamedTuple):
    sampling: SamplingParams
    priority: int


def read_parameters(
    given: Mapping[str, Any], dialect: Dialect, *, max_num_seqs: int
) -> RequestParameters:
    """The table's parameters in ``given`` (other keys are not looked at), checked."""
    values: dict[str, Any] = {}
    for row in PARAMETERS:
        for wire in row.wire_names(dialect):
            value = given.get(wire)
            if value is not None:
                values[row.name] = row.read(wire, value)
                break
    n = values.get("n", 1)
    if n > max_num_seqs:
        raise ParameterError(
            "n", f"parameter 'n' must be at most the model's max_num_seqs={max_num_seqs}, not {n}"
        )
    priority = values.pop("priority", 0)
    return RequestParameters(SamplingParams(**values), priority)
