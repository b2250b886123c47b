"""Exact twins of the multi-draft verifiers: draft laws, K = 1 reductions, losslessness, K-SEQ's rho*."""

import itertools
import random
from fractions import Fraction as F

import numpy as np
import pytest
import sympy

from specresearch import exact
from specresearch.exact import lp, theory_multi
from specresearch.exact import multi as exact_multi
from specresearch.exact import paths as exact_paths
from specresearch.exact.multi import (
    MULTI_METHODS,
    expected_accepted_multi,
    is_lossless_multi,
    kseq_rho,
    smallest_counterexample,
    step_distribution_multi,
    verify_multi_exact,
)
from specresearch.exact.paths import DRAFT_LAWS, draft_paths_law

P2, Q2 = exact.two_symbol_example()


def _models(seed, vocab, zero_prob=0.2):
    rng = random.Random(seed)
    return (exact.random_rational_model(vocab, rng, zero_prob=zero_prob),
            exact.random_rational_model(vocab, rng, zero_prob=zero_prob))


# ----------------------------------------------------------------------------- draft laws


@pytest.mark.parametrize("draft_law", DRAFT_LAWS)
@pytest.mark.parametrize("seed", range(6))
def test_draft_paths_law_sums_to_one_and_first_path_is_q(draft_law, seed):
    _, draft = _models(seed, 3)
    law = draft_paths_law(draft, 3, 2, draft_law)
    assert sum(law.values()) == 1 and all(v > 0 for v in law.values())
    assert all(len(paths) == 3 and all(len(p) == 2 for p in paths) for paths in law)
    first: dict = {}
    for paths, prob in law.items():
        first[paths[0]] = first.get(paths[0], 0) + prob
    want = {(a, b): draft(())[a] * draft((a,))[b] for a in range(3) for b in range(3) if draft(())[a] * draft((a,))[b]}
    assert first == want  # path 1 is an ordinary draft path under both laws


def test_iid_law_is_the_product():
    law = draft_paths_law(Q2, 2, 1, "iid")
    assert law == {((0,), (0,)): F(4, 9), ((0,), (1,)): F(2, 9), ((1,), (0,)): F(2, 9), ((1,), (1,)): F(1, 9)}


def test_without_replacement_law_renormalises_and_pads_with_copies():
    q = (F(1, 2), F(1, 3), F(1, 6))
    law = draft_paths_law(q, 2, 1, "without_replacement")
    assert law[((0,), (1,))] == F(1, 2) * F(1, 3) / F(1, 2)
    assert law[((2,), (0,))] == F(1, 6) * F(1, 2) / F(5, 6)
    assert all(paths[0] != paths[1] for paths in law)
    # only two tokens of positive mass and K = 3: the third path copies the second
    law = draft_paths_law((F(1, 4), 0, F(3, 4)), 3, 1, "without_replacement")
    assert law == {((0,), (2,), (2,)): F(1, 4), ((2,), (0,), (0,)): F(3, 4)}


# ----------------------------------------------------------------------------- K = 1 reductions


def _chain_instances(count=25):
    for seed in range(count):
        target, draft = _models(seed, 2 + seed % 2, zero_prob=0.3)
        rng = random.Random(seed)
        path = (rng.randrange(2), rng.randrange(2), rng.randrange(2))[: 1 + seed % 3]
        yield target, draft, path


@pytest.mark.parametrize("method,single", [("rrs", "token"), ("rrs_without_replacement", "token"),
                                           ("gbv", "block"), ("traversal", "block")])
def test_single_path_reduces_to_single_draft_verifier(method, single):
    """K = 1: RRS (both) = token verification, GBV = traversal = block verification, exactly."""
    for target, draft, path in _chain_instances():
        assert verify_multi_exact(target, draft, (path,), method) == verify_multi_exact(target, draft, (path,), single)


def test_kseq_with_one_draft_is_token_verification():
    for seed in range(10):
        target, draft = _models(seed, 3)
        for x in range(3):
            assert verify_multi_exact(target, draft, ((x,),), "kseq") == verify_multi_exact(target, draft, ((x,),), "token")


def test_num_drafts_one_keeps_single_draft_behaviour():
    target, draft = _models(3, 3)
    for method in exact.METHODS:
        assert exact.expected_accepted(target, draft, 2, method, num_drafts=1) == exact.expected_accepted(target, draft, 2, method)
    assert exact.expected_accepted(target, draft, 2, "gbv", num_drafts=1) == exact.expected_accepted(target, draft, 2, "block")
    assert exact.expected_accepted(P2, Q2, 2, "block") == F(11, 9)


