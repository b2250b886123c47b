"""Tests for specresearch.core.sampling (logits -> probabilities) and its exact twin specresearch.exact.sampling."""

import itertools
import math
import re

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from specresearch.config import PRESETS, SamplingConfig
from specresearch.core.sampling import (
    LOGITS_ERRORS,
    apply_temperature,
    check_logits,
    epsilon_filter,
    logits_flags,
    logits_to_probs,
    sample_tokens,
    top_k_filter,
    top_p_filter,
)


def _logits(*probs, dtype=torch.float64):
    return torch.tensor(probs, dtype=dtype).log()


def _kept(filtered):
    return set(torch.nonzero(torch.isfinite(filtered)).flatten().tolist())


# --- SamplingConfig validation -------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"epsilon": 1.0}, "epsilon"),
        ({"epsilon": -0.01}, "epsilon"),
        ({"epsilon": float("nan")}, "epsilon"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingConfig(**kwargs)


def test_config_is_frozen_and_presets():
    config = SamplingConfig(top_p=0.9)
    with pytest.raises(Exception):
        config.top_p = 0.5
    assert SamplingConfig.from_name("greedy").greedy
    assert not SamplingConfig.from_name("default").greedy
    assert SamplingConfig(top_k=1).greedy
    assert SamplingConfig.from_name("nucleus") == SamplingConfig(top_p=0.9)
    assert set(PRESETS) >= {"greedy", "default", "nucleus"}
    with pytest.raises(ValueError, match="name"):
        SamplingConfig.from_name("no-such-preset")


@pytest.mark.parametrize(
    "bad, message",
    [
        (torch.tensor([0.0, float("nan")]), "NaN"),
        (torch.tensor([[9.0, 0.0], [1.0, float("nan")]]), "NaN"),  # behind a larger maximum of another row
        (torch.tensor([[float("nan"), -math.inf], [0.0, 1.0]]).half(), "NaN"),
        (torch.tensor([[-math.inf, 0.0], [-math.inf, math.inf]]), r"\+inf"),
        (torch.tensor([0.0, float("inf")]), r"\+inf"),
        (torch.tensor([[0.0, 1.0], [-math.inf, -math.inf]]), "every entry is -inf"),
        (torch.tensor([1, 2]), "floating"),
        (torch.zeros(2, 0), "V >= 1"),
    ],
)
def test_bad_logits_raise(bad, message):
    with pytest.raises(ValueError, match=message):
        logits_to_probs(bad, SamplingConfig())


def test_logits_flags_name_the_error_the_logits_deserve():
    """On 2,000 seeded random [3, 4] logits mixing finite values, NaN, +inf and -inf (float32 and float16): the first
    flag ``logits_flags`` sets, and the error ``check_logits`` raises (it reads the flags), is the first of NaN
    anywhere, +inf anywhere, a row entirely -inf, found by a plain loop over the values; neither fires otherwise."""
    generator = torch.Generator().manual_seed(0)
    values = torch.tensor([0.0, 1.5, -2.0, float("nan"), math.inf, -math.inf])
    weights = torch.tensor([2.0, 2.0, 2.0, 0.3, 0.3, 6.0])
    met = set()
    for i in range(2000):
        logits = values[torch.multinomial(weights, 12, replacement=True, generator=generator)].view(3, 4)
        logits = logits.half() if i % 2 else logits
        rows = logits.float().tolist()
        reasons = [any(math.isnan(x) for row in rows for x in row), any(x == math.inf for row in rows for x in row),
                   any(all(x == -math.inf for x in row) for row in rows)]
        expected = reasons.index(True) if any(reasons) else None
        met.add(expected)
        flags = logits_flags(logits).tolist()
        assert (flags.index(1) if any(flags) else None) == expected, (logits, flags)
        if expected is None:
            check_logits(logits)
        else:
            with pytest.raises(ValueError, match=re.escape(LOGITS_ERRORS[expected])):
                check_logits(logits)
    assert met == {None, 0, 1, 2}  # every case met


def test_config_type_checked():
    with pytest.raises(ValueError, match="config"):
        logits_to_probs(torch.zeros(3), {"temperature": 1.0})


# --- logits_to_probs -----------------------------------------------------------------------------


def test_default_is_softmax_and_dtype_kept():
    logits = torch.randn(3, 4, 7, generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.float64):
        out = logits_to_probs(logits.to(dtype), SamplingConfig())
        assert out.dtype == dtype and out.shape == (3, 4, 7)
        torch.testing.assert_close(out, torch.softmax(logits.to(dtype), -1))
    assert logits_to_probs(logits.half(), SamplingConfig()).dtype == torch.float32


def test_masked_tokens_stay_zero():
    logits = torch.tensor([1.0, -math.inf, 0.5, -math.inf])
    for config in (SamplingConfig(), SamplingConfig(temperature=2.0), SamplingConfig(top_p=0.99)):
        probs = logits_to_probs(logits, config)
        assert probs[1] == 0 and probs[3] == 0


def test_temperature_zero_is_first_argmax_one_hot():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, -1.0, 2.0, 5.0]])
    probs = logits_to_probs(logits, SamplingConfig(temperature=0.0))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    # filters cannot change a greedy config
    assert torch.equal(logits_to_probs(logits, SamplingConfig(temperature=0.0, top_p=0.1, top_k=3)), probs)


