"""The engine under a mock clock, driving a model whose every step costs exactly STEP s.

The model's next token is the byte after the last one ("a" -> "bcd..."), and "z" is
followed by end-of-sequence, so every output and every time below is known exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial

import numpy as np
import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trioserve import (
    CancelledError,
    GenerativeModel,
    InferenceRequest,
    InputTensor,
    InternalError,
    InvalidArgumentError,
    MetricsConfig,
    ServerConfig,
    StepSequence,
    UnavailableError,
    UnsupportedError,
)
from trioserve._server import open_server
from trioserve._stats import FailureReason
from trioserve._tensor import datatype
from trioserve.metrics._llm_telemetry import LLMMetricFamilies
from trioserve.models import reference_zoo
from trioserve.scheduler import GenerationRequest, SamplingParams, generative
from trioserve.scheduler._generative_runner import GenerativeRunner
from trioserve.scheduler._runner import ModelRunner

STEP = 0.012  # seconds per model step, whatever the batch (off every bucket boundary)
EOS = 256


class CountingLM(GenerativeModel):
    def __init__(self, **settings):
        settings.setdefault("max_model_len", 64)
        settings.setdefault("num_kv_blocks", 64)
        super().__init__("counting", eos_token_id=EOS, **settings)
        self.steps: list[list[tuple[int, int]]] = []  # (start, tokens) per entry, per step

    async def encode(self, text):  # in trio: exact times under the mock clock
        return list(text.encode())

    def decode(self, token_ids):
        return bytes(t for t in token_ids if t < EOS).decode(errors="replace")

    async def step(self, batch: Sequence[StepSequence]):
        self.steps.append([(b.start, len(b.token_ids)) for b in batch])
        await trio.sleep(STEP)
        logits = np.zeros((len(batch), EOS + 1), np.float32)
        for row, b in enumerate(batch):
            last = b.token_ids[-1]
            logits[row, EOS if last == ord("z") else (last + 1) % EOS] = 1.0
        return logits


class Harness:
    def __init__(self, model: CountingLM, nursery: trio.Nursery) -> None:
        self.model = model
        families = LLMMetricFamilies([model])
        self.telemetry = families.telemetry(model, "1")
        self.runner = GenerativeRunner(model, "1", self.telemetry, seed=0)
        self.registry = CollectorRegistry()
        self.registry.register(families)
        self.nursery = nursery

    async def generate(self, prompt, *, arrival_offset=0.0, priority=0, **sampling):
        request = GenerationRequest(
            f"r{prompt}",
            prompt,
            SamplingParams(**sampling),
            trio.current_time() - arrival_offset,
            priority,
        )
        chunks = []
        async with self.runner.generate(request) as stream:
            async for chunk in stream:
                chunks.append(chunk)
        return chunks

    def value(self, name, **labels):
        value = self.registry.get_sample_value(name, {"model_name": "counting", **labels})
        return value

    def bucket(self, name, le):
        return self.value(f"{name}_bucket", le=le)

    async def settled(self):
        """Wait until the stats task has recorded everything the engine sent."""
        await trio.testing.wait_all_tasks_blocked()


@pytest.fixture
async def make_harness(nursery):
    async def make(**settings) -> Harness:
        harness = Harness(CountingLM(**settings), nursery)
        await nursery.start(harness.runner.run)
        return harness

    return make


def _text(chunks, index=0):
    return "".join(c.text for c in chunks if c.index == index)


async def test_one_request_exact_intervals(make_harness, autojump_clock):
    h = await make_harness()
    start = trio.current_time()
    chunks = await h.generate("a", arrival_offset=0.004, max_tokens=5, temperature=0)
    assert trio.current_time() - start == pytest.approx(5 * STEP)
    assert _text(chunks) == "bcdef"
    assert [c.finish_reason for c in chunks] == [None] * 4 + ["length"]
    assert h.model.steps == [[(0, 1)], [(1, 1)], [(2, 1)], [(3, 1)], [(4, 1)]]
    await h.settled()
    hist = "vllm:time_to_first_token_seconds"
    assert h.value(f"{hist}_sum") == pytest.approx(0.004 + STEP)
    assert h.bucket(hist, "0.01") == 0 and h.bucket(hist, "0.02") == 1
    assert h.value("vllm:inter_token_latency_seconds_count") == 4
    assert h.value("vllm:inter_token_latency_seconds_sum") == pytest.approx(4 * STEP)
    assert h.bucket("vllm:inter_token_latency_seconds", "0.01") == 0
    assert h.bucket("vllm:inter_token_latency_seconds", "0.025") == 4
    assert h.value("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(STEP)
    expected = {"queue": 0.0, "prefill": STEP, "decode": 4 * STEP, "inference": 5 * STEP}
    for phase, seconds in expected.items():
        assert h.value(f"vllm:request_{phase}_time_seconds_sum") == pytest.approx(seconds)
    assert h.value("vllm:e2e_request_latency_seconds_sum") == pytest.approx(0.004 + 5 * STEP)
    assert h.bucket("vllm:e2e_request_latency_seconds", "0.3") == 1
    assert h.value("vllm:request_success_total", finished_reason="length") == 1
    assert h.value("vllm:prompt_tokens_total") == 1
    assert h.value("vllm:generation_tokens_total") == 5
    assert h.value("vllm:iteration_tokens_total_count") == 5
    assert h.bucket("vllm:request_generation_tokens", "5.0") == 1
    assert h.bucket("vllm:request_generation_tokens", "2.0") == 0


async def test_queue_time_when_max_num_seqs_is_reached(make_harness, autojump_clock):
    h = await make_harness(max_num_seqs=1, max_num_batched_tokens=16)
    async with trio.open_nursery() as nursery:
        # Whichever goes first, the other waits for its three steps.
        nursery.start_soon(partial(h.generate, "a", max_tokens=3))
        nursery.start_soon(partial(h.generate, "k", max_tokens=3))
    assert trio.current_time() == pytest.approx(6 * STEP)
    await h.settled()
    assert h.value("vllm:request_queue_time_seconds_sum") == pytest.approx(3 * STEP)
    assert h.value("vllm:e2e_request_latency_seconds_sum") == pytest.approx(3 * STEP + 6 * STEP)
    assert h.value("vllm:time_to_first_token_seconds_sum") == pytest.approx(STEP + 4 * STEP)


async def test_stop_conditions(make_harness, autojump_clock):
    h = await make_harness()
    eos = await h.generate("w", max_tokens=10, temperature=0)
    assert _text(eos) == "xyz" and eos[-1].finish_reason == "stop"
    assert eos[-1].token_ids == (EOS,)
    ignored = await h.generate("y", max_tokens=3, temperature=0, ignore_eos=True)
    assert ignored[-1].finish_reason == "length" and len(ignored) == 3
    stopped = await h.generate("a", max_tokens=10, temperature=0, stop=("def", "xx"))
    assert _text(stopped) == "bc" and stopped[-1].finish_reason == "stop"
    # Text that could be the start of a stop string is held back until it cannot.
    assert [c.text for c in stopped] == ["", "", "b", "c", ""]
    await h.settled()
    assert h.value("vllm:request_success_total", finished_reason="stop") == 2


async def test_preemption_when_blocks_run_out(make_harness, autojump_clock):
    # 3 blocks of 4 tokens: two sequences fit while they are short, not once they grow.
    h = await make_harness(num_kv_blocks=3, block_size=4, max_model_len=12)
    results = {}

    async def run(prompt):
        results[prompt] = await h.generate(prompt, max_tokens=6, temperature=0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "abc")
        nursery.start_soon(run, "klm")
    assert _text(results["abc"]) == "defghi"
    assert _text(results["klm"]) == "nopqrs"  # recomputed, then went on where it was
    # Steps 1-2 both decode; at step 3 both need a second block and the later arrival
    # preempts itself; the other runs alone until it finishes at step 6, then the
    # preempted one resumes: its first block is still cached, so one token is recomputed.
    assert h.model.steps[:3] == [[(0, 3), (0, 3)], [(3, 1), (3, 1)], [(4, 1)]]
    assert h.model.steps[5:7] == [[(7, 1)], [(4, 1)]]
    assert trio.current_time() == pytest.approx(10 * STEP)
    await h.settled()
    assert h.value("vllm:num_preemptions_total") == 1
    assert h.value("vllm:prefix_cache_hits_total") == 4
    assert h.value("vllm:prefix_cache_queries_total") == 3 + 3 + 5
    itl = "vllm:inter_token_latency_seconds"
    # 5 + 5 intervals: all one step, except klm's across the preemption (steps 3-7).
    assert h.value(f"{itl}_count") == 10
    assert h.bucket(itl, "0.025") == 9 and h.bucket(itl, "0.075") == 10
    assert h.value("vllm:request_decode_time_seconds_sum") == pytest.approx(5 * STEP + 9 * STEP)
    assert h.runner.kv_cache_state().used_blocks == 0


async def test_repeated_prompt_hits_the_prefix_cache(make_harness, autojump_clock):
    h = await make_harness(max_model_len=128, num_kv_blocks=16)
    prompt = "a" * 40  # two full blocks of 16 are reusable
    await h.generate(prompt, max_tokens=1)
    first_steps = list(h.model.steps)
    await h.generate(prompt, max_tokens=1)
    assert first_steps == [[(0, 40)]] and h.model.steps[1] == [(32, 8)]
    await h.settled()
    assert h.value("vllm:prefix_cache_queries_total") == 80
    assert h.value("vllm:prefix_cache_hits_total") == 32


async def test_abort_frees_blocks_at_once(make_harness, autojump_clock):
    h = await make_harness()
    request = GenerationRequest(
        "r", "a" * 20, SamplingParams(max_tokens=30, n=2), trio.current_time()
    )
    async with h.runner.generate(request) as stream:
        async for chunk in stream:
            if chunk.index == 1:
                break  # both samples run, and a step is in flight
        assert h.runner.kv_cache_state().used_blocks == 3  # 2 shared, 1 of its own
    assert h.runner.kv_cache_state().used_blocks == 0
    await h.settled()
    assert h.value("vllm:request_success_total", finished_reason="abort") == 1
    assert h.value("vllm:num_requests_running") == 0
    # The step that was in flight still completes; its output for the request is dropped.
    await trio.sleep(STEP)
    assert h.runner.kv_cache_state().used_blocks == 0


async def test_parallel_samples_share_the_prompt(make_harness, autojump_clock):
    h = await make_harness()
    chunks = await h.generate("a" * 17, max_tokens=3, n=3, temperature=0)
    assert [_text(chunks, i) for i in range(3)] == ["bcd"] * 3
    # One prefill; then the two forks recompute only the prompt's partial block.
    assert h.model.steps[0] == [(0, 17)]
    assert h.model.steps[1] == [(17, 1), (16, 2), (16, 2)]
    await h.settled()
    assert h.value("vllm:request_params_n_sum") == 3
    assert h.value("vllm:request_max_num_generation_tokens_sum") == 3
    assert h.value("vllm:request_generation_tokens_sum") == 9


async def test_seeded_sampling_repeats(make_harness, autojump_clock):
    h = await make_harness()
    first = await h.generate("a", max_tokens=8, temperature=1.0, seed=7)
    second = await h.generate("a", max_tokens=8, temperature=1.0, seed=7)
    assert [c.token_ids for c in first] == [c.token_ids for c in second]


async def test_bad_requests_are_refused(make_harness, autojump_clock):
    h = await make_harness(max_num_seqs=4, max_num_batched_tokens=64)
    with pytest.raises(InvalidArgumentError, match="at most 64 tokens"):
        await h.generate("a" * 64)
    with pytest.raises(InvalidArgumentError, match="empty"):
        await h.generate("")
    with pytest.raises(InvalidArgumentError, match="n=5 exceeds max_num_seqs=4"):
        await h.generate("a", n=5)


async def test_the_stat_logger_every_five_seconds(make_harness, autojump_clock, caplog):
    caplog.set_level(logging.DEBUG, logger="trioserve.llm.stats")
    h = await make_harness()
    await h.generate("a" * 20, max_tokens=5)
    await h.generate("a" * 20, max_tokens=5)
    await trio.sleep(15.5)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "trioserve.llm.stats"]
    assert lines[0] == (
        logging.INFO,
        (
            "counting: Avg prompt throughput: 8.0 tokens/s, Avg generation throughput: 2.0 "
            "tokens/s, Running: 0 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.0%, "
            "Prefix cache hit rate: 40.0%"
        ),
    )
    assert lines[1][0] == logging.INFO  # the interval after a busy one
    assert lines[2][0] == logging.DEBUG  # idle
    assert len(lines) == 3


def _oip_request(prompt: bytes, **parameters):
    tensor = InputTensor("text_input", datatype("BYTES"), (1,), np.array([prompt], dtype=object))
    return InferenceRequest("counting", "", {"text_input": tensor}, parameters=parameters)


async def test_oip_infer_and_withdraw(make_harness, autojump_clock):
    h = await make_harness()
    response = await h.runner.infer(_oip_request(b"a", max_tokens=3, n=2, temperature=0))
    assert response.outputs[0].name == "text_output"
    assert response.outputs[0].data.tolist() == [b"bcd", b"bcd"]
    ticket = h.runner.submit(_oip_request(b"a" * 20, max_tokens=30))
    await trio.sleep(2.5 * STEP)
    assert h.runner.kv_cache_state().used_blocks == 2
    ticket.withdraw()
    assert ticket.finished and ticket.withdrawn
    assert h.runner.kv_cache_state().used_blocks == 0
    with pytest.raises(CancelledError):
        ticket.outcome()
    with pytest.raises(InvalidArgumentError, match="UTF-8"):
        h.runner.submit(_oip_request(b"\xff"))
    with pytest.raises(InvalidArgumentError, match="'max_tokens' must be an integer"):
        h.runner.submit(_oip_request(b"a", max_tokens="many"))


async def test_a_request_withdrawn_before_its_admission_is_not_generated(
    make_harness, autojump_clock
):
    h = await make_harness()
    ticket = h.runner.submit(_oip_request(b"a", max_tokens=3))
    ticket.withdraw()  # before the runner's task admits it to the engine
    await h.settled()
    stats = h.runner.inference_statistics()
    assert (stats.success.count, stats.fail.count) == (0, 1)
    assert stats.failures[FailureReason.CANCELED] == 1
    assert stats.execution_count == 0  # no step generated for it


class BadTokenizerLM(CountingLM):
    def decode(self, token_ids):
        if ord("d") in token_ids:
            raise ValueError("no d")
        return super().decode(token_ids)


async def test_a_failing_tokenizer_fails_its_request_not_the_engine(nursery, autojump_clock):
    runner = GenerativeRunner(BadTokenizerLM(), "1")
    await nursery.start(runner.run)
    bad = GenerationRequest(
        "bad", "a", SamplingParams(max_tokens=5, temperature=0), trio.current_time()
    )
    with pytest.raises(InternalError, match="no d"):
        async with runner.generate(bad) as stream:
            assert [c.text async for c in stream]
    good = GenerationRequest(
        "good", "w", SamplingParams(max_tokens=2, temperature=0), trio.current_time()
    )
    async with runner.generate(good) as stream:
        assert "".join([c.text async for c in stream]) == "xy"
    assert runner.kv_cache_state().used_blocks == 0
    # "d" is the third token: the request failed after three steps, as the model's.
    assert _failures(runner) == ({"BACKEND": 1}, (1, 3 * round(STEP * 1e9)))
    assert runner.inference_statistics().success.count == 1


async def test_the_runner_is_a_generative_served_model(make_harness, autojump_clock):
    h = await make_harness()
    assert generative(h.runner) is h.runner
    assert h.runner.model.name == "counting" and h.runner.ready
    plain = ModelRunner(reference_zoo()[0], "1")
    with pytest.raises(UnsupportedError, match="not a generative model"):
        generative(plain)


async def test_statistics_extension_figures(make_harness, autojump_clock):
    """Each request is one inference and one execution: success is its end to end time,
    queue its queue interval, compute_infer its inference interval; an abort fails as
    CANCELED."""
    h = await make_harness(max_num_seqs=1, max_num_batched_tokens=16)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(h.generate, "a", arrival_offset=0.004, max_tokens=3))
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(partial(h.generate, "k", max_tokens=2))  # waits for the first
    request = GenerationRequest("r", "abc", SamplingParams(max_tokens=9), trio.current_time())
    async with h.runner.generate(request) as stream:
        async for _ in stream:
            break  # abort after the first token
    await h.settled()
    stats = h.runner.inference_statistics()
    ns = round(STEP * 1e9)
    assert (stats.inference_count, stats.execution_count) == (2, 2)
    assert stats.success.count == 2
    assert stats.success.ns == 4_000_000 + 3 * ns + 5 * ns  # the second waited 3 steps
    assert (stats.queue.count, stats.queue.ns) == (2, 3 * ns)
    assert (stats.compute_infer.count, stats.compute_infer.ns) == (2, 5 * ns)
    assert (stats.compute_input.ns, stats.compute_output.ns) == (0, 0)
    assert [(b.batch_size, b.compute_infer.count) for b in stats.batch_stats] == [(1, 2)]
    assert (stats.fail.count, stats.fail.ns) == (1, ns)


def _failures(runner: GenerativeRunner) -> tuple[dict[str, int], tuple[int, int]]:
    """The runner's failures by reason (those that happened), and (fail count, fail ns)."""
    stats = runner.inference_statistics()
    reasons = {reason.value: n for reason, n in stats.failures.items() if n}
    return reasons, (stats.fail.count, stats.fail.ns)


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
    assert _failures(runner) == ({"BACKEND": 1}, (1, 4_000_000 + round(STEP * 1e9)))
    await _drain(runner, _request("a"))  # the engine goes on
    assert runner.inference_statistics().success.count == 1


