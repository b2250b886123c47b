"""Exactness tier: the rational twins in specresearch.exact, checked by enumeration.

Everything here is exact (fractions.Fraction); there is no randomness except the fixed seeds that
build random rational models, so every assertion is deterministic.
"""

from __future__ import annotations

import random
from collections import defaultdict
from fractions import Fraction as F

import pytest
import sympy

from specresearch.exact.single import (
    _block_forward_exact,
    as_model,
    block_efficiency,
    expected_accepted,
    is_lossless,
    random_rational_model,
    speculative_distribution,
    step_distribution,
    target_distribution,
    two_symbol_example,
    verify_exact,
)

A, B = 0, 1

# Two-symbol example (the two-symbol post), expected accepted draft tokens per step, gamma = 1..4.
#
# Token column, independent check: with i.i.d. p, q each draft is accepted independently with
# probability alpha = sum_x min(p(x), q(x)) = min(1/3, 2/3) + min(2/3, 1/3) = 2/3, so
# E[accepted] = sum_{k=1}^{gamma} alpha^k. (the two-symbol post prints "alpha = 1/3"; that is 1 - alpha:
# only alpha = 2/3 reproduces its own 10/9 at gamma = 2.)
#
# Block column, by hand (Sun et al. Alg. 2; p_i = min(p_{i-1} p(x_i)/q(x_i), 1), h_gamma = p_gamma,
# h_i = sum_x w_i(x) / (sum_x w_i(x) + 1 - p_i) with w_i(x) = max(p_i p(x) - q(x), 0)):
#   gamma = 1: h_1 = p_1 = min(p(x_1)/q(x_1), 1): A (prob 2/3) -> 1/2, B (prob 1/3) -> 1,
#              E = 2/3 * 1/2 + 1/3 * 1 = 2/3 (block = token when gamma = 1).
#   gamma = 2: draft (prob)  p_1  p_2  h_1  h_2  E[tau | draft] = 2 h_2 + h_1 (1 - h_2)
#              AA (4/9)      1/2  1/4  0    1/4  1/2
#              AB (2/9)      1/2  1    0    1    2
#              BA (2/9)      1    1/2  1    1/2  3/2
#              BB (1/9)      1    1    1    1    2
#              (h_1 = 0 when p_1 = 1/2: w_1 = (max(1/6 - 2/3, 0), max(1/3 - 1/3, 0)) = 0;
#               h_1 = 1 when p_1 = 1: w_1 = (0, 1/3) and 1 - p_1 = 0.)
#              E = 4/9 * 1/2 + 2/9 * 2 + 2/9 * 3/2 + 1/9 * 2 = (2 + 4 + 3 + 2) / 9 = 11/9.
#   gamma = 3, 4: no hand derivation; the values are what both the backward and the forward
#              (the two-symbol post) form compute, and they must exceed the token column.
ALPHA_TWO_SYMBOL = F(2, 3)
TWO_SYMBOL_TABLE = {  # gamma: (token, block)
    1: (F(2, 3), F(2, 3)),
    2: (F(10, 9), F(11, 9)),
    3: (F(38, 27), F(5, 3)),
    4: (F(130, 81), F(166, 81)),
}

# 60 random context-dependent instances: V in {2, 3} x gamma in {1, 2, 3} x 10 seeds, N = 3 tokens.
RANDOM_CASES = [(v, g, seed) for v in (2, 3) for g in (1, 2, 3) for seed in range(10)]
N_TOKENS = 3


def _models(vocab, seed):
    rng = random.Random(1000 * vocab + seed)
    return random_rational_model(vocab, rng), random_rational_model(vocab, rng)


def _always_accept(ps, qs, xs):
    """Broken verifier: accepts every draft token, then samples the bonus token from p."""
    return {(len(xs), t): pt for t, pt in enumerate(ps[-1]) if pt}


def _residual_is_p(ps, qs, xs):
    """Broken verifier: token verification whose residual is p instead of norm(max(p - q, 0))."""
    law, reach = defaultdict(F), F(1)
    for i, x in enumerate(xs):
        accept = min(F(1), ps[i][x] / qs[i][x]) if qs[i][x] else F(0)
        for t, pt in enumerate(ps[i]):
            law[(i, t)] += reach * (1 - accept) * pt
        reach *= accept
    for t, pt in enumerate(ps[-1]):
        law[(len(xs), t)] += reach * pt
    return dict(law)


