"""The engine under a mock clock, driving a model whose every step costs exactly STEP s.

The model's next token is the byte after the last one ("a" -> "bcd..."), and "z" is
followed by end-of-sequence, so every output and every time below is known exactly.
"""

from __future__ import annotations

import logging
from functools import partial

import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry

from trioserve import (
    CancelledError,
    InternalError,
    InvalidArgumentError,
    UnsupportedError,
)
from trioserve._stats import FailureReason
from trioserve.metrics._llm_telemetry import LLMMetricFamilies
from trioserve.models import reference_zoo
from trioserve.scheduler import GenerationRequest, SamplingParams, generative
from trioserve.scheduler._generative_runner import GenerativeRunner
from trioserve.scheduler._runner import ModelRunner

from ._counting_lm import EOS, STEP, CountingLM, failures, oip_request


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


async def test_oip_infer_and_withdraw(make_harness, autojump_clock):
    h = await make_harness()
    response = await h.runner.infer(oip_request(b"a", max_tokens=3, n=2, temperature=0))
    assert response.outputs[0].name == "text_output"
    assert response.outputs[0].data.tolist() == [b"bcd", b"bcd"]
    ticket = h.runner.submit(oip_request(b"a" * 20, max_tokens=30))
    await trio.sleep(2.5 * STEP)
    assert h.runner.kv_cache_state().used_blocks == 2
    ticket.withdraw()
    assert ticket.finished and ticket.withdrawn
    assert h.runner.kv_cache_state().used_blocks == 0
    with pytest.raises(CancelledError):
        ticket.outcome()
    with pytest.raises(InvalidArgumentError, match="UTF-8"):
        h.runner.submit(oip_request(b"\xff"))
    with pytest.raises(InvalidArgumentError, match="'max_tokens' must be an integer"):
        h.runner.submit(oip_request(b"a", max_tokens="many"))


async def test_a_request_withdrawn_before_its_admission_is_not_generated(
    make_harness, autojump_clock
):
    h = await make_harness()
    ticket = h.runner.submit(oip_request(b"a", max_tokens=3))
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
    assert failures(runner) == ({"BACKEND": 1}, (1, 3 * round(STEP * 1e9)))
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
