"""The optimal multi-draft acceptance: exact LP = min-cut closed form = sorted-prefix algorithm, and
every verifier's acceptance is at most the optimum, exactly."""

import itertools
import random
from fractions import Fraction as F

import numpy as np
import pytest
import sympy

from specresearch import exact
from specresearch.exact import lp, theory_multi
from specresearch.exact.multi import expected_accepted_multi
from specresearch.exact.paths import DRAFT_LAWS

P2, Q2 = exact.two_symbol_example()
# (method, draft law) pairs that are lossless (tests/test_exact_multi.py): only these are bounded by the optimum
VALID = [("rrs", "iid"), ("rrs_without_replacement", "iid"), ("rrs_without_replacement", "without_replacement"),
         ("kseq", "iid"), ("gbv", "iid"), ("traversal", "iid"), ("traversal", "without_replacement")]


def _rows(seed, vocab):
    rng = random.Random(seed)
    return (exact.random_rational_model(vocab, rng, depth=0, zero_prob=0.25)(()),
            exact.random_rational_model(vocab, rng, depth=0, zero_prob=0.25)(()))


@pytest.mark.parametrize("draft_law", DRAFT_LAWS)
@pytest.mark.parametrize("seed", range(8))
def test_lp_equals_closed_form(seed, draft_law):
    target, draft = _rows(seed, 2 + seed % 3)
    for k in (1, 2, 3):
        assert lp.optimal_acceptance(target, draft, k, draft_law) == lp.optimal_acceptance_closed_form(target, draft, k, draft_law)


def test_one_draft_optimum_is_alpha():
    for seed in range(6):
        target, draft = _rows(seed, 3)
        assert lp.optimal_acceptance(target, draft, 1) == sum(min(p, q) for p, q in zip(target, draft))
    assert lp.optimal_acceptance(P2, Q2, 2) == F(8, 9)  # H = {A}: 1/3 + 1 - (2/3)^2


def _min_over_all_subsets(p, q, k):
    return min(sum(p[t] for t in h) + 1 - sum(q[t] for t in h) ** k
               for size in range(len(p) + 1) for h in itertools.combinations(range(len(p)), size))


@pytest.mark.parametrize("seed", range(40))
def test_sorted_prefix_optimum_equals_min_over_all_subsets(seed):
    """The optimal H for i.i.d. drafts is a prefix of the p/q order (proof in theory_multi)."""
    rng = np.random.default_rng(seed)
    vocab, k = int(rng.integers(2, 9)), int(rng.integers(1, 6))
    p, q = rng.dirichlet(np.full(vocab, 0.5)), rng.dirichlet(np.full(vocab, 0.5))
    q[rng.integers(vocab)] = 0.0 if seed % 3 == 0 else q[0]  # some rows with a q = 0 token
    q /= q.sum()
    assert abs(theory_multi.optimal_acceptance_iid(p, q, k) - _min_over_all_subsets(p, q, k)) < 1e-12


def test_sorted_prefix_matches_exact_lp():
    for seed in range(6):
        target, draft = _rows(seed, 4)
        for k in (2, 3):
            exact_value = lp.optimal_acceptance(target, draft, k, "iid")
            floats = [float(v) for v in target], [float(v) for v in draft]
            assert abs(theory_multi.optimal_acceptance_iid(*floats, k) - float(exact_value)) < 1e-12


@pytest.mark.parametrize("method,draft_law", VALID)
def test_single_step_acceptance_at_most_the_optimum(method, draft_law):
    for seed in range(6):
        target, draft = _rows(seed, 2 + seed % 2)
        for k in (2, 3):
            optimum = lp.optimal_acceptance(target, draft, k, draft_law)
            accepted = expected_accepted_multi(target, draft, k, 1, method, draft_law=draft_law)
            assert sympy.simplify(optimum - accepted) >= 0 if method == "kseq" else accepted <= optimum


def test_two_symbol_table_k2():
    """The exact K = 2 table of notebook 08 (L = 1 and 2, i.i.d. drafts)."""
    assert lp.optimal_verifier_lp(P2, Q2, 2, num_drafts=2).optimum == F(131, 81)
    want = {"rrs": F(4, 3), "rrs_without_replacement": F(4, 3), "gbv": F(131, 81), "traversal": F(115, 81)}
    assert {m: expected_accepted_multi(P2, Q2, 2, 2, m) for m in want} == want
    kseq = expected_accepted_multi(P2, Q2, 2, 1, "kseq")
    assert sympy.simplify(kseq - (11 + sympy.sqrt(13)) / 18) == 0 and kseq < F(8, 9)


@pytest.mark.parametrize("draft_law", DRAFT_LAWS)
def test_path_acceptance_at_most_the_multi_path_lp(draft_law):
    """L = 2, K = 2, V = 2: E[accepted] <= optimal_verifier_lp over K paths, exactly."""
    methods = [m for m, law in VALID if law == draft_law and m != "kseq"]
    for seed in range(3):
        rng = random.Random(seed)
        target = exact.random_rational_model(2, rng, zero_prob=0.0, denominator=6)
        draft = exact.random_rational_model(2, rng, zero_prob=0.0, denominator=6)
        optimum = lp.optimal_verifier_lp(target, draft, 2, num_drafts=2, draft_law=draft_law).optimum
        for method in methods:
            assert expected_accepted_multi(target, draft, 2, 2, method, draft_law=draft_law) <= optimum


def test_multi_path_lp_with_one_path_is_the_single_draft_lp():
    target, draft = _rows(1, 3)
    one = lp.optimal_verifier_lp(target, draft, 2, num_drafts=1, draft_law="without_replacement").optimum
    assert one == lp.optimal_verifier_lp(target, draft, 2).optimum


def test_bad_draft_law_raises():
    with pytest.raises(ValueError, match="draft_law"):
        lp.optimal_acceptance(P2, Q2, 2, "sorted")


@pytest.mark.parametrize("args,match", [
    (([0.5, 0.5], [1.0]), "same vocabulary"),
    (([0.5, 0.6], [0.5, 0.5]), "sum to 1"),
    (([[0.5, 0.5]], [[0.5, 0.5]]), "1-D"),
    (([0.5, float("nan")], [0.5, 0.5]), "finite"),
])
def test_float_forms_reject_bad_rows(args, match):
    with pytest.raises(ValueError, match=match):
        theory_multi.optimal_acceptance_iid(*args, 2)


def test_float_forms_reject_bad_num_drafts():
    with pytest.raises(ValueError, match="num_drafts"):
        theory_multi.rrs_acceptance([0.5, 0.5], [0.5, 0.5], 0)


def test_gbv_is_not_monotone_in_k_on_the_two_symbol_example():
    """Selecting the largest p/q concentrates q^G on B: acceptance (2/3)^K + 2/3 for K >= 3, below the
    optimum 1 and falling, while RRS keeps rising."""
    values = [expected_accepted_multi(P2, Q2, k, 1, "gbv") for k in range(2, 6)]
    assert values == [F(8, 9)] + [F(2, 3) ** k + F(2, 3) for k in range(3, 6)]
    assert values[1] > values[2] > values[3]
    assert [lp.optimal_acceptance(P2, Q2, k) for k in (3, 4)] == [1, 1]
    rrs = [expected_accepted_multi(P2, Q2, k, 1, "rrs") for k in range(2, 6)]
    assert rrs == sorted(rrs) and rrs[-1] == F(227, 243)