# ----------------------------------------------------------------------------- two-symbol example


def test_two_symbol_headline_values():
    target, draft = two_symbol_example()
    assert target == (F(1, 3), F(2, 3)) and draft == (F(2, 3), F(1, 3))
    assert expected_accepted(target, draft, 2, "token") == F(10, 9)
    assert expected_accepted(target, draft, 2, "block") == F(11, 9)
    assert block_efficiency(target, draft, 2, "block") == F(20, 9)


@pytest.mark.parametrize("gamma", sorted(TWO_SYMBOL_TABLE))
def test_two_symbol_table(gamma):
    target, draft = two_symbol_example()
    token, block = TWO_SYMBOL_TABLE[gamma]
    assert token == sum(ALPHA_TWO_SYMBOL**k for k in range(1, gamma + 1))  # independent closed form
    assert expected_accepted(target, draft, gamma, "token") == token
    assert expected_accepted(target, draft, gamma, "block") == block
    assert expected_accepted(target, draft, gamma, _block_forward_exact) == block
    assert block >= token and (block > token) == (gamma >= 2)


def test_two_symbol_per_draft_laws_match_reference_003():
    """Sun et al.'s OpenReview rebuttal spells out the gamma = 2 block laws for drafts AA and BA."""
    target, draft = two_symbol_example()
    ps, qs = [target] * 3, [draft] * 2
    # AA: h_2 = 1/4, h_1 = 0, residual = point mass on B.
    assert verify_exact(ps, qs, [A, A], "block") == {(2, A): F(1, 12), (2, B): F(1, 6), (0, B): F(3, 4)}
    # BA: h_2 = 1/2, h_1 = 1, residual given B = point mass on B.
    assert verify_exact(ps, qs, [B, A], "block") == {(2, A): F(1, 6), (2, B): F(1, 3), (1, B): F(1, 2)}
    # Token verification on AA: accept each A with probability 1/2, residual = B.
    assert verify_exact(ps, qs, [A, A], "token") == {
        (0, B): F(1, 2), (1, B): F(1, 4), (2, A): F(1, 12), (2, B): F(1, 6)
    }


def test_block_beats_token_only_on_average():
    """Block verification can accept fewer tokens than token verification for one draft block (AA):
    its advantage holds in expectation over the drafts, which is what the losslessness proof allows."""
    target, draft = two_symbol_example()
    mean = lambda law: sum(n * prob for (n, _), prob in law.items())  # noqa: E731
    ps, qs = [target] * 3, [draft] * 2
    assert mean(verify_exact(ps, qs, [A, A], "block")) == F(1, 2)
    assert mean(verify_exact(ps, qs, [A, A], "token")) == F(3, 4)


def test_two_symbol_step_distribution_token_gamma_1():
    target, draft = two_symbol_example()
    # Accept A w.p. 2/3 * 1/2; B always; rejected A -> residual B. Then the bonus token ~ p.
    expected = {(B,): F(1, 3), (A, A): F(1, 9), (A, B): F(2, 9), (B, A): F(1, 9), (B, B): F(2, 9)}
    assert step_distribution(target, draft, 1, "token") == expected


# ----------------------------------------------------------------------------- losslessness


@pytest.mark.parametrize("method", ["token", "block"])
def test_lossless_on_random_context_dependent_models(method):
    for vocab, gamma, seed in RANDOM_CASES:
        target, draft = _models(vocab, seed)
        assert is_lossless(target, draft, gamma, method, N_TOKENS), (method, vocab, gamma, seed)


def test_greedy_lossless_against_greedy_target():
    for vocab, gamma, seed in RANDOM_CASES:
        target, draft = _models(vocab, seed)
        assert is_lossless(target, draft, gamma, "greedy", N_TOKENS), (vocab, gamma, seed)
        law = speculative_distribution(target, draft, gamma, "greedy", N_TOKENS)
        assert law == target_distribution(target, N_TOKENS, greedy=True) and len(law) == 1