# ----------------------------------------------------------------------------- losslessness

# Which draft law each verifier is lossless under (module docstring of exact_multi).
LOSSLESS = {
    ("rrs", "iid"): True, ("rrs", "without_replacement"): False,
    ("rrs_without_replacement", "iid"): True, ("rrs_without_replacement", "without_replacement"): True,
    ("kseq", "iid"): True, ("kseq", "without_replacement"): False,
    ("gbv", "iid"): True, ("gbv", "without_replacement"): False,
    ("traversal", "iid"): True, ("traversal", "without_replacement"): True,
    ("onehot", "iid"): True, ("onehot", "without_replacement"): True, ("onehot", "topk"): True,
    # a deterministic top-k tree is not a draw from q: the rules that read q are lossy on it
    ("rrs", "topk"): False, ("rrs_without_replacement", "topk"): False, ("traversal", "topk"): False,
}


def _sweep_instance(seed, method):
    """V = 2..3, K = 2..3, L = 1..2 (L = 1 for K-SEQ), random context-dependent models with zeros."""
    target, draft = _models(seed, 2 + seed % 2)
    return target, draft, 2 + (seed // 2) % 2, 1 if method == "kseq" else 1 + (seed // 4) % 2


@pytest.mark.slow
@pytest.mark.parametrize("method,draft_law", sorted(LOSSLESS))
def test_full_loop_losslessness_on_50_random_models(method, draft_law):
    """The exact law of the loop's first 3 tokens is the target's for every one of 50 models (or, for
    a lossy pair, not for at least one of them)."""
    verdicts = []
    for seed in range(50):
        target, draft, k, length = _sweep_instance(seed, method)
        verdicts.append(exact.is_lossless(target, draft, length, method, 3, num_drafts=k, draft_law=draft_law))
    if LOSSLESS[(method, draft_law)]:
        assert all(verdicts)
    else:
        assert not all(verdicts)


@pytest.mark.parametrize("method,want", [
    ("rrs", ((0, F(1, 3), F(2, 3)), (F(2, 3), 0, F(1, 3)))),
    ("kseq", (P2, Q2)),
    ("gbv", ((F(1, 2), F(1, 2)), (F(1, 2), F(1, 2)))),
])
def test_smallest_counterexample_under_draws_without_replacement(method, want):
    target, draft = smallest_counterexample(method, "without_replacement", max_vocab=3, max_denominator=3)
    assert (target, draft) == want
    assert not exact.is_lossless(target, draft, 1, method, 1, num_drafts=2, draft_law="without_replacement")
    assert exact.is_lossless(target, draft, 1, method, 2, num_drafts=2, draft_law="iid")
    # and the first emitted token's law is visibly not p
    law = step_distribution_multi(target, draft, 2, 1, method, draft_law="without_replacement")
    first = [sympy.nsimplify(sum(v for s, v in law.items() if s[0] == t)) for t in range(len(target))]
    assert first != [sympy.Rational(p.numerator, p.denominator) for p in target]


def test_tree_readers_have_no_small_counterexample():
    for method in ("rrs_without_replacement", "traversal"):
        for law in DRAFT_LAWS:
            assert smallest_counterexample(method, law, max_vocab=3, max_denominator=3) is None


# ----------------------------------------------------------------------------- K-SEQ's rho*, exact


def test_kseq_rho_is_a_quadratic_surd_on_the_two_symbol_example():
    rho = kseq_rho(P2, Q2, 2)
    assert sympy.simplify(rho - (5 + sympy.sqrt(13)) / 6) == 0
    accepted = expected_accepted_multi(P2, Q2, 2, 1, "kseq")
    assert sympy.simplify(accepted - (11 + sympy.sqrt(13)) / 18) == 0
    beta = sum(sympy.Min(sympy.Rational(q), sympy.Rational(p) / rho) for p, q in zip(P2, Q2))
    assert sympy.simplify(1 - (1 - beta) ** 2 - rho * beta) == 0


def test_kseq_rho_solves_the_equation_exactly_for_three_drafts():
    p, q = (F(1, 2), F(1, 3), F(1, 6)), (F(1, 6), F(1, 3), F(1, 2))
    rho = kseq_rho(p, q, 3)
    beta = sum(min(sympy.Rational(b.numerator, b.denominator), sympy.Rational(a.numerator, a.denominator) / rho) for a, b in zip(p, q))
    assert 1 <= rho <= 3
    x = sympy.Symbol("x")
    assert isinstance(rho, sympy.CRootOf)  # a cubic root here, not a float
    assert sympy.minimal_polynomial(1 - (1 - beta) ** 3 - rho * beta, x) == x  # the residual is exactly 0
    assert abs(float(rho) - theory_multi.kseq_rho_float([float(v) for v in p], [float(v) for v in q], 3)) < 1e-10


def test_kseq_rho_is_one_when_the_draft_is_the_target():
    assert kseq_rho(P2, P2, 3) == 1


# ----------------------------------------------------------------------------- float forms at full V


@pytest.mark.parametrize("seed", range(8))
def test_float_single_step_acceptances_match_the_exact_twins(seed):
    rng = random.Random(seed)
    p = exact.random_rational_model(4, rng, depth=0)(())
    q = exact.random_rational_model(4, rng, depth=0)(())
    pf, qf = np.array([float(v) for v in p]), np.array([float(v) for v in q])
    for k in (2, 3):
        assert abs(theory_multi.rrs_acceptance(pf, qf, k) - float(expected_accepted_multi(p, q, k, 1, "rrs"))) < 1e-12
        assert abs(theory_multi.kseq_acceptance(pf, qf, k) - float(expected_accepted_multi(p, q, k, 1, "kseq"))) < 1e-10
        assert abs(theory_multi.gbv_acceptance(pf, qf, k) - float(expected_accepted_multi(p, q, k, 1, "gbv"))) < 1e-12
        exact_wor = float(expected_accepted_multi(p, q, k, 1, "rrs_without_replacement", draft_law="without_replacement"))
        estimate, stderr = theory_multi.rrs_without_replacement_acceptance_mc(pf, qf, k, 400, np.random.default_rng(seed))
        # |z| > 5.5 has probability < 1e-7 for a mean of 400 bounded draws (CLT; stderr 0 means exact)
        assert abs(estimate - exact_wor) <= 5.5 * stderr + 1e-12


def test_traversal_equals_rrs_without_replacement_at_length_one():
    for seed in range(10):
        target, draft = _models(seed, 3)
        for paths in itertools.product([(0,), (1,), (2,)], repeat=2):
            assert verify_multi_exact(target, draft, paths, "traversal") == verify_multi_exact(target, draft, paths, "rrs_without_replacement")


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs,match", [
    (dict(paths=(), method="rrs"), "paths"),
    (dict(paths=((0,), (0, 1)), method="rrs"), "same length"),
    (dict(paths=((0,), (5,)), method="rrs"), r"paths\[1\]\[0\]"),
    (dict(paths=((0,), (1,)), method="block"), "single-draft"),
    (dict(paths=((0, 1), (1, 0)), method="kseq"), "length must be 1"),
    (dict(paths=((0,),), method="nope"), "method"),
    (dict(paths=((0,),), method="rrs", draft_law="with_replacement"), "draft_law"),
])
def test_bad_input_raises_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        verify_multi_exact(P2, Q2, **kwargs)


