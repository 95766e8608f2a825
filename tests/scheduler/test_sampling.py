"""Sampling: penalties, greedy, temperature, min-p, top-k, top-p, and repeatability of
seeded draws."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trioserve.scheduler import SamplingParams
from trioserve.scheduler._sampling import (
    Draw,
    TokenHistory,
    _penalised,
    choose_tokens,
    is_greedy,
    sample_generator,
    sample_rows,
)

LOGITS = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))  # probabilities at temperature 1


def _draws(params: SamplingParams, count=4000, seed=0):
    uniforms = np.random.default_rng(seed).random(count)
    rows = np.repeat(LOGITS, count, axis=0)
    return np.bincount(sample_rows(rows, [params] * count, uniforms), minlength=4) / count


def test_greedy_settings():
    assert is_greedy(SamplingParams(temperature=0)) and is_greedy(SamplingParams(top_k=1))
    assert is_greedy(SamplingParams(temperature=1e-6))  # below vLLM's epsilon
    assert not is_greedy(SamplingParams(temperature=0.5))


# Prompt [1], output [0, 0, 2]: token 0 is twice in the output, 2 once, 1 in the prompt.
PENALTY_LOGITS = [2.0, 1.0, -1.0, 0.5]
HISTORY = [1, 0, 0, 2]


@pytest.mark.parametrize(
    ("params", "penalised"),
    [
        # Repetition: seen tokens' positive logits divided, negative ones multiplied.
        (SamplingParams(repetition_penalty=4), [0.5, 0.25, -4.0, 0.5]),
        (SamplingParams(repetition_penalty=0.5), [4.0, 2.0, -0.5, 0.5]),
        # Frequency: once per occurrence in the output (the prompt's tokens are not counted).
        (SamplingParams(frequency_penalty=1.0), [0.0, 1.0, -2.0, 0.5]),
        # Presence: once for a token that is in the output at all.
        (SamplingParams(presence_penalty=1.75), [0.25, 1.0, -2.75, 0.5]),
        (SamplingParams(presence_penalty=-2.0), [4.0, 1.0, 1.0, 0.5]),  # negative: favoured
        (
            SamplingParams(repetition_penalty=2, frequency_penalty=0.5, presence_penalty=0.25),
            [1.0 - 1.0 - 0.25, 0.5, -2.0 - 0.5 - 0.25, 0.5],
        ),
    ],
)
def test_penalties_as_vllm_applies_them(params, penalised):
    draw = Draw(0, params, np.random.default_rng(0), HISTORY, TokenHistory(HISTORY, 1))
    rows = _penalised(np.array([PENALTY_LOGITS]), [draw])
    np.testing.assert_allclose(rows, [penalised])


def test_token_ids_beyond_the_logits_are_not_penalised():
    ids = [9, -1, 9]
    draw = Draw(0, SamplingParams(repetition_penalty=2), np.random.default_rng(0), ids,
                TokenHistory(ids, 1))  # fmt: skip
    np.testing.assert_allclose(_penalised(np.array([PENALTY_LOGITS]), [draw]), [PENALTY_LOGITS])


def test_penalties_leave_the_models_logits_alone():
    logits = np.array([PENALTY_LOGITS])
    params = SamplingParams(frequency_penalty=2.0, temperature=0)
    draws = [Draw(0, params, np.random.default_rng(0), HISTORY, TokenHistory(HISTORY, 1))]
    assert choose_tokens(logits, draws) == [1]  # 2.0 - 2 * 2 < 1.0
    assert logits.tolist() == [PENALTY_LOGITS]  # logprobs read these, unpenalised


def test_penalties_share_a_row_with_an_unpenalised_draw():
    """Two samples of one step read the same row (a request's forks); each gets its own."""
    logits = np.array([PENALTY_LOGITS])
    plain = Draw(0, SamplingParams(temperature=0), np.random.default_rng(0), [0, 0],
                 TokenHistory([0, 0], 1))  # fmt: skip
    penalised = plain._replace(params=SamplingParams(temperature=0, frequency_penalty=2.0))
    assert choose_tokens(logits, [plain, penalised]) == [0, 1]


@given(
    st.lists(st.integers(-2, 40), min_size=1, max_size=30),
    st.lists(st.integers(-2, 40), max_size=60),
)
def test_a_history_kept_up_is_the_history_counted_afresh(prompt, output):
    kept = TokenHistory(prompt, len(prompt))
    held = []
    for token in output:
        ids_now, counts_now = kept.arrays()
        held.append(
            (ids_now, counts_now, sorted(zip(ids_now.tolist(), counts_now.tolist(), strict=True)))
        )
        kept.add(token)
    ids = np.array(prompt + output)
    expected = {t: int((ids[len(prompt) :] == t).sum()) for t in set(ids.tolist())}
    assert dict(zip(*(a.tolist() for a in kept.arrays()), strict=True)) == expected
    for vocab in (1, 20, 50):
        seen, counts = kept.vocabulary_counts(vocab)
        assert seen.tolist() == [t in expected for t in range(vocab)]
        assert counts.tolist() == [expected.get(t, 0) for t in range(vocab)]
    for ids_then, counts_then, pairs in held:  # what earlier draws were given stays
        assert sorted(zip(ids_then.tolist(), counts_then.tolist(), strict=True)) == pairs


def test_min_p_drops_tokens_below_its_share_of_the_likeliest():
    # Probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.5 keeps those >= 0.25, renormalised.
    frequencies = _draws(SamplingParams(min_p=0.5))
    assert frequencies[2:].sum() == 0
    np.testing.assert_allclose(frequencies[:2], [0.625, 0.375], atol=0.03)


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
