"""Sampling: greedy, temperature, top-k, top-p, and repeatability of seeded draws."""

import numpy as np
import pytest

from trioserve.scheduler import SamplingParams
from trioserve.scheduler._sampling import is_greedy, sample_generator, sample_rows

LOGITS = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))  # probabilities at temperature 1


def _draws(params: SamplingParams, count=4000, seed=0):
    uniforms = np.random.default_rng(seed).random(count)
    rows = np.repeat(LOGITS, count, axis=0)
    return np.bincount(sample_rows(rows, [params] * count, uniforms), minlength=4) / count


def test_greedy_settings():
    assert is_greedy(SamplingParams(temperature=0)) and is_greedy(SamplingParams(top_k=1))
    assert not is_greedy(SamplingParams(temperature=0.5))


def test_temperature_one_follows_the_softmax():
    np.testing.assert_allclose(_draws(SamplingParams()), [0.5, 0.3, 0.15, 0.05], atol=0.03)


def test_low_temperature_sharpens():
    assert _draws(SamplingParams(temperature=0.25))[0] > 0.85


def test_top_k_keeps_the_k_most_likely():
    frequencies = _draws(SamplingParams(top_k=2))
    assert frequencies[2:].sum() == 0
    np.testing.assert_allclose(frequencies[:2], [0.625, 0.375], atol=0.03)


@pytest.mark.parametrize(("top_p", "kept"), [(0.4, 1), (0.55, 2), (0.7, 2), (0.9, 3), (0.99, 4)])
def test_top_p_keeps_the_shortest_head_reaching_p(top_p, kept):
    frequencies = _draws(SamplingParams(top_p=top_p))
    assert (frequencies > 0).sum() == kept


def test_a_rows_draw_does_not_depend_on_its_neighbours():
    params = SamplingParams(temperature=0.7, seed=3)
    generator = sample_generator(params, 0, np.random.default_rng())
    uniform = generator.random()
    alone = sample_rows(LOGITS, [params], np.array([uniform]))
    beside = sample_rows(
        np.concatenate([LOGITS[:, ::-1], LOGITS, LOGITS]),
        [SamplingParams(top_p=0.5), params, SamplingParams(top_k=2)],
        np.array([0.9, uniform, 0.1]),
    )
    assert beside[1] == alone[0]
    again = sample_generator(params, 0, np.random.default_rng()).random()
    assert again == uniform  # seeded: the same draw whatever the engine's generator