def test_bad_num_drafts_raises():
    with pytest.raises(ValueError, match="num_drafts"):
        exact.expected_accepted(P2, Q2, 1, "rrs", num_drafts=0)
    with pytest.raises(ValueError, match="num_drafts"):
        draft_paths_law(Q2, 1.5, 1)


def test_methods_are_named():
    assert MULTI_METHODS == ("rrs", "rrs_without_replacement", "kseq", "gbv", "traversal", "onehot")
    assert set(exact_multi.__all__) >= {"verify_multi_exact", "is_lossless_multi"} and "draft_paths_law" in exact_paths.__all__


# ----------------------------------------------------------------------------- the one-hot rule


def test_topk_law_is_the_deterministic_tree():
    q = {(): (F(1, 2), F(1, 3), F(1, 6)), (0,): (F(0), F(1, 4), F(3, 4)), (1,): (F(1, 3), F(1, 3), F(1, 3))}
    law = draft_paths_law(lambda u: q.get(u, q[()]), 2, 2, "topk")
    # top 2 at the root: 0 (1/2), 1 (1/3); below 0 only 2 and 1 have q > 0; below 1 a three-way tie, by id
    assert law == {((0, 2), (0, 1), (1, 0), (1, 1)): 1}


@pytest.mark.parametrize("seed", range(6))
def test_onehot_attains_the_lp_optimum_on_topk_trees(seed):
    """For a fixed candidate set no lossless rule accepts more than p(candidates) at a node; on top-k trees
    (V = 3, K = 1..2, L = 1..2) the one-hot rule's E[accepted] equals the LP optimum over all valid verifiers."""
    target, draft = _models(seed, 3)
    for k, length in [(1, 1), (2, 1), (1, 2), (2, 2)]:
        got = exact.expected_accepted(target, draft, length, "onehot", num_drafts=k, draft_law="topk")
        assert got == lp.optimal_verifier_lp(target, draft, length, num_drafts=k, draft_law="topk").optimum, (seed, k, length)


