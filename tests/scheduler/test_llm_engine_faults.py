"""The engine's failures under a mock clock: a model's step or tokenizer that fails,
faults of the engine's own work (sampling, applying a step, building a response), each
failing its own request and counted as the statistics and metrics count failures, the
engine and the batch going on; a model's greedy tokens of the wrong shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np
import pytest
import trio
import trio.testing
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trioserve import (
    InternalError,
    InvalidArgumentError,
    MetricsConfig,
    ServerConfig,
    StepSequence,
    UnavailableError,
)
from trioserve._server import open_server
from trioserve.scheduler import GenerationRequest, SamplingParams
from trioserve.scheduler._generative_runner import GenerativeRunner

from ._counting_lm import STEP, CountingLM, StepKindsLM, failures, generated, oip_request


class FailingStepLM(CountingLM):
    """Its step fails on every batch that holds a "!"."""

    async def step(self, batch: Sequence[StepSequence]):
        logits = await super().step(batch)
        if any(ord("!") in b.token_ids for b in batch):
            raise RuntimeError("no !")
        return logits


class FailingEncodeLM(CountingLM):
    async def encode(self, text):
        if "!" in text:
            raise ValueError("no !")
        return await super().encode(text)


async def _drain(runner: GenerativeRunner, request: GenerationRequest) -> None:
    async with runner.generate(request) as stream:
        async for _ in stream:
            pass


def _request(prompt: str, *, waited: float = 0.0, max_tokens: int = 3) -> GenerationRequest:
    """A request for ``prompt`` that arrived ``waited`` s ago."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0)
    return GenerationRequest(prompt, prompt, sampling, trio.current_time() - waited)


async def test_a_failing_step_is_a_backend_failure(nursery, autojump_clock):
    runner = GenerativeRunner(FailingStepLM(), "1")
    await nursery.start(runner.run)
    with pytest.raises(InternalError, match="no !"):
        await _drain(runner, _request("a!", waited=0.004))
    # Its end to end time: 4 ms before it reached the engine, then the one failed step.
    assert failures(runner) == ({"BACKEND": 1}, (1, 4_000_000 + round(STEP * 1e9)))
    await _drain(runner, _request("a"))  # the engine goes on
    assert runner.inference_statistics().success.count == 1


async def test_a_prompt_the_tokenizer_fails_is_a_backend_failure(nursery, autojump_clock):
    runner = GenerativeRunner(FailingEncodeLM(), "1")
    await nursery.start(runner.run)
    with pytest.raises(InvalidArgumentError, match="cannot tokenize the prompt: no !"):
        await _drain(runner, _request("a!", waited=0.002))
    assert failures(runner) == ({"BACKEND": 1}, (1, 2_000_000))
    assert runner.inference_statistics().success.count == 0


async def test_requests_the_shutdown_ends_fail_as_other(autojump_clock):
    runner = GenerativeRunner(CountingLM(), "1")
    errors: list[Exception] = []

    async def client(request: GenerationRequest) -> None:
        try:
            await _drain(runner, request)
        except UnavailableError as exc:
            errors.append(exc)

    async with trio.open_nursery() as clients, trio.open_nursery() as engine:
        await engine.start(runner.run)
        clients.start_soon(client, _request("a", max_tokens=20))
        clients.start_soon(client, _request("k", waited=0.001, max_tokens=20))
        await trio.sleep(2.5 * STEP)  # both are in their third step
        engine.cancel_scope.cancel()
    assert [str(e) for e in errors] == ["server is shutting down"] * 2
    assert failures(runner) == ({"OTHER": 2}, (2, 2 * 30_000_000 + 1_000_000))


