"""tiny_lm: its paged attention against a dense reference, and greedy determinism."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry

from trioserve import StepSequence
from trioserve.metrics._llm_telemetry import LLMMetricFamilies
from trioserve.models import TinyLM
from trioserve.scheduler import GenerationRequest, SamplingParams
from trioserve.scheduler._generative_runner import GenerativeRunner

from .on_device import cuda_devices, on_a_device


def _norm(x):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)


def dense_logits(model: TinyLM, tokens: list[int]) -> np.ndarray:
    """The same network over the whole sequence at once: no cache, a causal mask."""
    w, s = model.weights, model.shape
    count = len(tokens)
    x = w["embed"][tokens] + w["pos"][np.arange(count)]
    causal = np.tril(np.ones((count, count), bool))
    for layer in range(s.n_layers):
        q, k, v = np.split(_norm(x) @ w[f"{layer}.qkv"], 3, axis=-1)
        q, k, v = (t.reshape(count, s.n_heads, s.head_dim) for t in (q, k, v))
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(s.head_dim)
        scores = np.where(causal, scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", p, v).reshape(count, -1) @ w[f"{layer}.out"]
        x = x + np.maximum(_norm(x) @ w[f"{layer}.up"], 0) @ w[f"{layer}.down"]
    return _norm(x) @ w["embed"].T + w["bias"]


@pytest.fixture
def model():
    lm = TinyLM(num_kv_blocks=16, max_model_len=64)
    lm.load()
    yield lm
    lm.unload()


def test_paged_attention_equals_dense_attention(model):
    a = model.encode("The quick brown fox jumps")  # 25 tokens
    b = model.encode("over the lazy dog")  # 17 tokens
    tables = {"a": [7, 2, 12], "b": [3, 9]}  # scattered, out of order
    # Prompts in two chunks each (the chunked-prefill path), then decodes together.
    steps = [
        [("a", 0, 10), ("b", 0, 17)],
        [("a", 10, 25)],
        *[[("a", p, p + 1), ("b", p - 8, p - 7)] for p in range(25, 30)],
    ]
    full = {"a": a + model.encode("12345"), "b": b + model.encode("abcde")}
    for step in steps:
        batch = [StepSequence(full[name][lo:hi], lo, tables[name]) for name, lo, hi in step]
        logits = model.step(batch)
        for row, (name, _, hi) in enumerate(step):
            expected = dense_logits(model, full[name][:hi])[-1]
            np.testing.assert_allclose(logits[row], expected, rtol=1e-4, atol=1e-4)


def test_weights_come_from_the_seed(model):
    other = TinyLM(num_kv_blocks=16, max_model_len=64)
    other.load()
    assert all(np.array_equal(model.weights[k], other.weights[k]) for k in model.weights)
    reseeded = TinyLM(num_kv_blocks=16, max_model_len=64, seed=1)
    reseeded.load()
    assert not np.array_equal(model.weights["embed"], reseeded.weights["embed"])


def test_tokenizer_round_trips_utf8(model):
    text = "héllo, 世界"
    assert model.decode(model.encode(text)) == text
    assert model.decode(model.encode(text)[:-1]).endswith("\ufffd")
    assert model.decode([*model.encode("hi"), model.eos_token_id]) == "hi"


async def _greedy_texts(prompts: list[str]) -> list[str]:
    runner = GenerativeRunner(TinyLM(num_kv_blocks=64, max_model_len=128), "1", seed=3)
    texts = {}

    async def one(prompt):
        request = GenerationRequest(
            prompt, prompt, SamplingParams(max_tokens=24, temperature=0), trio.current_time()
        )
        async with runner.generate(request) as chunks:
            texts[prompt] = "".join([c.text async for c in chunks])

    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        async with trio.open_nursery() as requests:
            for prompt in prompts:
                requests.start_soon(one, prompt)
        nursery.cancel_scope.cancel()
    return [texts[p] for p in prompts]


async def test_greedy_generation_is_deterministic():
    prompts = ["Once upon a time", "trio is", "KV cache"]
    first = await _greedy_texts(prompts)
    assert first == await _greedy_texts(prompts)
    assert all(first) and len(set(first)) > 1


@pytest.mark.skipif(cuda_devices() > 0, reason="a CUDA device is present")
def test_gpu_device_falls_back_to_numpy_without_a_gpu():
    lm = TinyLM(num_kv_blocks=16, max_model_len=64, device="gpu")
    lm.load()
    assert lm.xp is np
    assert lm.step([StepSequence([1, 2, 3], 0, [0])]).shape == (1, 257)


@on_a_device
def test_cupy_steps_match_numpy(model):
    import cupy

    gpu = TinyLM(num_kv_blocks=16, max_model_len=64, device="gpu")
    gpu.load()
    assert gpu.xp is cupy
    tokens = model.encode("paged attention on the device")
    steps = [StepSequence(tokens[:20], 0, [5, 1]), StepSequence(tokens[20:], 20, [5, 1])]
    on_cpu = [model.step([step]) for step in steps]
    on_gpu = [gpu.step([step]) for step in steps]
    for cpu_logits, gpu_logits in zip(on_cpu, on_gpu, strict=True):
        assert isinstance(gpu_logits, np.ndarray)  # handed back to the engine on the host
        np.testing.assert_allclose(gpu_logits, cpu_logits, rtol=1e-3, atol=1e-3)


async def _run_prompts(lm: TinyLM, prompts: list[str], rounds: int = 1):
    """Greedy texts of ``prompts`` (all at once, ``rounds`` times) and the metrics after."""
    families = LLMMetricFamilies([lm])
    runner = GenerativeRunner(lm, "1", families.telemetry(lm, "1"))
    registry = CollectorRegistry()
    registry.register(families)
    texts: dict[tuple[int, str], str] = {}

    async def one(round_no, prompt):
        sampling = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        request = GenerationRequest(prompt, prompt, sampling, trio.current_time())
        async with runner.generate(request) as chunks:
            texts[round_no, prompt] = "".join([c.text async for c in chunks])

    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        for round_no in range(rounds):
            async with trio.open_nursery() as requests:
                for prompt in prompts:
                    requests.start_soon(one, round_no, prompt)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()

    def metric(name):
        return registry.get_sample_value(name, {"model_name": lm.name})

    return texts, metric


async def test_preemption_and_prefix_reuse_leave_greedy_text_unchanged():
    prompts = [f"prompt number {i}: the same long shared opening" for i in range(4)]
    roomy, _ = await _run_prompts(TinyLM(num_kv_blocks=64, max_model_len=128), prompts)
    # 8 blocks of 16 tokens cannot hold four 48-token prompts with 40 tokens each.
    tight, metric = await _run_prompts(TinyLM(num_kv_blocks=8, max_model_len=128), prompts, 2)
    assert metric("vllm:num_preemptions_total") > 0
    assert metric("vllm:prefix_cache_hits_total") > 0
    for (_, prompt), text in tight.items():
        assert text == roomy[0, prompt]