def test_traversal_reproduces_the_papers_worked_example():
    """Traversal verification's introduction (arXiv 2505.12398): a parent accepted with ratio p/q = 0.5 and its child
    with ratio 4/3 pass token by token with probability 0.5 x 1 = 0.5, and as a sequence with min(1, 0.5 x 4/3) = 2/3.
    Traversal visits the leaf of path (0, 0) first and keeps the path with that sequence-level probability; RRS (token
    level) keeps it with 1/2. A second path (1, 1) makes it a tree."""
    half = F(1, 2)
    rows = {(): (F(1, 4), F(3, 4)), (0,): (F(2, 3), F(1, 3))}

    def target(prefix):
        return rows.get(tuple(prefix), (half, half))

    def draft(prefix):
        return (half, half)
    paths = [(0, 0), (1, 1)]

    def kept(method):
        law = verify_multi_exact(target, draft, paths, method)
        return sum(mass for emitted, mass in law.items() if emitted[:2] == (0, 0))

    assert kept("traversal") == F(2, 3)
    assert kept("rrs") == half


def _gbv_first_token_law(p, q, choose):
    """GBV at K = 2, L = 1, enumerated independently of the library: X* = ``choose(x1, x2)`` of two i.i.d. draws
    from q; the draft law is q^G(t) = (y(t) + q(t))^2 - y(t)^2, y(t) = the q-mass ranked below t in the order
    (min(1, p/q), token id); then block verification, which at L = 1 is token verification against q^G."""
    vocab = range(len(p))
    rank = sorted(vocab, key=lambda t: (min(F(1), p[t] / q[t]), t))
    below = {t: sum((q[s] for s in rank[: rank.index(t)]), F(0)) for t in vocab}
    q_g = [(below[t] + q[t]) ** 2 - below[t] ** 2 for t in vocab]
    residual = [max(p[t] - q_g[t], F(0)) for t in vocab]
    emitted = [F(0)] * len(p)
    for x1, x2 in itertools.product(vocab, repeat=2):
        x, mass = choose(x1, x2), q[x1] * q[x2]
        keep = min(F(1), p[x] / q_g[x])
        emitted[x] += mass * keep
        for t in vocab:
            emitted[t] += mass * (1 - keep) * residual[t] / sum(residual)
    return emitted, rank


def test_gbv_selection_and_law_must_rank_ties_alike():
    """GBV's draft law q^G is the law of the largest of K i.i.d. paths in one order, so the selection must use
    that same order, ties included (docs/multidraft.md). The reference code released with the paper (its
    ``gbv_verify``) ranks by min(1, p/q), so every token with p >= q ties at 1; q^G breaks those ties by token id,
    while the selection keeps the first child drafted. With p = (1/6, 1/3, 1/2) and uniform q (tokens 1 and 2 tie)
    that rule emits (7/45, 4/9, 2/5) instead of p. The same clipped order used for both emits p: the order is
    free, its consistency is not. The toolkit's order (p/q unclipped, ties by token id) is one order for both."""
    third = F(1, 3)
    p, q = (F(1, 6), third, F(1, 2)), (third, third, third)

    def ratio(t):
        return min(F(1), p[t] / q[t])

    def first_drafted_among_ties(x1, x2):
        return x2 if ratio(x2) > ratio(x1) else x1

    emitted, rank = _gbv_first_token_law(p, q, first_drafted_among_ties)
    assert rank == [0, 1, 2] and ratio(1) == ratio(2) == 1
    assert emitted == [F(7, 45), F(4, 9), F(2, 5)]
    consistent, _ = _gbv_first_token_law(p, q, lambda x1, x2: max(x1, x2, key=rank.index))
    assert consistent == list(p)
    law = step_distribution_multi(p, q, 2, 1, "gbv")
    assert [sum(m for seq, m in law.items() if seq[0] == t) for t in range(3)] == list(p)


