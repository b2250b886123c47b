"""The lossy frontier: the most acceptance any rule can buy with a given distortion of the target's law.

One step at a prefix, K drafts X = (X_1..X_K) from the draft law Q, an emitted token Y with law r. A rule is a
coupling pi of X and Y; it accepts when Y is one of the drafts. Its distortion is the total variation
TV(r, p) = sum_y max(r(y) - p(y), 0). The frontier is

    A(eps) = max over couplings pi with TV(r, p) <= eps of P(Y in X),

an LP (:func:`lossy_frontier`). At eps = 0 it is the lossless optimum of :func:`specresearch.exact.lp.optimal_acceptance`.

Closed form for one draft (K = 1): A(eps) = min(1, alpha + eps), alpha = sum_x min(p(x), q(x)).
Proof. Upper bound: P(Y = X) <= sum_x min(q(x), r(x)) = 1 - TV(q, r) <= 1 - max(0, TV(q, p) - TV(p, r)) by the
triangle inequality, and 1 - TV(q, p) = alpha. Attained: move min(eps, 1 - alpha) of mass from tokens where
p > q to tokens where q > p, so that r stays between p and q token by token; then sum min(q, r) = alpha + the
mass moved, and the maximal coupling of q and r attains it.
For K > 1 the same upper bound holds: in the min-cut form A_r(0) = min over token sets H of [r(H) + 1 - Q(all
drafts in H)] (:func:`specresearch.exact.lp.optimal_acceptance_closed_form`), and r(H) <= p(H) + eps for every H.
That it is attained, A(eps) = min(1, A(0) + eps), is not proved here; the LP equals it on every one of 360
random instances (V = 2..4, K = 1..3, both sampled draft laws, eps = 1/20 and 1/5) and tests/test_audit.py
checks a sample of them.
"""

from __future__ import annotations

from collections import defaultdict
from fractions import Fraction

import numpy as np

from specresearch.exact import lp
from specresearch.exact.paths import draft_paths_law
from specresearch.exact.single import as_model
from specresearch.exact.theory_multi import optimal_acceptance_iid

__all__ = ["frontier_closed_form", "frontier_float", "lossy_frontier"]


def _eps(eps) -> Fraction:
    value = Fraction(str(eps)) if isinstance(eps, float) else Fraction(eps)
    if not 0 <= value <= 1:
        raise ValueError(f"eps must be a total-variation budget in [0, 1], got {eps!r}")
    return value


def lossy_frontier(target, draft, eps, *, num_drafts: int = 1, draft_law: str = "iid", prefix=()) -> Fraction:
    """A(eps): the largest P(Y in drafts) of any rule whose emitted token is within TV ``eps`` of p, exactly (LP).

    Args:
        target, draft: models (:func:`specresearch.exact.as_model`); the rows at ``prefix`` are used.
        eps: the total-variation budget, in [0, 1] (a float is read as the decimal it prints as).
        num_drafts, draft_law: K drafts drawn by ``draft_law`` (``"iid"``, ``"without_replacement"``, ``"topk"``).
    Returns:
        The optimum, a Fraction. Variables pi(s, y) over the drafted token sets s and every token y, plus a
        slack t_y >= r(y) - p(y) per token with sum t <= eps.
    """
    target, draft, prefix, eps = as_model(target), as_model(draft), tuple(prefix), _eps(eps)
    p_row = target(prefix)
    if len(draft(prefix)) != len(p_row):
        raise ValueError(f"target and draft must share a vocabulary: rows of {len(p_row)} and {len(draft(prefix))} entries")
    sets: dict = defaultdict(Fraction)
    for paths, prob in draft_paths_law(draft, num_drafts, 1, draft_law, prefix).items():
        sets[frozenset(path[0] for path in paths)] += prob
    vocab, names = len(p_row), [(s, y) for s in sets for y in range(len(p_row))]
    n = len(names) + vocab  # the last V columns are the slacks t_y
    objective = {c: Fraction(1) for c, (s, y) in enumerate(names) if y in s}
    eqs = [({c: Fraction(1) for c, (s2, _) in enumerate(names) if s2 == s}, mass) for s, mass in sets.items()]
    ineqs = [({**{c: Fraction(1) for c, (_, y2) in enumerate(names) if y2 == y}, len(names) + y: Fraction(-1)}, p_row[y])
             for y in range(vocab)]
    ineqs.append(({len(names) + y: Fraction(1) for y in range(vocab)}, eps))
    value, _ = lp.solve(objective, eqs, ineqs, n)
    return value


def frontier_closed_form(target, draft, eps, *, num_drafts: int = 1, draft_law: str = "iid", prefix=()) -> Fraction:
    """min(1, A(0) + eps), A(0) the lossless optimum (:func:`specresearch.exact.lp.optimal_acceptance_closed_form`).
    Equal to :func:`lossy_frontier` for K = 1 (module docstring)."""
    lossless = lp.optimal_acceptance_closed_form(target, draft, num_drafts, draft_law, prefix)
    return min(Fraction(1), lossless + _eps(eps))


def frontier_float(target_probs, draft_probs, eps, num_drafts: int = 1) -> np.ndarray:
    """The frontier for full-vocabulary next-token laws (i.i.d. drafts), in float64: min(1, A(0) + eps).

    Args:
        target_probs, draft_probs: ``[V]`` probability rows (numpy or torch).
        eps: a budget or an array of budgets.
    Returns:
        ``[len(eps)]`` (or a scalar array) of acceptances; A(0) = alpha for K = 1 and the i.i.d. optimum of
        :func:`specresearch.exact.theory_multi.optimal_acceptance_iid` for K > 1.
    """
    p, q = (np.asarray(x, dtype=np.float64) for x in (target_probs, draft_probs))
    lossless = np.minimum(p, q).sum() if num_drafts == 1 else optimal_acceptance_iid(p, q, num_drafts)
    return np.minimum(1.0, lossless + np.asarray(eps, dtype=np.float64))