async def test_generative_models_get_the_servers_histograms_and_failures(autojump_clock):
    """Through the server: ``nv_inference_request_failure{reason}`` counts an LLM's
    failures, and its latency histograms take ``--metrics-config`` buckets."""
    config = ServerConfig(
        models=[FailingStepLM()],
        http_port=None,
        grpc_port=None,
        metrics=MetricsConfig(histogram_buckets_s=(0.02, 0.05)),
    )
    async with open_server(config) as server:
        assert (
            "".join(
                [t async for t in server.generate("counting", "a", max_tokens=2, temperature=0)]
            )
            == "bc"
        )
        with pytest.raises(InternalError, match="no !"):
            async for _ in server.generate("counting", "b!", max_tokens=2):
                pass
        assert server.registry is not None
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(generate_latest(server.registry).decode())
            for s in family.samples
        }
    labels = (("model", "counting"), ("version", "1"))
    failures = "nv_inference_request_failure"  # Triton's name: no _total
    assert (
        samples[(failures, (("model", "counting"), ("reason", "BACKEND"), ("version", "1")))] == 1
    )
    assert (
        samples[(failures, (("model", "counting"), ("reason", "CANCELED"), ("version", "1")))] == 0
    )
    # The answered request took two steps (24 ms): above 20 ms, within 50 ms.
    request = "trioserve_request_duration_seconds"
    buckets = {
        le: samples[(f"{request}_bucket", tuple(sorted((*labels, ("le", le)))))]
        for le in ("0.02", "0.05", "+Inf")
    }
    assert buckets == {"0.02": 0, "0.05": 1, "+Inf": 1}
    assert samples[(f"{request}_sum", labels)] == pytest.approx(2 * STEP)


# --- per-request faults of the engine's own work: the request fails, alone --------------


def _faulty_on_seed(function, seed=13):
    """``function`` (the sampler's or the policy's), failing whenever it would touch a
    request seeded ``seed``: a stand-in for a fault that one request's data triggers."""

    def faulty(*args, **kwargs):
        if any(
            getattr(getattr(d, "params", None), "seed", None) == seed
            for arg in args
            if isinstance(arg, list)
            for d in arg
        ):
            raise ValueError("a fault of this request's")
        return function(*args, **kwargs)

    return faulty


async def test_a_sampling_fault_fails_its_request_and_the_batch_goes_on(
    nursery, autojump_clock, monkeypatch
):
    from trioserve.scheduler import _engine

    monkeypatch.setattr(_engine, "choose_tokens", _faulty_on_seed(_engine.choose_tokens))
    runner = GenerativeRunner(CountingLM(), "1")
    await nursery.start(runner.run)
    texts: dict[str, object] = {}

    async def run(name: str, **sampling) -> None:
        try:
            texts[name] = await generated(runner, "a", max_tokens=4, **sampling)
        except InternalError as exc:
            texts[name] = exc

    async with trio.open_nursery() as both:  # in the same steps
        both.start_soon(partial(run, "faulty", seed=13))
        both.start_soon(partial(run, "good", temperature=0))
    assert texts["good"] == "bcde"
    assert isinstance(texts["faulty"], InternalError)
    assert "failed to sample" in texts["faulty"].message
    assert await generated(runner, "k", max_tokens=2, temperature=0) == "lm"
    assert failures(runner)[0] == {"OTHER": 1}
    assert runner.inference_statistics().success.count == 2
    assert runner.kv_cache_state().used_blocks == 0


async def test_a_fault_applying_a_step_fails_its_requests_not_the_engine(
    nursery, autojump_clock, monkeypatch
):
    runner = GenerativeRunner(CountingLM(), "1")
    await nursery.start(runner.run)
    policy = runner.engine.policy
    computed = policy.computed

    def faulty(seq, count):
        if seq.owner.request.prompt == "!":
            raise ValueError("a fault of this request's")
        computed(seq, count)

    monkeypatch.setattr(policy, "computed", faulty)
    with pytest.raises(InternalError, match="failed to apply a step"):
        await generated(runner, "!", max_tokens=3)
    assert await generated(runner, "a", max_tokens=2, temperature=0) == "bc"
    assert failures(runner)[0] == {"OTHER": 1}
    assert runner.kv_cache_state().used_blocks == 0