async def test_a_prompt_the_tokenizer_fails_is_a_backend_failure(nursery, autojump_clock):
    runner = GenerativeRunner(FailingEncodeLM(), "1")
    await nursery.start(runner.run)
    with pytest.raises(InvalidArgumentError, match="cannot tokenize the prompt: no !"):
        await _drain(runner, _request("a!", waited=0.002))
    assert _failures(runner) == ({"BACKEND": 1}, (1, 2_000_000))
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
    assert _failures(runner) == ({"OTHER": 2}, (2, 2 * 30_000_000 + 1_000_000))


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


async def _generate(runner: GenerativeRunner, prompt: str, **sampling) -> str:
    request = GenerationRequest(
        f"r{prompt}", prompt, SamplingParams(**sampling), trio.current_time()
    )
    async with runner.generate(request) as stream:
        return "".join([c.text async for c in stream])


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
            texts[name] = await _generate(runner, "a", max_tokens=4, **sampling)
        except InternalError as exc:
            texts[name] = exc

    async with trio.open_nursery() as both:  # in the same steps
        both.start_soon(partial(run, "faulty", seed=13))
        both.start_soon(partial(run, "good", temperature=0))
    assert texts["good"] == "bcde"
    assert isinstance(texts["faulty"], InternalError)
    assert "failed to sample" in texts["faulty"].message
    assert await _generate(runner, "k", max_tokens=2, temperature=0) == "lm"
    assert _failures(runner)[0] == {"OTHER": 1}
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
        await _generate(runner, "!", max_tokens=3)
    assert await _generate(runner, "a", max_tokens=2, temperature=0) == "bc"
    assert _failures(runner)[0] == {"OTHER": 1}
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
        await runner.infer(_oip_request(b"a", max_tokens=2, seed=13))
    response = await runner.infer(_oip_request(b"a", max_tokens=2, temperature=0))
    assert response.outputs[0].data.tolist() == [b"bc"]
    assert _failures(runner)[0] == {"OTHER": 1}