def test_small_temperature_tends_to_greedy():
    logits = torch.randn(50, 10, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    probs = logits_to_probs(logits, SamplingConfig(temperature=1e-3))
    greedy = logits_to_probs(logits, SamplingConfig(temperature=0.0))
    assert torch.equal(probs.argmax(-1), greedy.argmax(-1))
    # softmax(l / T) puts >= 1 / (1 + (V - 1) exp(-gap / T)) on the argmax, gap = best - second best logit
    top2 = logits.topk(2).values
    bound = 1 / (1 + 9 * torch.exp(-(top2[:, 0] - top2[:, 1]) / 1e-3))
    assert (probs.max(-1).values >= bound - 1e-12).all()
    assert (probs.max(-1).values > 0.99).all()


def test_temperature_formula():
    logits = torch.tensor([2.0, 1.0, -1.0], dtype=torch.float64)
    for t in (0.5, 1.0, 1.5):
        got = logits_to_probs(logits, SamplingConfig(temperature=t))
        torch.testing.assert_close(got, torch.softmax(logits / t, -1))
    torch.testing.assert_close(apply_temperature(logits, 2.0), logits / 2.0)


# --- top-k ---------------------------------------------------------------------------------------


def test_top_k_keeps_exactly_k_lower_id_at_ties():
    logits = _logits(0.4, 0.2, 0.2, 0.2)
    assert _kept(top_k_filter(logits, 2)) == {0, 1}
    assert _kept(top_k_filter(logits, 3)) == {0, 1, 2}
    # transformers keeps every token tied with the k-th: that is why we do not reuse it
    assert _kept(TopKLogitsWarper(2)(None, logits[None])[0]) == {0, 1, 2, 3}
    assert _kept(top_k_filter(logits, 10)) == {0, 1, 2, 3}


def test_top_k_matches_transformers_without_ties():
    logits = torch.randn(20, 30, generator=torch.Generator().manual_seed(2))
    for k in (1, 5, 29):
        assert torch.equal(top_k_filter(logits, k), TopKLogitsWarper(k)(None, logits))


def test_top_k_renormalises():
    probs = logits_to_probs(_logits(0.5, 0.3, 0.15, 0.05), SamplingConfig(top_k=2))
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0], dtype=torch.float64))


# --- top-p ---------------------------------------------------------------------------------------


def _smallest_set_brute_force(probs, top_p):
    """All minimum-size subsets with mass >= top_p (exact on dyadic probabilities)."""
    v = len(probs)
    for size in range(1, v + 1):
        sets = [set(c) for c in itertools.combinations(range(v), size) if sum(probs[i] for i in c) >= top_p]
        if sets:
            return sets
    raise AssertionError("unreachable: the full set has mass 1")