def test_greedy_is_not_lossless_for_sampling():
    target, draft = two_symbol_example()
    assert speculative_distribution(target, draft, 2, "greedy", 2) == {(B, B): 1}
    assert speculative_distribution(target, draft, 2, "greedy", 2) != target_distribution(target, 2)


@pytest.mark.parametrize("broken", [_always_accept, _residual_is_p])
def test_losslessness_check_catches_broken_verifiers(broken):
    """The same exact check fails for a wrong verifier, so the losslessness tests can fail."""
    target, draft = two_symbol_example()
    assert not is_lossless(target, draft, 2, broken, N_TOKENS)
    caught = sum(not is_lossless(*_models(v, s), g, broken, N_TOKENS) for v, g, s in RANDOM_CASES)
    assert caught >= 50, f"{broken.__name__} caught on only {caught} of {len(RANDOM_CASES)} instances"


def test_larger_loop_is_lossless_and_fast_enough():
    """V = 3, gamma = 3, 4 tokens: the memoised recursion finishes in well under a second."""
    target, draft = _models(3, 99)
    for method in ("token", "block"):
        law = speculative_distribution(target, draft, 3, method, 4)
        assert law == target_distribution(target, 4) and sum(law.values()) == 1


def test_identical_models_accept_everything():
    target, _ = _models(3, 7)
    for method in ("token", "block"):
        assert expected_accepted(target, target, 3, method) == 3


# ----------------------------------------------------------------------------- forward = backward, block >= token


def _random_instance(rng, *, any_tokens):
    """Random rational rows with exact zeros; draft tokens from q's support, or anything."""
    vocab, gamma = rng.randint(2, 4), rng.randint(1, 4)
    ps = [random_rational_model(vocab, rng, depth=0, zero_prob=0.3)(()) for _ in range(gamma + 1)]
    qs = [random_rational_model(vocab, rng, depth=0, zero_prob=0.3)(()) for _ in range(gamma)]
    xs = [rng.randrange(vocab) if any_tokens else rng.choice([t for t, qt in enumerate(q) if qt]) for q in qs]
    return ps, qs, xs


@pytest.mark.parametrize("any_tokens", [False, True])
def test_block_forward_and_backward_forms_agree(any_tokens):
    rng = random.Random(2024 + any_tokens)
    for _ in range(400):
        ps, qs, xs = _random_instance(rng, any_tokens=any_tokens)
        assert verify_exact(ps, qs, xs, "block") == verify_exact(ps, qs, xs, _block_forward_exact), (ps, qs, xs)


def test_forward_block_form_is_not_token_verification():
    """The agreement check can fail: the forward block law differs from the token law on some instances."""
    rng = random.Random(7)
    instances = [_random_instance(rng, any_tokens=False) for _ in range(100)]
    differ = [verify_exact(ps, qs, xs, "token") != verify_exact(ps, qs, xs, _block_forward_exact)
              for ps, qs, xs in instances]
    assert any(differ)


def test_block_expected_accepted_at_least_token_on_random_models():
    for vocab, gamma, seed in RANDOM_CASES:
        target, draft = _models(vocab, seed)
        for prefix in [(), (0,), (1, 0)]:
            token = expected_accepted(target, draft, gamma, "token", prefix)
            assert expected_accepted(target, draft, gamma, "block", prefix) >= token


def test_laws_sum_to_one_and_respect_q_zero():
    rng = random.Random(11)
    for _ in range(200):
        ps, qs, xs = _random_instance(rng, any_tokens=True)
        for method in ("token", "block", "greedy"):
            law = verify_exact(ps, qs, xs, method)
            assert sum(law.values()) == 1 and all(v > 0 for v in law.values())
            first_zero = next((i for i, (q, x) in enumerate(zip(qs, xs)) if q[x] == 0), None)
            if first_zero is not None and method != "greedy":  # a draft with q = 0 is never accepted
                assert all(n <= first_zero for n, _ in law)


# ----------------------------------------------------------------------------- models