class SurrogateLM(CountingLM):
    """Decodes "c" to a lone surrogate: text no UTF-8 response can carry."""

    def decode(self, token_ids):
        return super().decode(token_ids).replace("c", "\ud800")


async def test_a_response_that_cannot_be_built_fails_its_request(nursery, autojump_clock):
    runner = GenerativeRunner(SurrogateLM(), "1")
    await nursery.start(runner.run)
    with trio.fail_after(10):  # it once waited for ever: the engine thought it answered
        with pytest.raises(InternalError, match="surrogate"):
            await runner.infer(_oip_request(b"a", max_tokens=3, temperature=0))
    response = await runner.infer(_oip_request(b"m", max_tokens=2, temperature=0))
    assert response.outputs[0].data.tolist() == [b"no"]
    assert _failures(runner)[0] == {"BACKEND": 1}
    assert runner.inference_statistics().success.count == 1


class DeviceGreedyLM(CountingLM):
    """Chooses greedy tokens itself (``step_greedy``), as a model on a GPU does."""

    def __init__(self, **settings):
        super().__init__(**settings)
        self.kinds: list[str] = []  # "logits" or "tokens", per step

    @property
    def greedy_on_device(self) -> bool:
        return True

    async def step(self, batch: Sequence[StepSequence]):
        self.kinds.append("logits")
        return await super().step(batch)

    async def step_greedy(self, batch: Sequence[StepSequence]):
        self.kinds.append("tokens")
        logits = await super().step(batch)
        return logits.argmax(axis=1).astype(np.int32)