@pytest.mark.parametrize(
    "probs, top_p, expected",
    [
        ((0.5, 0.25, 0.125, 0.125), 0.5, {0}),  # mass exactly p: one token suffices
        ((0.5, 0.25, 0.125, 0.125), 0.5 + 2**-20, {0, 1}),
        ((0.5, 0.25, 0.125, 0.125), 0.75, {0, 1}),
        ((0.5, 0.25, 0.125, 0.125), 0.8, {0, 1, 2}),  # tie between 2 and 3: lower id kept
        ((0.125, 0.125, 0.25, 0.5), 0.8, {3, 2, 0}),
        ((0.25, 0.25, 0.25, 0.25), 0.5, {0, 1}),
        ((0.25, 0.25, 0.25, 0.25), 1.0, {0, 1, 2, 3}),
        ((0.5, 0.25, 0.25, 0.0), 1.0, {0, 1, 2}),  # top_p = 1 is the identity (log 0 = -inf stays)
        ((1.0, 0.0, 0.0, 0.0), 0.3, {0}),
    ],
)
def test_top_p_smallest_set(probs, top_p, expected):
    kept = _kept(top_p_filter(torch.tensor(probs, dtype=torch.float64).log(), top_p))
    assert kept == expected
    if top_p < 1:
        assert kept in _smallest_set_brute_force(probs, top_p)


