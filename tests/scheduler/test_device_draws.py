"""The engine with a model that draws tokens on its device (``step_sample``): which steps
go there, what each ``DeviceDraw`` says (parameters, seed, stream, position), the
logprobs it returns, and a wrong answer failing the step, not the engine."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np
import pytest
import trio

from trioserve import DeviceDraw, InternalError, SampledTokens, StepSequence
from trioserve.scheduler import GenerationRequest, SamplingParams
from trioserve.scheduler._generative_runner import GenerativeRunner

from ._counting_lm import StepKindsLM, failures, generated


class DeviceDrawLM(StepKindsLM):
    """Draws each token as the argmax of the counting logits, recording the draws; a
    step without any random draw would be greedy there too."""

    def __init__(self, **settings):
        super().__init__(**settings)
        self.draws: list[list[DeviceDraw]] = []

    @property
    def sampling_on_device(self) -> bool:
        return True

    async def step_sample(self, batch: Sequence[StepSequence], draws: Sequence[DeviceDraw]):
        self.draws.append(list(draws))
        logits = await self.counted("draws", batch)
        tokens = np.array([logits[d.row].argmax() for d in draws], np.int32)
        count = max([d.logprobs for d in draws], default=-1)
        if count < 0:
            return SampledTokens(tokens)
        top = np.tile(np.arange(count, dtype=np.int32), (len(draws), 1))
        return SampledTokens(
            tokens, np.full(len(draws), -0.5, np.float32), top, -top.astype(np.float32)
        )


async def test_random_draws_and_penalties_go_to_the_device(nursery, autojump_clock):
    model = DeviceDrawLM()
    runner = GenerativeRunner(model, "1")
    await nursery.start(runner.run)
    assert await generated(runner, "a", max_tokens=3, temperature=0.7, top_p=0.9) == "bcd"
    assert model.kinds == ["draws"] * 3
    (first,), (second,), _ = model.draws
    assert (first.temperature, first.top_p, first.top_k, first.min_p) == (0.7, 0.9, 0, 0.0)
    assert (first.position, second.position) == (1, 2)  # the drawn token's place
    assert first.logprobs == -1 and first.seed == second.seed and first.stream == 0
    model.kinds.clear()
    assert await generated(runner, "a", max_tokens=2, top_k=1, temperature=2.0) == "bc"
    assert model.draws[-1][0].temperature == 0.0  # greedy, told as temperature 0
    assert await generated(runner, "kk", max_tokens=2, temperature=0, frequency_penalty=0.5) == "lm"
    assert model.kinds == ["draws"] * 4
    (penalised,) = model.draws[-1]
    assert penalised.frequency_penalty == 0.5 and penalised.temperature == 0.0
    assert list(penalised.seen) == [ord("k"), ord("l")]  # distinct, prompt and output
    assert list(penalised.output_counts) == [0, 1]
    assert model.draws[0][0].seen == ()  # no penalty: no history sent


async def test_a_seeded_request_keys_its_samples_streams(nursery, autojump_clock):
    model = DeviceDrawLM()
    runner = GenerativeRunner(model, "1")
    await nursery.start(runner.run)
    await generated(runner, "ab", max_tokens=2, n=3, seed=2**64 - 1)
    forked, after = model.draws[0], model.draws[1]
    assert [(d.seed, d.stream, d.position) for d in forked] == [(2**64 - 1, i, 2) for i in range(3)]
    assert [d.row for d in forked] == [0, 0, 0]  # the forks draw from their parent's row
    assert sorted((d.stream, d.position) for d in after) == [(i, 3) for i in range(3)]
    model.draws.clear()
    async with trio.open_nursery() as both:  # unseeded: a seed of their own each
        both.start_soon(partial(generated, runner, "a", max_tokens=1))
        both.start_soon(partial(generated, runner, "b", max_tokens=1))
    (step,) = model.draws
    assert len({d.seed for d in step}) == 2 and {d.stream for d in step} == {0}


async def test_device_logprobs_reach_the_chunks(nursery, autojump_clock):
    model = DeviceDrawLM()
    runner = GenerativeRunner(model, "1")
    await nursery.start(runner.run)
    request = GenerationRequest(
        "r", "a", SamplingParams(max_tokens=2, temperature=0.5, logprobs=2), trio.current_time()
    )
    async with runner.generate(request) as chunks:
        entries = [entry async for c in chunks for entry in c.logprobs or ()]
    assert [(e.token_id, e.logprob, e.top) for e in entries] == [
        (ord("b"), -0.5, ((0, -0.0), (1, -1.0))),
        (ord("c"), -0.5, ((0, -0.0), (1, -1.0))),
    ]
    assert model.draws[0][0].logprobs == 2


class ShortDrawsLM(DeviceDrawLM):
    """Answers a token too many for a batch holding a "!"."""

    async def step_sample(self, batch, draws):
        sampled = await super().step_sample(batch, draws)
        if not any(ord("!") in b.token_ids for b in batch):
            return sampled
        return SampledTokens(np.zeros(len(draws) + 1, np.int32))


async def test_draws_of_the_wrong_shape_fail_the_step(nursery, autojump_clock):
    runner = GenerativeRunner(ShortDrawsLM(), "1")
    await nursery.start(runner.run)
    with pytest.raises(InternalError, match=r"arrays of shapes \[\(2,\)\] for 1 draws"):
        await generated(runner, "!", max_tokens=2, temperature=1.0)
    assert failures(runner)[0] == {"BACKEND": 1}
    assert await generated(runner, "k", max_tokens=2, temperature=0) == "lm"