async def test_greedy_steps_take_tokens_from_the_model(nursery, autojump_clock):
    model = DeviceGreedyLM()
    runner = GenerativeRunner(model, "1")
    await nursery.start(runner.run)
    assert await _generate(runner, "a", max_tokens=4, temperature=0) == "bcde"
    assert model.kinds == ["tokens"] * 4
    # Penalties, logprobs and random draws need the logits: those steps return them.
    model.kinds.clear()
    assert await _generate(runner, "a", max_tokens=2, temperature=0, logprobs=1) == "bc"
    assert await _generate(runner, "k", max_tokens=2, top_k=1, repetition_penalty=1.5) == "lm"
    assert await _generate(runner, "a", max_tokens=2, temperature=1.0, seed=3) != ""
    assert model.kinds == ["logits"] * 6
    # One request that needs logits makes its whole step return them.
    model.kinds.clear()
    async with trio.open_nursery() as both:
        both.start_soon(partial(_generate, runner, "a", max_tokens=3, temperature=0))
        both.start_soon(partial(_generate, runner, "b", max_tokens=3, temperature=0, logprobs=0))
    assert set(model.kinds) == {"logits"}


class WrongTokensLM(DeviceGreedyLM):
    async def step_greedy(self, batch: Sequence[StepSequence]):
        return np.zeros((len(batch), 2), np.int32)  # logits-shaped: not tokens


async def test_greedy_tokens_of_the_wrong_shape_fail_the_step(nursery, autojump_clock):
    runner = GenerativeRunner(WrongTokensLM(), "1")
    await nursery.start(runner.run)
    with pytest.raises(InternalError, match=r"returned tokens of shape \(1, 2\) for a batch of 1"):
        await _generate(runner, "a", max_tokens=2, temperature=0)
    assert _failures(runner)[0] == {"BACKEND": 1}