def test_top_p_is_a_smallest_set_on_random_dyadic_rows():
    """Brute force on exactly representable probabilities (multiples of 1/32): no rounding at boundaries."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(200):
        counts = torch.multinomial(torch.ones(5), 32, replacement=True, generator=gen).bincount(minlength=5)
        probs = [c / 32 for c in counts.tolist()]
        top_p = int(torch.randint(1, 33, (1,), generator=gen)) / 32
        kept = _kept(top_p_filter(torch.tensor(probs, dtype=torch.float64).log(), top_p))
        if top_p < 1:
            assert kept in _smallest_set_brute_force(probs, top_p), (probs, top_p, kept)
        # among tied probabilities, the kept ones are the lowest ids
        for i, j in itertools.combinations(range(5), 2):
            if probs[i] == probs[j] and j in kept:
                assert i in kept


def test_top_p_ties_differ_from_transformers():
    logits = _logits(0.5, 0.2, 0.2, 0.1)
    assert _kept(top_p_filter(logits, 0.7)) == {0, 1}
    hf = _kept(TopPLogitsWarper(0.7)(None, logits[None])[0])
    assert len(hf) == 2 and 0 in hf  # same size; which tied token it keeps is up to torch.sort


def test_top_p_matches_transformers_without_ties():
    logits = torch.randn(40, 25, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    for top_p in (0.1, 0.5, 0.9, 0.99):
        assert torch.equal(top_p_filter(logits, top_p), TopPLogitsWarper(top_p)(None, logits))


def test_top_p_batched_shapes():
    logits = torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(5))
    out = top_p_filter(logits, 0.6)
    for idx in itertools.product(range(2), range(3)):
        assert torch.equal(out[idx], top_p_filter(logits[idx], 0.6))


# --- epsilon -------------------------------------------------------------------------------------


def test_epsilon_drops_below_threshold_but_never_the_argmax():
    logits = _logits(0.5, 0.3, 0.15, 0.05)
    assert _kept(epsilon_filter(logits, 0.1)) == {0, 1, 2}
    assert _kept(epsilon_filter(logits, 0.15)) == {0, 1, 2}  # prob == epsilon is kept
    assert _kept(epsilon_filter(logits, 0.9)) == {0}
    assert torch.equal(epsilon_filter(logits, 0.0), logits)


def test_chain_order_temperature_then_filters():
    logits = _logits(0.4, 0.3, 0.2, 0.1)
    config = SamplingConfig(temperature=0.5, top_k=3, top_p=0.8, epsilon=0.2)
    # T = 0.5 squares probabilities: (16, 9, 4, 1)/30; top-3 -> (16, 9, 4)/29; top-p 0.8 -> {0, 1}
    # (16/29 < 0.8 <= 25/29); renormalised (16, 9)/25, both >= 0.2.
    expected = torch.tensor([16 / 25, 9 / 25, 0.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(logits_to_probs(logits, config), expected)


# --- exact twins (specresearch.exact.sampling) ---------------------------------------------------

import random  # noqa: E402
from fractions import Fraction  # noqa: E402

from specresearch import exact  # noqa: E402
from specresearch.exact.sampling import (
    exact_epsilon,
    exact_temperature,
    exact_top_k,
    exact_top_p,
    exact_transform,
    transformed_model,
)

F = Fraction
TWIN_CONFIGS = [
    SamplingConfig(),
    SamplingConfig(temperature=0.0),
    SamplingConfig(temperature=0.5),
    SamplingConfig(temperature=F(1, 3)),
    SamplingConfig(top_k=2),
    SamplingConfig(top_p=0.55),
    SamplingConfig(top_p=0.9, temperature=0.5),
    SamplingConfig(epsilon=0.15),
    SamplingConfig(temperature=0.5, top_k=4, top_p=0.8, epsilon=0.07),
]


def test_exact_transforms_by_hand():
    row = (F(1, 2), F(1, 4), F(1, 8), F(1, 8))
    assert exact_temperature(row, 0) == (1, 0, 0, 0)
    assert exact_temperature(row, 1) == row
    assert exact_temperature(row, 0.5) == (F(16, 22), F(4, 22), F(1, 22), F(1, 22))  # squares, renormalised
    assert exact_top_k(row, 3) == (F(4, 7), F(2, 7), F(1, 7), 0)  # tie 2/3: lower id kept
    assert exact_top_p(row, 0.75) == (F(2, 3), F(1, 3), 0, 0)  # mass exactly 3/4 suffices
    assert exact_top_p(row, 0.8) == (F(4, 7), F(2, 7), F(1, 7), 0)
    assert exact_epsilon(row, 0.2) == (F(2, 3), F(1, 3), 0, 0)
    assert exact_epsilon(row, 0.9) == (1, 0, 0, 0)
    with pytest.raises(ValueError, match="temperature"):
        exact_temperature(row, 1.5)
    with pytest.raises(ValueError, match="exact rationals"):
        exact_top_k((0.5, 0.5), 1)


def _near_boundary(row, config):
    """True if a top-p cumulative mass or an epsilon comparison is within 1e-9 of its threshold: float
    rounding may then legitimately fall on either side, so the twin comparison is skipped."""
    from specresearch.exact.sampling import exact_param

    staged = exact_transform(row, SamplingConfig(temperature=config.temperature, top_k=config.top_k))
    if config.top_p is not None:
        p, mass = exact_param(config.top_p, "top_p"), F(0)
        for x in sorted(staged, reverse=True):
            mass += x
            if abs(mass - p) < 1e-9:
                return True
        staged = exact_top_p(staged, config.top_p)
    if config.epsilon is not None:
        eps = exact_param(config.epsilon, "epsilon")
        return any(abs(x - eps) < 1e-9 for x in staged)
    return False


def test_torch_transforms_match_exact_twins():
    """logits_to_probs(log(row)) in float64 equals exact_transform(row) to 1e-12 on random rational rows."""
    model = exact.random_rational_model(6, random.Random(0), zero_prob=0.2, denominator=24)
    checked = 0
    for prefix in itertools.product(range(6), repeat=2):
        row = model(prefix)
        logits = torch.tensor([float(x) for x in row], dtype=torch.float64).log()
        for config in TWIN_CONFIGS:
            if _near_boundary(row, config):
                continue
            want = torch.tensor([float(x) for x in exact_transform(row, config)], dtype=torch.float64)
            torch.testing.assert_close(logits_to_probs(logits, config), want, rtol=0, atol=1e-12)
            checked += 1
    assert checked > 0.9 * 36 * len(TWIN_CONFIGS)


@pytest.mark.parametrize("config", TWIN_CONFIGS, ids=str)
@pytest.mark.parametrize("method", ["token", "block"])
def test_speculative_decoding_is_lossless_for_the_transformed_target(config, method):
    """Exact: with target and draft transformed by the same config, the speculative loop's law of the
    first 3 tokens equals the transformed target's law (V = 3, gamma = 2)."""
    rng = random.Random(f"{config}/{method}")
    target = exact.random_rational_model(3, rng, zero_prob=0.2)
    draft = exact.random_rational_model(3, rng, zero_prob=0.2)
    t_target, t_draft = transformed_model(target, config), transformed_model(draft, config)
    spec = exact.speculative_distribution(t_target, t_draft, 2, method, 3)
    want = exact.target_distribution(t_target, 3)
    assert {k: v for k, v in spec.items() if v} == want
    assert sum(want.values()) == 1


