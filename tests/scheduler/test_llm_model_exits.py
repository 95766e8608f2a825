"""A generative model's code that raises what is no ``Exception`` (``sys.exit``,
``KeyboardInterrupt``, ``GeneratorExit``) in its step or its tokenizer fails the request
it served, as a BACKEND failure naming the model; the engine serves the next one."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import pytest
import trio

from trioserve import GenerativeModel, InternalError, InvalidArgumentError, StepSequence
from trioserve.scheduler._generation import GenerationRequest, SamplingParams
from trioserve.scheduler._generative_runner import GenerativeRunner

EOS = 256


def fault(text: str) -> None:
    """The way out a prompt or a token asks for: "1" sys.exit(5), "2" KeyboardInterrupt,
    "3" GeneratorExit."""
    if "1" in text:
        sys.exit(5)
    if "2" in text:
        raise KeyboardInterrupt
    if "3" in text:
        raise GeneratorExit


class ExitingLM(GenerativeModel):
    """Counts up from the prompt's last byte; exits where ``where`` says, on a digit."""

    def __init__(self, where: str) -> None:
        super().__init__("exiting", eos_token_id=EOS, max_model_len=64, num_kv_blocks=64)
        self.where = where

    async def encode(self, text: str) -> list[int]:
        if self.where == "encode":
            fault(text)
        return list(text.encode())

    def decode(self, token_ids: Sequence[int]) -> str:
        text = bytes(t for t in token_ids if t < EOS).decode(errors="replace")
        if self.where == "decode":
            fault(text)
        return text

    async def step(self, batch: Sequence[StepSequence]) -> np.ndarray:
        await trio.sleep(0.01)
        logits = np.zeros((len(batch), EOS + 1), np.float32)
        for row, b in enumerate(batch):
            if self.where == "step":
                fault(bytes(b.token_ids).decode())
            logits[row, (b.token_ids[-1] + 1) % EOS] = 1.0
        return logits


class ThreadedExitingLM(ExitingLM):
    """Its step is plain: it runs in a worker thread."""

    def step(self, batch: Sequence[StepSequence]) -> np.ndarray:  # type: ignore[override]
        return trio.from_thread.run(ExitingLM.step, self, batch)


WORDS = {"1": "called sys.exit(5)", "2": "raised KeyboardInterrupt", "3": "raised GeneratorExit"}


async def generate(runner: GenerativeRunner, prompt: str) -> str:
    request = GenerationRequest(
        prompt, prompt, SamplingParams(max_tokens=2, temperature=0), trio.current_time()
    )
    async with runner.generate(request) as stream:
        return "".join([chunk.text async for chunk in stream])


@pytest.mark.parametrize(
    ("model", "where", "error", "words"),
    [
        (ExitingLM, "step", InternalError, "in step"),
        (ThreadedExitingLM, "step", InternalError, "in step"),
        (ExitingLM, "encode", InvalidArgumentError, "in its tokenizer"),
        (ExitingLM, "decode", InternalError, "in its tokenizer"),
    ],
)
@pytest.mark.parametrize("digit", sorted(WORDS))
async def test_an_exit_in_model_code_fails_its_request_only(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
    model: type[ExitingLM],
    where: str,
    error: type[Exception],
    words: str,
    digit: str,
) -> None:
    runner = GenerativeRunner(model(where), "1")
    await nursery.start(runner.run)
    # The digit is in the prompt, or (decode) the first token the model produces.
    prompt = "a" + digit if where != "decode" else chr(ord(digit) - 1)
    with pytest.raises(error) as failed:
        await generate(runner, prompt)
    message = f"model 'exiting' {WORDS[digit]} {words}"
    assert str(failed.value) == (
        message if error is InternalError else f"cannot tokenize the prompt: {message}"
    )
    assert await generate(runner, "a") == "bc"  # the engine goes on
    stats = runner.inference_statistics()
    assert {reason.value: n for reason, n in stats.failures.items() if n} == {"BACKEND": 1}
    assert stats.success.count == 1