def test_random_rational_model_is_reproducible_and_context_dependent():
    one, two = random_rational_model(3, random.Random(5)), random_rational_model(3, random.Random(5))
    prefixes = [(), (0,), (1,), (2,), (0, 1), (2, 2, 1)]
    assert [one(p) for p in prefixes] == [two(p) for p in reversed(prefixes)][::-1]
    assert len({one(p) for p in prefixes}) > 1
    rows = [one((t, u)) for t in range(3) for u in range(3)] + [one(p) for p in prefixes]
    assert all(sum(r) == 1 and min(r) >= 0 and all(v.denominator <= 12 for v in r) for r in rows)
    many = random_rational_model(4, random.Random(6), zero_prob=0.3)
    assert any(0 in many((t,)) for t in range(20))
    flat = random_rational_model(3, random.Random(5), depth=0)
    assert flat(()) == flat((1, 2))
    markov = random_rational_model(3, random.Random(5), depth=1)
    assert markov((0, 2)) == markov((2,))


def test_sympy_rationals_and_dict_models_are_accepted():
    half = sympy.Rational(1, 2)
    law = verify_exact([[half, half]] * 2, [[sympy.Rational(1, 3), sympy.Rational(2, 3)]], [1], "token")
    assert law == {(0, 0): F(1, 4), (1, 0): F(3, 8), (1, 1): F(3, 8)}
    model = as_model({(): [half, half], (0,): [1, 0], (1,): [0, 1]})
    assert model((0,)) == (F(1), F(0))
    assert target_distribution({(): [half, half], (0,): [1, 0], (1,): [0, 1]}, 2) == {(0, 0): F(1, 2), (1, 1): F(1, 2)}


# ----------------------------------------------------------------------------- validation


P2, Q2 = [F(1, 3), F(2, 3)], [F(2, 3), F(1, 3)]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([P2, [F(1, 2), F(1, 3)]], [Q2], [0], "token"), "target_rows\\[1\\] sums to 5/6"),
        (([P2, P2], [[F(4, 3), F(-1, 3)]], [0], "token"), "draft_rows\\[0\\] has a negative"),
        (([P2, [0.5, 0.5]], [Q2], [0], "token"), "exact rationals"),
        (([P2, P2, P2], [Q2], [0], "token"), "target_rows must hold gamma \\+ 1 = 2"),
        (([P2, P2], [Q2], [0, 1], "token"), "draft_tokens must hold gamma = 1"),
        (([P2, P2], [[F(1, 3)] * 3], [0], "token"), "draft_rows\\[0\\] has 3 entries"),
        (([P2], [], [], "token"), "draft_rows must be a non-empty"),
        (([P2, P2], [Q2], [2], "token"), "draft_tokens\\[0\\] must be an integer in \\[0, 2\\)"),
        (([P2, P2], [Q2], [0], "tokens"), "method must be one of"),
    ],
)
def test_verify_exact_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        verify_exact(*args)


def test_loop_functions_reject_bad_input():
    target, draft = two_symbol_example()
    with pytest.raises(ValueError, match="gamma must be an integer >= 1"):
        expected_accepted(target, draft, 0, "token")
    with pytest.raises(ValueError, match="method must be one of"):
        step_distribution(target, draft, 1, "beam")
    with pytest.raises(ValueError, match="n_tokens must be an integer >= 1"):
        speculative_distribution(target, draft, 1, "token", 0)
    with pytest.raises(ValueError, match="model has no row for prefix \\(1,\\)"):
        target_distribution({(): P2, (0,): P2}, 2)
    with pytest.raises(ValueError, match="model\\(\\(\\)\\) sums to"):
        target_distribution(lambda prefix: [F(1, 2), F(1, 3)], 1)
    with pytest.raises(ValueError, match="vocabulary size is 3"):
        as_model(P2, vocab_size=3)(())


def test_random_rational_model_rejects_bad_input():
    rng = random.Random(0)
    with pytest.raises(ValueError, match="vocab_size"):
        random_rational_model(0, rng)
    with pytest.raises(ValueError, match="rng must be a random.Random"):
        random_rational_model(3, 42)
    with pytest.raises(ValueError, match="zero_prob"):
        random_rational_model(3, rng, zero_prob=1.0)
    with pytest.raises(ValueError, match="denominator"):
        random_rational_model(3, rng, denominator=2)
    with pytest.raises(ValueError, match="depth"):
        random_rational_model(3, rng, depth=-1)
