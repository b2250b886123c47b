"""The exact LP over all valid verifiers (specresearch.exact.lp; Sun et al. 2025, Thm 2): block verification
is feasible and attains its optimum, token verification is feasible and may be strictly below, invalid
verifiers are infeasible."""

import random
from fractions import Fraction

import pytest

from specresearch.exact.lp import (
    check_joint,
    check_verifier,
    compare_with_lp,
    continuation_law,
    optimal_verifier_lp,
    verifier_joint,
)
from specresearch.exact.single import (
    random_rational_model,
    target_distribution,
    two_symbol_example,
)


def _always_accept(ps, qs, xs):
    """Invalid: accept every draft, then sample the bonus token from the target."""
    return {(len(xs), t): prob for t, prob in enumerate(ps[len(xs)]) if prob}


def test_two_symbol_example_lp_equals_block_and_beats_token():
    target, draft = two_symbol_example()
    values = compare_with_lp(target, draft, 2)
    assert values == {"lp": Fraction(11, 9), "block": Fraction(11, 9), "token": Fraction(10, 9)}


@pytest.mark.parametrize("formulation", ["prefix", "coupling"])
def test_two_symbol_example_both_formulations(formulation):
    target, draft = two_symbol_example()
    assert optimal_verifier_lp(target, draft, 2, formulation=formulation).optimum == Fraction(11, 9)


def _random_instances(count=8, seed=11):
    rng = random.Random(seed)
    for _ in range(count):
        vocab, gamma = rng.choice([2, 3]), rng.choice([1, 2])
        yield random_rational_model(vocab, rng, zero_prob=0.1), random_rational_model(vocab, rng, zero_prob=0.1), gamma


@pytest.mark.parametrize("target,draft,gamma", list(_random_instances()))
def test_lp_optimum_equals_block_verification_on_random_instances(target, draft, gamma):
    values = compare_with_lp(target, draft, gamma)
    assert values["lp"] == values["block"]
    assert values["token"] <= values["lp"]
    assert optimal_verifier_lp(target, draft, gamma, formulation="coupling").optimum == values["lp"]


def test_token_strictly_below_the_optimum_on_generic_instances():
    # Without exact zeros and with gamma = 2, token verification is strictly suboptimal on each of these
    # seeded instances (at gamma = 1 the two verifiers coincide).
    rng = random.Random(11)
    for _ in range(4):
        vocab = rng.choice([2, 3])
        target, draft = (random_rational_model(vocab, rng, zero_prob=0.0) for _ in range(2))
        values = compare_with_lp(target, draft, 2)
        assert values["token"] < values["lp"] == values["block"]


def test_token_equals_block_at_gamma_one():
    for target, draft, _ in _random_instances(count=4, seed=7):
        values = compare_with_lp(target, draft, 1)
        assert values["token"] == values["block"] == values["lp"]


@pytest.mark.parametrize("method", ["block", "token"])
def test_valid_verifiers_are_feasible(method):
    target, draft = two_symbol_example()
    for t, d, g in [(target, draft, 2), *_random_instances(count=3, seed=5)]:
        check = check_verifier(t, d, g, method)
        assert check.feasible, check.violations


@pytest.mark.parametrize("method", [_always_accept, "greedy"])
def test_invalid_verifiers_are_infeasible(method):
    target, draft = two_symbol_example()
    check = check_verifier(target, draft, 2, method)
    assert not check.feasible
    assert any(v.startswith("(L)") for v in check.violations)


def test_always_accept_beats_the_optimum_only_because_it_is_invalid():
    target, draft = two_symbol_example()
    assert check_verifier(target, draft, 2, _always_accept).objective == 2 > Fraction(11, 9)


def test_check_joint_rejects_broken_couplings():
    target, draft = two_symbol_example()
    joint = verifier_joint(target, draft, 2, "block")
    (x, z), mass = next(iter(joint.items()))
    moved = dict(joint)
    moved[(x, z)] = mass / 2  # draft marginal of x no longer q(x)
    assert any("q(x)" in v for v in check_joint(target, draft, 2, moved).violations)
    wrong = dict(joint)
    wrong[((0, 0), (1, 1, 0))] = wrong.pop((x, z))  # z[:-1] is not a prefix of x
    assert any("not (prefix of x" in v for v in check_joint(target, draft, 2, wrong).violations)


def test_optimal_step_law_is_valid_and_attains_the_optimum():
    target, draft = two_symbol_example()
    result = optimal_verifier_lp(target, draft, 2)
    assert sum(result.step_law.values()) == 1
    assert sum(p * (len(z) - 1) for z, p in result.step_law.items()) == result.optimum
    law = continuation_law(result.step_law, lambda prefix: target, 2)
    assert {y: v for y, v in law.items() if v} == target_distribution(target, 3)


def test_continuation_of_a_single_target_token_is_the_target():
    target = (Fraction(1, 5), Fraction(4, 5))
    law = continuation_law({(0,): target[0], (1,): target[1]}, lambda prefix: target, 1)
    assert law == {(a, b): target[a] * target[b] for a in range(2) for b in range(2)}


@pytest.mark.parametrize("kwargs,match", [({"gamma": 0}, "gamma"), ({"gamma": 2, "formulation": "dual"}, "formulation")])
def test_invalid_arguments(kwargs, match):
    target, draft = two_symbol_example()
    with pytest.raises(ValueError, match=match):
        optimal_verifier_lp(target, draft, **kwargs)


def test_vocabulary_mismatch_is_rejected():
    with pytest.raises(ValueError, match="vocabulary"):
        optimal_verifier_lp((Fraction(1, 2), Fraction(1, 2)), (Fraction(1, 3),) * 3, 1)