def test_transform_changes_the_law_so_losslessness_is_not_vacuous():
    target = exact.random_rational_model(3, random.Random(7), zero_prob=0.0)
    plain = exact.target_distribution(target, 2)
    for config in TWIN_CONFIGS[1:]:
        assert exact.target_distribution(transformed_model(target, config), 2) != plain


def test_greedy_config_gives_the_greedy_target_path():
    target = exact.random_rational_model(4, random.Random(8))
    draft = exact.random_rational_model(4, random.Random(9))
    greedy = SamplingConfig.from_name("greedy")
    law = exact.target_distribution(transformed_model(target, greedy), 3)
    assert law == exact.target_distribution(target, 3, greedy=True)
    t_target, t_draft = transformed_model(target, greedy), transformed_model(draft, greedy)
    spec = exact.speculative_distribution(t_target, t_draft, 2, "token", 3)
    assert {k: v for k, v in spec.items() if v} == law


# --- sample_tokens -------------------------------------------------------------------------------


def test_sample_tokens_frequencies_and_zero_probabilities():
    """20,000 rows of one law with zeros and a tiny mass, float32 as the engine passes it. Pearson
    chi-square at false-positive rate 1e-4 (fixed seed: the outcome is deterministic)."""
    from scipy.stats import chi2

    probs = torch.tensor([0.0, 0.3, 0.0, 0.2, 1e-3, 0.499, 0.0])
    n = 20000
    tokens = sample_tokens(probs.expand(n, -1).contiguous(), torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=7).double()
    assert tokens.dtype == torch.int64 and (counts[probs == 0] == 0).all()
    support = probs > 0
    expected = n * probs[support].double()
    assert ((counts[support] - expected) ** 2 / expected).sum() < chi2.isf(1e-4, int(support.sum()) - 1)


def test_sample_tokens_per_row_generators_and_common_random_numbers():
    probs = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(1)), -1)
    rows = [torch.Generator().manual_seed(s) for s in (5, 6, 7)]
    together = sample_tokens(probs, rows)
    alone = torch.cat([sample_tokens(probs[b : b + 1], torch.Generator().manual_seed(s)) for b, s in enumerate((5, 6, 7))])
    assert torch.equal(together, alone)
    # one uniform per row whatever the law: the same stream gives the same token of a shifted law's cdf
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    sample_tokens(probs, g1), sample_tokens(torch.softmax(5 * torch.randn(3, 50), -1), g2)
    assert torch.equal(g1.get_state(), g2.get_state())


def test_sample_tokens_one_hot_and_bad_input():
    one_hot = torch.zeros(4, 49152)
    one_hot[torch.arange(4), torch.tensor([0, 7, 49151, 300])] = 1.0
    assert sample_tokens(one_hot, torch.Generator().manual_seed(0)).tolist() == [0, 7, 49151, 300]
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        sample_tokens(torch.ones(5) / 5)
    with pytest.raises(ValueError, match="one per row"):
        sample_tokens(torch.ones(2, 5) / 5, [torch.Generator()])
