"""A generative model's step as the engine calls it, and who chooses its tokens.

Three kinds of step (``step_kind``): the model's own argmax (``step_greedy``: token ids
come back), its device sampler (``step_sample``: each draw as a ``DeviceDraw``, with
the sequence's distinct tokens when it asks for a penalty; tokens and the logprobs asked
for come back), or logits for the engine's sampler
(``_sampling.py``). ``call_step`` runs the one chosen (in a worker thread, or in trio
for an ``async`` step) and checks what came back, so a model answering the wrong shape
fails its step, not the engine.

A device draw's random stream is keyed by the seed its sample's host generator was
made from (``sample_generator``): the request's seed and the sample's index when
seeded, so a seeded request repeats on the device too, with other numbers than on the
host.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import trio

from .._generative import DeviceDraw, GenerativeModel, SampledTokens, StepSequence
from .._model_code import raise_failure
from ._generation import TokenLogprob
from ._sampling import Draw, is_greedy, is_penalised

StepKind = Literal["greedy", "device", "host"]
StepResult = np.ndarray[Any, Any] | SampledTokens


def step_kind(model: GenerativeModel, draws: Sequence[Draw]) -> StepKind:
    """The model's argmax when it can and every draw takes the plain argmax with no
    penalty and no logprobs; else its device sampler when it has one; else the engine,
    from the logits."""
    if model.greedy_on_device and all(
        is_greedy(d.params) and not is_penalised(d.params) and d.params.logprobs is None
        for d in draws
    ):
        return "greedy"
    return "device" if model.sampling_on_device else "host"


@trio.lowlevel.enable_ki_protection  # see _model_code: a Ctrl-C is not the model's
async def call_step(
    model: GenerativeModel, batch: list[StepSequence], kind: StepKind, draws: list[DeviceDraw]
) -> StepResult:
    """The step's logits (batch, vocab), its greedy tokens (batch,), or with ``draws``
    (kind "device") their tokens (``SampledTokens``), as ``kind`` says."""
    call: Any = model.step
    arguments: tuple[Any, ...] = (batch,)
    if kind == "greedy":
        call = model.step_greedy
    elif kind == "device":
        call, arguments = model.step_sample, (batch, draws)
    try:
        if model.steps_async:
            result = await call(*arguments)
        else:
            result = await trio.to_thread.run_sync(call, *arguments)
    except BaseException as exc:
        raise_failure(exc, model.name, "in step")
    if kind == "device":
        return _checked_draws(result, len(draws), model.name)
    logits = np.asarray(result)
    if logits.ndim != 1 + (kind == "host") or logits.shape[0] != len(batch):
        what = "logits" if kind == "host" else "tokens"
        raise RuntimeError(
            f"model '{model.name}' step returned {what} of shape {logits.shape} "
            f"for a batch of {len(batch)}"
        )
    return logits


def _checked_draws(result: Any, draws: int, name: str) -> SampledTokens:
    """``step_sample``'s answer, if it is one token per draw (and logprob arrays of as
    many rows, where there are some)."""
    if not isinstance(result, SampledTokens):
        raise RuntimeError(f"model '{name}' step_sample returned {type(result).__name__}")
    arrays = [result.tokens, result.logprobs, result.top_tokens, result.top_logprobs]
    shapes = [np.shape(a) for a in arrays if a is not None]
    if np.ndim(result.tokens) != 1 or any(not shape or shape[0] != draws for shape in shapes):
        raise RuntimeError(
            f"model '{name}' step_sample returned arrays of shapes {shapes} for {draws} draws"
        )
    return result


def device_draw(draw: Draw) -> DeviceDraw:
    """``draw`` as a device draws it: greedy as temperature 0, its stream's key, and
    for penalties the sequence's distinct tokens with their counts in the output."""
    params = draw.params
    seed, stream = _stream_key(draw.rng)
    seen: np.ndarray[Any, Any] | tuple[()] = ()
    output_counts: np.ndarray[Any, Any] | tuple[()] = ()
    if draw.history is not None and is_penalised(params):
        seen, output_counts = draw.history.arrays()
    return DeviceDraw(
        row=draw.row,
        temperature=0.0 if is_greedy(params) else params.temperature,
        top_k=max(params.top_k, 0),
        top_p=params.top_p,
        min_p=params.min_p,
        seed=seed,
        stream=stream,
        position=len(draw.token_ids),
        logprobs=-1 if params.logprobs is None else params.logprobs,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        seen=seen,
        output_counts=output_counts,
    )


def _stream_key(rng: np.random.Generator) -> tuple[int, int]:
    """The (seed, stream) a sample's generator was made from (``sample_generator``):
    (the request's seed, the sample's index) when seeded, else (the drawn seed, 0)."""
    seeds = rng.bit_generator.seed_seq
    entropy: Any = seeds.entropy if isinstance(seeds, np.random.SeedSequence) else None
    if entropy is not None and np.ndim(entropy) == 0:
        return int(entropy) % 2**64, 0
    if entropy is None or len(entropy) != 2:
        raise ValueError("a sample's generator not made by sample_generator")
    return int(entropy[0]) % 2**64, int(entropy[1])


def device_logprobs(sampled: SampledTokens, draws: Sequence[Draw]) -> list[TokenLogprob | None]:
    """The logprobs a device returned (``step_sample``), for the draws that asked."""
    found: list[TokenLogprob | None] = [None] * len(draws)
    for i, draw in enumerate(draws):
        count = draw.params.logprobs
        if count is None:
            continue
        if sampled.logprobs is None or (count and sampled.top_logprobs is None):
            raise RuntimeError("the model's device returned no logprobs")
        top: tuple[tuple[int, float], ...] = ()
        if count:
            assert sampled.top_tokens is not None
            assert sampled.top_logprobs is not None
            ids, values = sampled.top_tokens[i, :count], sampled.top_logprobs[i, :count]
            top = tuple(zip(map(int, ids), map(float, values), strict=True))
        found[i] = TokenLogprob(int(sampled.tokens[i]), float(sampled.logprobs[i]), top)
    return found