def test_gbv_unclipped_order_accepts_more_than_the_clipped_one(monkeypatch):
    """Any one order serves GBV's selection and q^G losslessly; which one is a design choice. On 24 random models
    (V = 3, K = 2-3, L = 2) the toolkit's order (p/q unclipped) accepts more than the reference code's min(1, p/q)
    with ties by token id on 11, less on 1 (-0.023 tokens a step), the same on 12; +0.022 tokens a step on average.
    The clipped order is lossless too."""
    ours, clipped = [], []
    for seed in range(24):
        rng = random.Random(seed)
        vocab, k = 3, rng.choice([2, 3])
        target, draft = exact.random_rational_model(vocab, rng, zero_prob=0.1), exact.random_rational_model(
            vocab, rng, zero_prob=0.1)
        ours.append(expected_accepted_multi(target, draft, k, 2, "gbv"))
        with monkeypatch.context() as patch:
            patch.setattr(exact_multi, "_gbv_order_key", lambda p_row, q_row, token: (
                min(F(1), p_row[token] / q_row[token]) if q_row[token] > 0 else F(1), token))
            clipped.append(expected_accepted_multi(target, draft, k, 2, "gbv"))
            if k == 2:  # the losslessness check costs seconds a model at K = 3
                assert is_lossless_multi(target, draft, k, 2, "gbv", 1), seed
    gains = [a - b for a, b in zip(ours, clipped)]
    assert (sum(g > 0 for g in gains), sum(g < 0 for g in gains)) == (11, 1)
    assert abs(float(sum(gains)) / len(gains) - 0.022) < 0.001


def test_traversal_parent_weight_renormalised_by_the_draft_mass_is_not_lossless():
    """The parent update is w_b <- Z / (Z + 1 - w_b) (docs/multidraft.md). A public re-implementation that names the
    paper's pseudocode (M_b, M_s, p_alpha) instead sets w_b <- min(1, Z / (1 - q(x))), the residual's mass over the
    draft mass left, and then draws from max(w_b p' - q', 0). That reading is not lossless: at depth 1 with K = 2
    paths drawn without replacement, p = (0, 1/2, 1/2), q = (2/5, 1/5, 2/5), it emits (0, 8/15, 7/15), while the
    toolkit's rule emits p. This is the rule as that reading states it, enumerated here independently of the library."""
    p, q = (F(0), F(1, 2), F(1, 2)), (F(2, 5), F(1, 5), F(2, 5))
    vocab = range(3)
    emitted = [F(0)] * 3
    for x1, x2 in itertools.permutations(vocab, 2):  # the two distinct first tokens, drawn without replacement
        rest = [F(0) if y == x1 else q[y] for y in vocab]
        mass = q[x1] * rest[x2] / sum(rest)
        keep1 = min(F(1), p[x1] / q[x1])
        emitted[x1] += mass * keep1
        mass *= 1 - keep1
        residual = [max(p[y] - q[y], F(0)) for y in vocab]  # the root's weight is 1
        z = sum(residual)
        p_now, q_now = [v / z for v in residual], [v / sum(rest) for v in rest]
        weight = min(F(1), z / sum(rest))  # the reading under test (the toolkit: z / (z + 1 - 1) = 1)
        keep2 = min(F(1), weight * p_now[x2] / q_now[x2])
        emitted[x2] += mass * keep2
        mass *= 1 - keep2
        left = [max(weight * p_now[y] - q_now[y], F(0)) for y in vocab]
        for y in vocab:
            emitted[y] += mass * left[y] / sum(left)
    assert emitted == [F(0), F(8, 15), F(7, 15)]
    law = step_distribution_multi(p, q, 2, 1, "traversal", draft_law="without_replacement")
    first = [sum(m for seq, m in law.items() if seq[0] == y) for y in vocab]
    assert first == list(p)


def test_a_large_step_law_shows_its_progress(monkeypatch, capsys):
    """From ``PROGRESS_FROM`` draft tuples a step's enumeration draws a bar on stderr naming the step; the law is the
    same. Below it, nothing is drawn."""
    import specresearch.exact.multi as multi

    p, q = exact.two_symbol_example()
    quiet = multi.expected_accepted_multi(p, q, 2, 2, "traversal")
    assert "exact traversal" not in capsys.readouterr().err
    monkeypatch.setattr(multi, "PROGRESS_FROM", 1)
    assert multi.expected_accepted_multi(p, q, 2, 2, "traversal") == quiet
    assert "exact traversal step law, K = 2, gamma = 2, V = 2" in capsys.readouterr().err
    multi.step_distribution_multi(p, q, 2, 1, "kseq")
    assert "exact kseq step law, K = 2, gamma = 1, V = 2" in capsys.readouterr().err