async def test_a_fault_queueing_an_oip_request_fails_it_not_the_runner(
    nursery, autojump_clock, monkeypatch
):
    """The runner admits OIP requests in a task of its own: a fault there once stopped
    the runner's nursery, and the server with it."""
    from trioserve.scheduler import _engine

    def faulty(params, index, engine_rng):
        if params.seed == 13:
            raise ValueError("a fault of this request's")
        return np.random.default_rng(0)

    monkeypatch.setattr(_engine, "sample_generator", faulty)
    runner = GenerativeRunner(CountingLM(), "1")
    await nursery.start(runner.run)
    with pytest.raises(InternalError, match="could not queue"):
        await runner.infer(oip_request(b"a", max_tokens=2, seed=13))
    response = await runner.infer(oip_request(b"a", max_tokens=2, temperature=0))
    assert response.outputs[0].data.tolist() == [b"bc"]
    assert failures(runner)[0] == {"OTHER": 1}


class SurrogateLM(CountingLM):
    """Decodes "c" to a lone surrogate: text no UTF-8 response can carry."""

    def decode(self, token_ids):
        return super().decode(token_ids).replace("c", "\ud800")


async def test_a_response_that_cannot_be_built_fails_its_request(nursery, autojump_clock):
    runner = GenerativeRunner(SurrogateLM(), "1")
    await nursery.start(runner.run)
    with trio.fail_after(10):  # it once waited for ever: the engine thought it answered
        with pytest.raises(InternalError, match="surrogate"):
            await runner.infer(oip_request(b"a", max_tokens=3, temperature=0))
    response = await runner.infer(oip_request(b"m", max_tokens=2, temperature=0))
    assert response.outputs[0].data.tolist() == [b"no"]
    assert failures(runner)[0] == {"BACKEND": 1}
    assert runner.inference_statistics().success.count == 1


class DeviceGreedyLM(StepKindsLM):
    """Chooses greedy tokens itself (``step_greedy``), as a model on a GPU does."""

    @property
    def greedy_on_device(self) -> bool:
        return True

    async def step_greedy(self, batch: Sequence[StepSequence]):
        logits = await self.counted("tokens", batch)
        return logits.argmax(axis=1).astype(np.int32)


async def test_greedy_steps_take_tokens_from_the_model(nursery, autojump_clock):
    model = DeviceGreedyLM()
    runner = GenerativeRunner(model, "1")
    await nursery.start(runner.run)
    assert await generated(runner, "a", max_tokens=4, temperature=0) == "bcde"
    assert model.kinds == ["tokens"] * 4
    # Penalties, logprobs and random draws need the logits: those steps return them.
    model.kinds.clear()
    assert await generated(runner, "a", max_tokens=2, temperature=0, logprobs=1) == "bc"
    assert await generated(runner, "k", max_tokens=2, top_k=1, repetition_penalty=1.5) == "lm"
    assert await generated(runner, "a", max_tokens=2, temperature=1.0, seed=3) != ""
    assert model.kinds == ["logits"] * 6
    # One request that needs logits makes its whole step return them.
    model.kinds.clear()
    async with trio.open_nursery() as both:
        both.start_soon(partial(generated, runner, "a", max_tokens=3, temperature=0))
        both.start_soon(partial(generated, runner, "b", max_tokens=3, temperature=0, logprobs=0))
    assert set(model.kinds) == {"logits"}


class WrongTokensLM(DeviceGreedyLM):
    async def step_greedy(self, batch: Sequence[StepSequence]):
        return np.zeros((len(batch), 2), np.int32)  # logits-shaped: not tokens


async def test_greedy_tokens_of_the_wrong_shape_fail_the_step(nursery, autojump_clock):
    runner = GenerativeRunner(WrongTokensLM(), "1")
    await nursery.start(runner.run)
    with pytest.raises(InternalError, match=r"returned tokens of shape \(1, 2\) for a batch of 1"):
        await generated(runner, "a", max_tokens=2, temperature=0)
    assert failures(runner)[0] == {"BACKEND": 1}
