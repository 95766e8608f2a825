"""A generative fake whose engine steps take a declared time.

Its tokenizer is bytes (token = byte, 256 = end of sequence) and its text is known in
advance: each token is the byte after the one before, up to "z", which ends the
sequence. "hello" continues "pqrstuvwxyz"; "y" continues "z" and stops. The logits leave
no choice, so the text is the same at any temperature.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from .._generative import GenerativeModel, Logits, StepSequence

EOS = 256
_LAST = ord("z")

# A small engine by default; any GenerativeModel size may be given instead.
_SMALL_ENGINE = {"max_model_len": 256, "num_kv_blocks": 64, "max_num_seqs": 16}

StepCost = float | Callable[[Sequence[StepSequence]], float]
"""Seconds a step takes: a constant, or a function of the step's batch."""


@dataclass(frozen=True, slots=True)
class ExecutedStep:
    """One engine step: when it ran (``trio.current_time()`` seconds), and how many
    tokens it processed for each sequence (a prompt chunk, or 1 while decoding)."""

    started: float
    finished: float
    tokens: tuple[int, ...]


class TimedLM(GenerativeModel):
    """The generative fake: every step takes ``step_cost`` seconds on trio's clock.

    ``steps`` records every step in order. Other keywords size the engine as for any
    ``GenerativeModel`` (``max_model_len``, ``num_kv_blocks``, ``max_num_seqs``...).
    """

    vocab_size = EOS + 1

    def __init__(self, name: str = "timed_lm", *, step_cost: StepCost = 0.0, **engine: Any) -> None:
        super().__init__(name, eos_token_id=EOS, **{**_SMALL_ENGINE, **engine})
        if not callable(step_cost) and step_cost < 0:
            raise ValueError("a step cannot take negative time")
        self.step_cost = step_cost
        self.steps: list[ExecutedStep] = []

    async def load(self) -> None:
        """Nothing to load; ``async`` so that no worker thread lets a mock clock jump."""

    async def encode(self, text: str) -> list[int]:
        """``async``, as ``load``: a tokenizer in a worker thread lets a mock clock jump."""
        return list(text.encode())

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if t < EOS).decode(errors="replace")

    async def step(self, batch: Sequence[StepSequence]) -> Logits:
        started = trio.current_time()
        seconds = self.step_cost(batch) if callable(self.step_cost) else self.step_cost
        if seconds < 0:
            raise ValueError(f"the cost of a step is negative: {seconds}")
        await trio.sleep(seconds)
        self.steps.append(
            ExecutedStep(started, trio.current_time(), tuple(len(s.token_ids) for s in batch))
        )
        logits: np.ndarray[Any, Any] = np.full((len(batch), EOS + 1), -1e9, np.float32)
        for row, sequence in enumerate(batch):
            last = sequence.token_ids[-1]
            logits[row, last + 1 if last < _LAST else EOS] = 0.0
        return logits
