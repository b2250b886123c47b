"""Closed forms of specresearch.exact.theory (Leviathan et al. 2023, Sec. 3) against sympy and exact enumeration."""

from fractions import Fraction

import pytest
import sympy as sp

from specresearch.exact.single import block_efficiency, two_symbol_example
from specresearch.exact.symbolic import ALPHA, COST, GAMMA
from specresearch.exact.theory import (
    acceptance_rate,
    expected_tokens,
    optimal_gamma,
    walltime_improvement,
)


def test_expected_tokens_two_symbol_example():
    # the two-symbol post: alpha = 2/3, gamma = 2 -> 19/9 tokens per target call (10/9 accepted drafts + 1).
    target, draft = two_symbol_example()
    alpha = acceptance_rate(target, draft)
    assert alpha == Fraction(2, 3)
    assert expected_tokens(alpha, 2) == Fraction(19, 9)


@pytest.mark.parametrize("alpha", [Fraction(0), Fraction(1, 7), Fraction(1, 2), Fraction(9, 10)])
@pytest.mark.parametrize("gamma", [1, 2, 5, 10])
def test_expected_tokens_matches_sympy_closed_form(alpha, gamma):
    closed = ((1 - ALPHA ** (GAMMA + 1)) / (1 - ALPHA)).subs({ALPHA: sp.Rational(alpha.numerator, alpha.denominator), GAMMA: gamma})
    assert expected_tokens(alpha, gamma) == Fraction(str(closed))


def test_expected_tokens_limits():
    assert expected_tokens(1, 4) == 5  # every draft accepted
    assert expected_tokens(0, 4) == 1  # only the target's own token


def test_walltime_improvement_table_1_value():
    # Leviathan et al. Table 1 style: alpha = 0.8, gamma = 5, c = 0 -> 3.69x.
    assert round(float(walltime_improvement(0.8, 5, 0)), 2) == 3.69
    assert walltime_improvement(0.8, 5, 0) == Fraction(11529, 3125)


def test_walltime_improvement_matches_sympy():
    value = ((1 - ALPHA ** (GAMMA + 1)) / ((1 - ALPHA) * (GAMMA * COST + 1))).subs({ALPHA: sp.Rational(3, 5), GAMMA: 3, COST: sp.Rational(1, 10)})
    assert walltime_improvement(Fraction(3, 5), 3, Fraction(1, 10)) == Fraction(str(value))


@pytest.mark.parametrize("alpha,c", [(Fraction(9, 10), Fraction(1, 20)), (Fraction(1, 2), Fraction(1, 10)), (Fraction(3, 5), Fraction(0)), (Fraction(1, 5), Fraction(1, 2))])
def test_optimal_gamma_is_the_argmax(alpha, c):
    best = optimal_gamma(alpha, c, max_gamma=30)
    gains = {g: walltime_improvement(alpha, g, c) for g in range(1, 31)}
    assert gains[best] == max(gains.values())
    assert all(gains[g] < gains[best] for g in range(1, best))  # smallest maximiser


def test_optimal_gamma_grows_with_alpha():
    assert optimal_gamma(Fraction(1, 2), Fraction(1, 20)) < optimal_gamma(Fraction(9, 10), Fraction(1, 20))


def test_corollary_3_9_on_examples():
    assert walltime_improvement(Fraction(1, 2), 1, Fraction(1, 5)) == Fraction(3, 2) / Fraction(6, 5)


def test_expected_tokens_equals_exact_enumeration_of_token_verification():
    target, draft = (Fraction(1, 2), Fraction(1, 3), Fraction(1, 6)), (Fraction(1, 6), Fraction(1, 2), Fraction(1, 3))
    alpha = acceptance_rate(target, draft)
    for gamma in (1, 2, 3):
        assert block_efficiency(target, draft, gamma, "token") == expected_tokens(alpha, gamma)


def test_acceptance_rate_accepts_floats_and_sympy():
    assert acceptance_rate([0.25, 0.75], [sp.Rational(1, 2), sp.Rational(1, 2)]) == Fraction(3, 4)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: expected_tokens(Fraction(3, 2), 2), "alpha"),
        (lambda: expected_tokens(-0.1, 2), "alpha"),
        (lambda: expected_tokens(0.5, 0), "gamma"),
        (lambda: expected_tokens(0.5, 2.0), "gamma"),
        (lambda: expected_tokens(0.5, True), "gamma"),
        (lambda: expected_tokens(float("nan"), 2), "alpha"),
        (lambda: expected_tokens("0.5", 2), "alpha"),
        (lambda: walltime_improvement(0.5, 2, -1), "c"),
        (lambda: optimal_gamma(0.5, 0.1, max_gamma=0), "gamma"),
        (lambda: acceptance_rate([0.5, 0.6], [0.5, 0.5]), "target_probs"),
        (lambda: acceptance_rate([0.5, 0.5], [1.5, -0.5]), "draft_probs"),
        (lambda: acceptance_rate([0.5, 0.5], [1]), "same vocabulary"),
        (lambda: acceptance_rate([], []), "target_probs"),
    ],
)
def test_invalid_inputs_raise_value_error_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
