"""The device sampler: its numpy reference's distributions, the stand-in kernel (the CUDA
code's radix passes in numpy) against the reference, the load check, and the engine
drawing through ``step_sample`` on the stand-in device."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import pytest
import trio

from trioserve import DeviceDraw, StepSequence
from trioserve.models import _tiny_lm
from trioserve.models._gpu_forward import _Kernels
from trioserve.models._gpu_sampling import (
    DeviceSampler,
    check_draws,
    pack_draws,
    philox_first,
    reference_draws,
)
from trioserve.models._tiny_lm import TinyLM
from trioserve.scheduler import GenerationRequest, SamplingParams
from trioserve.scheduler._generative_runner import GenerativeRunner
from trioserve.scheduler._model_steps import device_draw
from trioserve.scheduler._sampling import Draw, TokenHistory, choose_tokens

from . import fake_device
from .on_device import on_a_device
from .test_gpu_forward import BLOCK, forwards, steps

LOGITS = np.array([[1.0, 2.5, 0.3, 2.4, -1.0, 0.9, 1.7, -0.2, 2.0, 0.0]], np.float32)


def draw(**given: Any) -> DeviceDraw:
    settings = {"row": 0, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                "seed": 7, "stream": 0, "position": 0, "logprobs": -1}  # fmt: skip
    return DeviceDraw(**(settings | given))


def tokens(logits: Any, draws: list[DeviceDraw]) -> list[int]:
    return reference_draws(logits, draws).tokens.tolist()  # type: ignore[no-any-return]


def stand_in() -> DeviceSampler:
    """The sampler over the stand-in device: ``sample_rows`` as the CUDA code does it."""
    kernels = _Kernels(fake_device, np.dtype(np.float32))
    return DeviceSampler(fake_device, kernels, fake_device.cuda.Stream(), LOGITS.shape[1])


def test_philox_gives_the_published_answers() -> None:
    """Philox-4x32-10's known-answer vectors (first words): the kernel's generator."""
    assert int(philox_first((0, 0, 0, 0), (0, 0))) == 0x6627E8D5
    assert int(philox_first((2**32 - 1,) * 4, (2**32 - 1, 2**32 - 1))) == 0x408F276D
    pi = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)
    assert int(philox_first(pi, (0xA4093822, 0x299F31D0))) == 0xD16CFE09


def test_greedy_settings_take_the_argmax() -> None:
    wide = np.random.default_rng(1).standard_normal((3, 500)).astype(np.float32)
    argmax = wide.argmax(axis=1).tolist()
    settings_list = [
        {"temperature": 0.0},
        {"top_k": 1, "temperature": 1.5},
        {"top_p": 1e-6},
        {"min_p": 1.0},
        {"temperature": 1e-30},
        {"temperature": 1e-50},  # 0 as float32, the kernel's greedy
    ]
    for settings in settings_list:
        for seed in range(5):
            draws = [draw(row=r, seed=seed, position=seed, **settings) for r in range(3)]
            assert tokens(wide, draws) == argmax, settings


def test_a_seed_repeats_and_the_batch_does_not_matter() -> None:
    alone = [tokens(LOGITS, [draw(seed=11, position=p)])[0] for p in range(40)]
    assert alone == [tokens(LOGITS, [draw(seed=11, position=p)])[0] for p in range(40)]
    assert len(set(alone)) > 3  # positions draw afresh
    other = [tokens(LOGITS, [draw(seed=12, position=p)])[0] for p in range(40)]
    assert other != alone
    beside = np.concatenate([LOGITS[:, ::-1], LOGITS])
    for p in range(40):  # another row index, other draws around it: the same token
        mixed = [draw(row=0, top_k=2, position=p), draw(row=1, seed=11, position=p),
                 draw(row=1, seed=11, position=p, stream=1)]  # fmt: skip
        assert tokens(beside, mixed)[1] == alone[p]


def _histogram(settings: dict[str, Any], count: int = 8_000) -> np.ndarray:
    draws = [draw(seed=5, position=p, **settings) for p in range(count)]
    return np.bincount(tokens(LOGITS, draws), minlength=LOGITS.shape[1])


def _chi_square(observed: np.ndarray, probabilities: np.ndarray) -> float:
    expected = observed.sum() * probabilities
    kept = expected > 0
    assert observed[~kept].sum() == 0  # nothing drawn outside the kept tokens
    return float(((observed[kept] - expected[kept]) ** 2 / expected[kept]).sum())


def _softmax(values: np.ndarray) -> np.ndarray:
    e = np.exp(values - values.max())
    return e / e.sum()


# The chi-square 0.999 quantiles for 9, 2 and 3 degrees of freedom.
@pytest.mark.parametrize(
    ("settings", "kept", "bound"),
    [
        ({"temperature": 0.8}, list(range(10)), 27.88),
        ({"temperature": 1.2, "top_k": 3}, [1, 3, 8], 13.82),
        ({"top_p": 0.6}, [1, 3, 8], 13.82),  # the shortest head reaching 0.6
        ({"min_p": 0.4}, [1, 3, 6, 8], 16.27),  # p >= 0.4 * p_max
    ],
)
def test_draws_follow_the_softmax_of_the_kept_tokens(settings, kept, bound) -> None:
    temperature = settings.get("temperature", 1.0)
    probabilities = np.zeros(LOGITS.shape[1])
    probabilities[kept] = _softmax(LOGITS[0, kept].astype(np.float64) / temperature)
    assert _chi_square(_histogram(settings), probabilities) < bound


def test_the_chi_square_check_can_fail() -> None:
    """A sampler drawing at temperature 1 is told apart from the softmax at 0.8."""
    probabilities = _softmax(LOGITS[0].astype(np.float64) / 0.8)
    assert _chi_square(_histogram({"temperature": 1.0}), probabilities) > 27.88


def test_the_stand_in_kernel_matches_the_reference() -> None:
    """The CUDA code's radix passes (in the stand-in) keep what the reference's sort
    keeps, ties included; same Philox numbers, same tokens, same logprobs."""
    rng = np.random.default_rng(3)
    vocab = 300
    logits = (rng.standard_normal((4, vocab)) * 2).astype(np.float32)
    logits[2] = np.round(logits[2] * 2) / 2  # many equal values: ties kept together
    logits[3, :] = -1.0
    logits[3, 50:60] = 1.0  # ten equal maxima
    draws = []
    for i in range(200):
        draws.append(
            draw(
                row=i % 4,
                temperature=float(rng.choice([0.0, 0.5, 1.7, 50.0])),  # 50: near uniform
                top_k=int(rng.choice([0, 1, 2, 5, 40, vocab + 1])),
                top_p=float(rng.choice([1.0, 0.9, 0.5, 0.05])),
                min_p=float(rng.choice([0.0, 0.0, 0.1, 0.5])),
                seed=int(rng.integers(2**64, dtype=np.uint64)),
                stream=i % 3,
                position=i,
                logprobs=int(rng.choice([-1, 0, 3, 20])),
            )
        )
        if i % 3 == 0:  # penalties over a random history
            seen = rng.choice(vocab, 40, replace=False)
            draws[-1] = dataclasses.replace(
                draws[-1], seen=seen.tolist(), output_counts=rng.integers(0, 4, 40).tolist(),
                presence_penalty=float(rng.choice([0.0, 1.5])),
                frequency_penalty=float(rng.choice([0.0, -0.7, 2.0])),
                repetition_penalty=float(rng.choice([1.0, 0.6, 1.8])),
            )  # fmt: skip
    sampler = stand_in()
    sampler.vocab = vocab
    got = sampler.sample(fake_device.asarray(logits), draws)
    wanted = reference_draws(logits, draws)
    assert got.tokens.tolist() == wanted.tokens.tolist()
    assert got.logprobs is not None and wanted.logprobs is not None
    asked = [i for i, d in enumerate(draws) if d.logprobs >= 0]  # the others' are not read
    np.testing.assert_allclose(got.logprobs[asked], wanted.logprobs[asked], atol=1e-5)
    assert got.top_tokens is not None and wanted.top_tokens is not None
    asked = [i for i, d in enumerate(draws) if d.logprobs > 0]
    for i in asked:
        n = draws[i].logprobs
        assert got.top_tokens[i, :n].tolist() == wanted.top_tokens[i, :n].tolist()
    assert wanted.top_tokens[asked[0]].size == 20
    # Ten equal maxima: ranked by id; a greedy draw takes the first.
    ties = [i for i, d in enumerate(draws) if d.row == 3 and d.logprobs == 20]
    assert wanted.top_tokens[ties[0], :10].tolist() == list(range(50, 60))


def test_penalties_are_the_host_samplers() -> None:
    """Greedy draws with penalties take the token the host sampler takes."""
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((6, 80)).astype(np.float32)
    for case in range(60):
        params = SamplingParams(
            temperature=0, presence_penalty=float(rng.uniform(-2, 2)),
            frequency_penalty=float(rng.uniform(-2, 2)),
            repetition_penalty=float(rng.choice([1.0, 0.5, 1.3, 3.0])),
        )  # fmt: skip
        history = rng.integers(0, 90, 30).tolist()  # ids past the vocabulary too
        host = Draw(case % 6, params, np.random.default_rng([case, 0]), history,
                    TokenHistory(history, 10))  # fmt: skip
        (expected,) = choose_tokens(logits, [host])
        assert tokens(logits, [device_draw(host)]) == [expected], case


def test_packed_parameters() -> None:
    penalised = draw(repetition_penalty=1.5, seen=[3, 70, 9, 3], output_counts=[0, 4, 2, 5])
    packed, pairs = pack_draws(
        [draw(seed=2**64 - 3, top_k=2**40, temperature=0.5, position=9), penalised], vocab=50
    )
    assert packed.dtype == np.int32
    assert packed.view(np.uint32)[0, 2:4].tolist() == [2**32 - 3, 2**32 - 1]
    assert packed[0, 1] == 0  # top_k past int32: all tokens
    assert packed.view(np.float32)[0, 7] == 0.5
    assert packed[0, 5] == 9
    assert packed[0, 14] == 0  # no penalty: nothing seen
    assert packed.view(np.float32)[1, 12] == 1.5
    at, count = packed[1, 13:15]
    # 70 is past the vocabulary; 3 is penalised once
    assert pairs[at : at + count].tolist() == [[3, 0], [9, 2]]


def test_the_load_check_passes_and_the_forward_draws_on_the_device() -> None:
    gpu, reference = forwards("gqa")
    assert gpu.samples_on_device and gpu.sampling_failure is None
    for batch in steps():
        logits = reference(batch)
        draws = [draw(row=r, temperature=0.9, top_p=0.95, seed=r, position=len(batch),
                      logprobs=2) for r in range(len(batch))]  # fmt: skip
        draws.append(dataclasses.replace(draws[0], temperature=0.0, stream=1))
        launched = fake_device.state.graph_launches
        got = gpu.sample(batch, draws)
        expected = reference_draws(logits, draws)
        assert got.tokens.tolist() == expected.tokens.tolist()
        np.testing.assert_allclose(got.logprobs, expected.logprobs, atol=1e-4)
        decode = all(len(s.token_ids) == 1 for s in batch)
        assert fake_device.state.graph_launches - launched == decode  # the graph, then draws


def _wrong_kernel(grid: Any, *args: Any) -> None:
    out = args[-2]
    out[: grid[0]] = 1  # token 1 whatever the logits


def test_a_sampler_that_disagrees_at_load_is_not_used(monkeypatch, caplog) -> None:
    monkeypatch.setitem(fake_device._KERNELS, "sample_rows", _wrong_kernel)
    monkeypatch.setattr(
        _tiny_lm, "array_module", lambda device: fake_device if device == "gpu" else np
    )
    model = TinyLM(num_kv_blocks=40, block_size=BLOCK, max_model_len=64, max_num_seqs=4,
                   device="gpu")  # fmt: skip
    with caplog.at_level(logging.WARNING, "trioserve.models"):
        model.load()
    assert model.gpu is not None and model.greedy_on_device and not model.sampling_on_device
    assert model.gpu.sampling_failure is not None
    assert model.gpu.sampling_failure.startswith("tokens [1, 1,")
    assert "device sampler not used" in caplog.text


def test_the_check_draws_cover_every_rule() -> None:
    logits, draws = check_draws(64)
    assert logits.shape == (8, 64)
    assert {d.temperature == 0 or d.top_k == 1 for d in draws} == {True, False}
    assert all(any(getattr(d, rule) != value for d in draws)
               for rule, value in [("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)])  # fmt: skip
    assert {d.logprobs for d in draws} == {-1, 0, 5, 20}


class CountingSteps(TinyLM):
    """tiny_lm on the stand-in device, telling which step each engine step took."""

    kinds: list[str]

    def step(self, batch: Any) -> Any:
        self.kinds.append("logits")
        return super().step(batch)

    def step_greedy(self, batch: Any) -> Any:
        self.kinds.append("tokens")
        return super().step_greedy(batch)

    def step_sample(self, batch: Any, draws: Any) -> Any:
        self.kinds.append("draws")
        return super().step_sample(batch, draws)


async def _text(runner: GenerativeRunner, prompt: str, **params: Any) -> tuple[str, Any]:
    request = GenerationRequest(
        "r", prompt, SamplingParams(**params), arrival_time=trio.current_time()
    )
    texts, logprobs = [], []
    async with runner.generate(request) as chunks:
        async for chunk in chunks:
            texts.append(chunk.text)
            logprobs.append(chunk.logprobs)
    return "".join(texts), logprobs


async def test_the_engine_draws_on_the_device(nursery, autojump_clock, monkeypatch) -> None:
    monkeypatch.setattr(
        _tiny_lm, "array_module", lambda device: fake_device if device == "gpu" else np
    )
    model = CountingSteps(num_kv_blocks=40, block_size=BLOCK, max_model_len=64,
                          max_num_seqs=4, device="gpu")  # fmt: skip
    model.kinds = []
    model.load()
    runner = GenerativeRunner(model, "1")
    await nursery.start(runner.run)
    sampled = {"max_tokens": 6, "temperature": 0.8, "top_p": 0.9, "seed": 4}
    first, _ = await _text(runner, "hi", **sampled)
    assert model.kinds == ["draws"] * 6
    again, _ = await _text(runner, "hi", **sampled)
    assert again == first  # seeded: the same tokens
    model.kinds.clear()
    greedy, _ = await _text(runner, "hi", max_tokens=3, temperature=0)
    text, logprobs = await _text(runner, "hi", max_tokens=3, temperature=0, logprobs=2)
    assert text == greedy
    assert model.kinds == ["tokens"] * 3 + ["draws"] * 3  # logprobs: drawn on the device
    (entry,) = logprobs[0]
    assert entry.token_id == ord(greedy[0]) and len(entry.top) == 2
    assert entry.top[0][0] == entry.token_id and entry.logprob == pytest.approx(entry.top[0][1])
    model.kinds.clear()
    await _text(runner, "hi", max_tokens=2, temperature=0.8, repetition_penalty=1.3)
    assert model.kinds == ["draws"] * 2  # penalties too
    model.gpu.sampling_failure = "a failed check"  # as a load check that failed leaves it
    model.kinds.clear()
    await _text(runner, "hi", max_tokens=2, temperature=0.8)
    assert model.kinds == ["logits"] * 2  # the host samples


def test_a_draw_needs_a_batch_row() -> None:
    gpu, _ = forwards("gqa")
    batch = [StepSequence([1, 2], 0, [0])]
    got = gpu.sample(batch, [])
    assert got.tokens.tolist() == []


@on_a_device
def test_on_a_device_the_kernel_draws_what_the_reference_draws() -> None:
    """The CUDA kernel itself: its forward's load check passed, its tokens and logprobs
    on a 32,000-token vocabulary are the reference's, its draws follow the softmax."""
    import cupy

    gpu, _ = forwards("gqa", xp=cupy)
    assert gpu.sampling_failure is None
    rng = np.random.default_rng(12)
    vocab = 32_000
    logits = (rng.standard_normal((16, vocab)) * 3).astype(np.float32)
    draws = [
        draw(row=i % 16, temperature=[0.0, 0.8, 1.0, 1.3][i % 4], top_k=[0, 50][i % 2],
             top_p=[1.0, 0.9, 0.95][i % 3], min_p=0.05 if i % 5 == 0 else 0.0,
             seed=i * 7919, stream=i % 2, position=i, logprobs=[-1, 3][i % 2])
        for i in range(200)
    ]  # fmt: skip
    sampler = DeviceSampler(cupy, gpu.kernels, gpu.stream, vocab)
    got = sampler.sample(cupy.asarray(logits), draws)
    wanted = reference_draws(logits, draws)
    assert (np.asarray(got.tokens) != wanted.tokens).sum() <= 1  # a near tie may go either way
    asked = [i for i, d in enumerate(draws) if d.logprobs >= 0]
    assert got.logprobs is not None and wanted.logprobs is not None
    np.testing.assert_allclose(got.logprobs[asked], wanted.logprobs[asked], atol=1e-3)
    sampler.vocab = LOGITS.shape[1]
    many = [draw(temperature=0.8, seed=5, position=p) for p in range(20_000)]
    observed = np.bincount(sampler.sample(cupy.asarray(LOGITS), many).tokens, minlength=10)
    assert _chi_square(observed, _softmax(LOGITS[0].astype(np.float64) / 0.8)) < 27.88
