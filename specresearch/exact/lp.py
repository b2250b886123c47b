"""The best any valid verifier can do: an exact linear program over one speculative step.

Notation as in :mod:`specresearch`: p = target, q = draft, gamma = draft block length. One step draws a
draft block X = x_1..x_gamma from q and a verifier emits Z = (accepted prefix of X) + one token, so
|Z| is in 1..gamma+1 and Z[:-1] is a prefix of X. The number of accepted drafts is |Z| - 1.

Validity (Sun et al. 2025, "Block Verification Accelerates Speculative Decoding", arXiv 2403.10444: a
valid verifier keeps the target's output distribution; Theorem 2 is optimality among valid verifiers):
the speculative loop must reproduce the target's law from *every* prefix. The derivation below is ours. Taking the first gamma+1 tokens of the loop from a prefix c, the loop emits Z and then continues
from c + Z, which (by validity at the longer prefix) has the target's law. Hence a verifier is valid at c
if and only if "Z, then tokens from the target" has the target's law on V^(gamma+1):

    (L)  for every y in V^(gamma+1):  sum_{k=1}^{gamma+1} P(Z = y[:k]) p(y[k:] | c + y[:k]) = p(y | c).

(Sufficiency is the induction over steps; necessity is the argument above.) The lower-length
conditions follow by summing (L) over the last tokens.

Two exact formulations of "maximise E[|Z| - 1] over valid verifiers" are provided:

* ``"coupling"`` -- variables pi(x, z) = P(X = x, Z = z) >= 0 for every draft block x with q(x) > 0 and
  every z with z[:-1] a prefix of x; constraints sum_z pi(x, z) = q(x) and (L) with
  P(Z = z) = sum_x pi(x, z). This is literally "all joint laws of (draft, output)"; the verifier may
  even look at the whole models, so its optimum upper-bounds every valid verifier.
* ``"prefix"`` (default, much smaller) -- variables m(z) = P(Z = z) only, with (L) and, for every
  prefix u of length 0..gamma, the Hall condition P(Z[:-1] extends u) <= q(u): the probability of
  accepting at least the drafts u cannot exceed the probability of drafting u. The prefixes form a
  laminar family (a tree), so by Hall's theorem for transportation problems these inequalities are
  exactly the condition for a coupling pi with marginals q and m to exist: both formulations have
  the same optimum (checked in tests/test_lp.py).

Multi-draft steps (``num_drafts`` = K paths drawn by a draft law of :mod:`specresearch.exact.multi`)
use the coupling formulation with x = the K-tuple of paths and z[:-1] a prefix of one of them; the
Hall inequalities of ``"prefix"`` are not enough there (the prefixes of K paths are not laminar).
:func:`optimal_acceptance` is the single-step (L = 1) optimum, as an LP and in closed form.

Both are solved in exact rational arithmetic with sympy's simplex (``sympy.solvers.simplex.linprog``,
the matrix form of ``lpmax``).
"""

from __future__ import annotations

import itertools
import random
from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction

import sympy
from sympy.solvers.simplex import linprog

from specresearch.checks import check_int
from specresearch.exact.multi import expected_accepted_multi
from specresearch.exact.paths import _check_draft_law, draft_paths_law
from specresearch.exact.single import as_model, expected_accepted, verify_exact

__all__ = [
    "LPResult",
    "VerifierCheck",
    "check_joint",
    "check_verifier",
    "compare_with_lp",
    "compare_multi",
    "two_symbol_grid",
    "continuation_law",
    "optimal_acceptance",
    "optimal_acceptance_closed_form",
    "optimal_verifier_lp",
    "solve",
    "verifier_joint",
]

FORMULATIONS = ("prefix", "coupling")


@dataclass(frozen=True)
class LPResult:
    """Exact optimum of E[accepted drafts] over all valid verifiers for one step.

    ``step_law`` is the law of the emitted sequence Z at an optimal vertex (one optimal verifier).
    """

    optimum: Fraction
    step_law: dict
    num_variables: int
    num_constraints: int
    formulation: str


@dataclass(frozen=True)
class VerifierCheck:
    """Whether a verifier's joint law of (draft block, emitted sequence) is LP-feasible (i.e. valid)."""

    feasible: bool
    objective: Fraction  # E[accepted drafts] = E[|Z|] - 1 under the joint
    violations: tuple[str, ...]  # human-readable failed constraints (empty iff feasible)


def continuation_law(step_law: dict, target, gamma: int, prefix: tuple = ()) -> dict:
    """Law on V^(gamma+1) of "emit Z, then sample the remaining tokens from the target" (condition (L)).

    Works for any numbers closed under + and * (Fraction, sympy expressions).
    Args:
        step_law: {emitted sequence z (1 <= |z| <= gamma+1): P(Z = z)}.
        target: callable ``prefix tuple -> row of V probabilities``.
    Returns:
        {y: sum_k P(Z = y[:k]) p(y[k:] | prefix + y[:k])} for every y in V^(gamma+1).
    """
    vocab = len(target(tuple(prefix)))
    out = {}
    for y in itertools.product(range(vocab), repeat=gamma + 1):
        terms = [step_law[y[:k]] * _path_prob(target, tuple(prefix) + y[:k], y[k:]) for k in range(1, gamma + 2) if y[:k] in step_law]
        out[y] = sum(terms[1:], terms[0]) if terms else 0
    return out


def _path_prob(target, context: tuple, tokens: tuple):
    """p(tokens | context) as a product of target rows (1 for the empty continuation)."""
    prob = 1
    for i, token in enumerate(tokens):
        prob = prob * target(context + tokens[:i])[token]
    return prob


def _blocks(draft, gamma: int, prefix: tuple) -> dict:
    """{draft block x: q(x)} over blocks of positive probability."""
    blocks = {(): Fraction(1)}
    for _ in range(gamma):
        blocks = {x + (t,): qx * qt for x, qx in blocks.items() for t, qt in enumerate(draft(prefix + x)) if qt}
    return blocks


def _prefix_masses(blocks: dict) -> dict:
    """{u: q(u)} for every prefix u (length 0..gamma) of a positive-probability block."""
    masses: dict = defaultdict(Fraction)
    for x, qx in blocks.items():
        for k in range(len(x) + 1):
            masses[x[:k]] += qx
    return dict(masses)


def _check_args(gamma, formulation, target=None, draft=None, prefix=()) -> None:
    check_int("gamma", gamma)
    if formulation not in FORMULATIONS:
        raise ValueError(f"formulation must be one of {FORMULATIONS}, got {formulation!r}")
    if target is not None and len(target(prefix)) != len(draft(prefix)):
        raise ValueError(f"target and draft must share a vocabulary, got rows of {len(target(prefix))} and {len(draft(prefix))} at prefix {prefix}")


def optimal_verifier_lp(
    target, draft, gamma: int, prefix=(), *, formulation: str = "prefix", num_drafts: int = 1, draft_law: str = "iid"
) -> LPResult:
    """Exact max of E[accepted drafts] over all valid verifiers of one step (Sun et al. 2025, Thm 2).

    Args:
        target, draft: models as accepted by :func:`specresearch.exact.as_model`.
        gamma: draft block length (path length L) >= 1.
        prefix: the context of the step.
        formulation: ``"prefix"`` (small, default) or ``"coupling"`` (joint pi(x, z)); see the module
            docstring. Both give the same optimum. Multi-draft steps always use ``"coupling"``.
        num_drafts, draft_law: K paths drawn by ``draft_law`` (:func:`specresearch.exact.paths.draft_paths_law`);
            the verifier may accept any prefix of any of them.
    Returns:
        :class:`LPResult`; block verification attains ``optimum`` for K = 1 (tests/test_lp.py, proofs/t5).
        ``benchmarks/bench_exact.py`` (task ``lp_multi``) times the multi-draft sizes.
    """
    target, draft, prefix = as_model(target), as_model(draft), tuple(prefix)
    _check_args(gamma, formulation, target, draft, prefix)
    if num_drafts != 1 or draft_law != "iid":
        law = draft_paths_law(draft, num_drafts, gamma, draft_law, prefix)
        names, objective, eqs, ineqs = _multi_coupling_lp(target, law, gamma, prefix)
        value, solution = _solve_robust(objective, eqs, ineqs, len(names))
        formulation = "coupling"
    else:
        build = _prefix_lp if formulation == "prefix" else _coupling_lp
        names, objective, eqs, ineqs = build(target, draft, gamma, prefix)
        value, solution = _solve(objective, eqs, ineqs, len(names))
    law: dict = defaultdict(Fraction)
    for name, v in zip(names, solution):
        if v:
            law[name[-1]] += v
    return LPResult(value, dict(law), len(names), len(eqs) + len(ineqs), formulation)


def _emittable(target, gamma: int, prefix: tuple) -> list:
    """Every z (1 <= |z| <= gamma+1) of positive target probability (others are forced to 0 by (L))."""
    out, frontier = [], [()]
    for _ in range(gamma + 1):
        frontier = [z + (t,) for z in frontier for t, pt in enumerate(target(prefix + z)) if pt]
        out += frontier
    return out


def _validity_rows(names: list, target, gamma: int, prefix: tuple) -> list:
    """Condition (L) as sparse rows ({column: coefficient}, right-hand side); z = name[-1]."""
    by_z: dict = defaultdict(list)
    for col, name in enumerate(names):
        by_z[name[-1]].append(col)
    vocab = len(target(prefix))
    rows = []
    for y in itertools.product(range(vocab), repeat=gamma + 1):
        row = {c: _path_prob(target, prefix + y[:k], y[k:]) for k in range(1, gamma + 2) for c in by_z.get(y[:k], ())}
        row = {c: v for c, v in row.items() if v}
        rhs = _path_prob(target, prefix, y)
        if row or rhs:
            rows.append((row, rhs))
    return rows


def _prefix_lp(target, draft, gamma: int, prefix: tuple):
    """Variables m(z); (L) equalities; Hall inequalities P(Z[:-1] extends u) <= q(u)."""
    names = [(z,) for z in _emittable(target, gamma, prefix)]
    objective = {c: Fraction(len(n[0]) - 1) for c, n in enumerate(names)}
    masses = _prefix_masses(_blocks(draft, gamma, prefix))
    ineqs = []
    for u in itertools.chain.from_iterable(itertools.product(range(len(target(prefix))), repeat=k) for k in range(gamma + 1)):
        row = {c: Fraction(1) for c, (z,) in enumerate(names) if len(z) > len(u) and z[: len(u)] == u}
        if row:
            ineqs.append((row, masses.get(u, Fraction(0))))
    return names, objective, _validity_rows(names, target, gamma, prefix), ineqs


def _coupling_lp(target, draft, gamma: int, prefix: tuple):
    """Variables pi(x, z) for z[:-1] a prefix of x; draft marginals and (L) as equalities."""
    blocks, emittable = _blocks(draft, gamma, prefix), _emittable(target, gamma, prefix)
    names = [(x, z) for x in blocks for z in emittable if x[: len(z) - 1] == z[:-1]]
    objective = {c: Fraction(len(n[1]) - 1) for c, n in enumerate(names)}
    marginals = [({c: Fraction(1) for c, n in enumerate(names) if n[0] == x}, qx) for x, qx in blocks.items()]
    return names, objective, marginals + _validity_rows(names, target, gamma, prefix), []


def _multi_coupling_lp(target, paths_law: dict, gamma: int, prefix: tuple):
    """Variables pi(paths, z) for z[:-1] a prefix of one of the K paths; draft marginals and (L).

    Only the set of drafted paths matters to what may be emitted, so drafts are merged by that set.
    """
    emittable = _emittable(target, gamma, prefix)
    merged: dict = defaultdict(Fraction)
    for paths, prob in paths_law.items():
        merged[frozenset(paths)] += prob
    paths_law, names = dict(merged), []
    for paths in paths_law:
        prefixes = {path[:k] for path in paths for k in range(gamma + 1)}
        names += [(paths, z) for z in emittable if z[:-1] in prefixes]
    objective = {c: Fraction(len(n[1]) - 1) for c, n in enumerate(names)}
    columns: dict = defaultdict(dict)
    for c, (paths, _) in enumerate(names):
        columns[paths][c] = Fraction(1)
    marginals = [(columns[paths], prob) for paths, prob in paths_law.items()]
    return names, objective, marginals + _validity_rows(names, target, gamma, prefix), []


def _first_token_law(draft, num_drafts: int, draft_law: str, prefix: tuple) -> dict:
    """{(X_1, ..., X_K): Q} for one step of length 1."""
    _check_draft_law(draft_law)
    return {tuple(path[0] for path in paths): prob for paths, prob in draft_paths_law(draft, num_drafts, 1, draft_law, prefix).items()}


def optimal_acceptance(target, draft, num_drafts: int = 1, draft_law: str = "iid", prefix=()) -> Fraction:
    """The best single-step multi-draft acceptance, max P(Y in {X_1..X_K}), as an exact LP.

    Sun et al., SpecTr (NeurIPS 2023, arXiv 2310.15141), optimal transport with cost 1{y not in x}:
    maximise sum pi(x, y) 1{y in x} over couplings pi of the K-draft law Q (``draft_law``) and Y ~ p.
    For K = 1 this is alpha = sum_x min(p, q). Equal to :func:`optimal_acceptance_closed_form`.

    Args:
        target, draft: models (:func:`specresearch.exact.as_model`); rows are read at ``prefix``.
        num_drafts: K >= 1.
        draft_law: ``"iid"`` or ``"without_replacement"``.
    Returns:
        The optimum, an exact Fraction (an LP with rational data has a rational optimum).
    """
    target, draft, prefix = as_model(target), as_model(draft), tuple(prefix)
    _check_args(1, "prefix", target, draft, prefix)
    p_row = target(prefix)
    # Only the set of drafted tokens matters to the objective: couple Y with that set (smaller LP).
    sets: dict = defaultdict(Fraction)
    for x, qx in _first_token_law(draft, num_drafts, draft_law, prefix).items():
        sets[frozenset(x)] += qx
    ys = [y for y, py in enumerate(p_row) if py]
    names = [(s, y) for s in sets for y in ys]
    objective = {c: Fraction(1) for c, (s, y) in enumerate(names) if y in s}
    eqs = [({c: Fraction(1) for c, n in enumerate(names) if n[0] == s}, qs) for s, qs in sets.items()]
    # the last target marginal is implied by the others (both sides sum to 1): dropping it keeps
    # sympy's simplex away from the degenerate, oscillating case
    eqs += [({c: Fraction(1) for c, n in enumerate(names) if n[1] == y}, p_row[y]) for y in ys[:-1]]
    value, _ = _solve_robust(objective, eqs, [], len(names))
    return value


def optimal_acceptance_closed_form(target, draft, num_drafts: int = 1, draft_law: str = "iid", prefix=()) -> Fraction:
    """min over token sets H of [p(H) + 1 - Q(X_1..X_K all in H)], exactly, by enumerating the 2^V sets.

    The min-cut / Hall form of :func:`optimal_acceptance` (SpecTr; Hu et al., ICLR 2025, arXiv
    2502.18779). For every H, P(Y not in X) >= P(all X in H, Y not in H) >= Q(all X in H) - p(H), so
    P(Y in X) <= p(H) + 1 - Q(all in H); max-flow = min-cut on the bipartite graph "x covers y" says
    the smallest of these bounds is attained.
    For i.i.d. drafts Q(all in H) = q(H)^K; the optimal H is then a prefix of the tokens sorted by
    p/q (see :func:`specresearch.exact.theory_multi.optimal_acceptance_iid`).
    """
    target, draft, prefix = as_model(target), as_model(draft), tuple(prefix)
    _check_args(1, "prefix", target, draft, prefix)
    law, p_row = _first_token_law(draft, num_drafts, draft_law, prefix), target(prefix)
    best = Fraction(1)
    for size in range(len(p_row) + 1):
        for subset in itertools.combinations(range(len(p_row)), size):
            inside = set(subset)
            all_in = sum((qx for x, qx in law.items() if inside.issuperset(x)), Fraction(0))
            best = min(best, sum((p_row[t] for t in subset), Fraction(0)) + 1 - all_in)
    return best


def _matrix(rows: list, n: int):
    if not rows:
        return None, None
    a = sympy.zeros(len(rows), n)
    for i, (row, _) in enumerate(rows):
        for c, v in row.items():
            a[i, c] = sympy.Rational(v.numerator, v.denominator) if isinstance(v, Fraction) else v
    b = sympy.Matrix([sympy.Rational(r.numerator, r.denominator) for _, r in rows])
    return a, b


def _solve(objective: dict, eqs: list, ineqs: list, n: int):
    """Maximise objective . v subject to eqs (=), ineqs (<=), v >= 0; exact rational simplex."""
    cost = sympy.Matrix([-sympy.Rational(objective.get(c, 0)) for c in range(n)]).T
    a_ub, b_ub = _matrix(ineqs or [({}, Fraction(1))], n)  # linprog needs an A_ub; 0 <= 1 is harmless
    a_eq, b_eq = _matrix(eqs, n)
    value, solution = linprog(cost, a_ub, b_ub, a_eq, b_eq)
    return _to_fraction(-value), [_to_fraction(v) for v in solution]


def _solve_robust(objective: dict, eqs: list, ineqs: list, n: int):
    """:func:`_solve`, retried on sympy's "oscillating system" error of degenerate problems.

    The multi-draft LPs are degenerate transportation problems on which sympy's simplex sometimes
    stops with ``InfeasibleLPError("Oscillating system ...")`` although they are feasible. Retries, in
    order: the same LP with every equality written as two inequalities, then the equality form with
    the columns in a few fixed pseudo-random orders. An answer is returned only if its argmax satisfies
    every constraint exactly and attains the returned value (sympy's argmax is sometimes inconsistent).
    """
    from sympy.solvers.simplex import InfeasibleLPError

    split = ineqs + eqs + [({c: -v for c, v in row.items()}, -rhs) for row, rhs in eqs]
    attempts = [(list(range(n)), eqs, ineqs), (list(range(n)), [], split)]
    for seed in range(3):
        order = list(range(n))
        random.Random(seed).shuffle(order)
        attempts.append((order, eqs, ineqs))
    for order, e, i in attempts:
        where = {c: k for k, c in enumerate(order)}  # column c of the LP is variable where[c]
        move = lambda rows: [({where[c]: v for c, v in row.items()}, rhs) for row, rhs in rows]
        try:
            value, moved = _solve({where[c]: v for c, v in objective.items()}, move(e), move(i), n)
        except InfeasibleLPError:
            continue
        solution = [moved[where[c]] for c in range(n)]
        feasible = all(v >= 0 for v in solution)
        feasible = feasible and all(sum(row[c] * solution[c] for c in row) == rhs for row, rhs in eqs)
        feasible = feasible and all(sum(row[c] * solution[c] for c in row) <= rhs for row, rhs in ineqs)
        objective_value = sum((v * solution[c] for c, v in objective.items()), Fraction(0))
        if feasible and objective_value == value:  # sympy sometimes returns a wrong argmax: retry
            return value, solution
    raise InfeasibleLPError("sympy's simplex gave no exactly feasible optimum on any reformulation of this LP")


def solve(objective: dict, eqs: list, ineqs: list, num_variables: int) -> tuple[Fraction, list]:
    """Maximise ``objective`` . v subject to ``eqs`` (=), ``ineqs`` (<=) and v >= 0, exactly.

    Rows are ``({column: coefficient}, right-hand side)`` with Fraction coefficients; returns ``(optimum,
    solution)`` as Fractions, checked feasible (the robust retries of this module's LPs).
    """
    return _solve_robust(objective, eqs, ineqs, num_variables)


def _to_fraction(value) -> Fraction:
    value = sympy.nsimplify(value) if not isinstance(value, sympy.Rational) else value
    assert value.is_Rational, f"LP produced a non-rational value {value!r}"
    return Fraction(int(value.p), int(value.q))


def verifier_joint(target, draft, gamma: int, method, prefix=()) -> dict:
    """Joint law {(draft block x, emitted z): P(X = x, Z = z)} of a verifier, from exact.verify_exact."""
    target, draft, prefix = as_model(target), as_model(draft), tuple(prefix)
    joint: dict = defaultdict(Fraction)
    for x, qx in _blocks(draft, gamma, prefix).items():
        ps = [target(prefix + x[:i]) for i in range(gamma + 1)]
        qs = [draft(prefix + x[:i]) for i in range(gamma)]
        for (n, token), prob in verify_exact(ps, qs, list(x), method).items():
            if prob:
                joint[(x, x[:n] + (token,))] += qx * prob
    return dict(joint)


def check_joint(target, draft, gamma: int, joint: dict, prefix=()) -> VerifierCheck:
    """Check a joint law of (draft block, emitted sequence) against every LP constraint, exactly.

    Constraints: non-negativity, z[:-1] a prefix of x, draft marginals q(x), and validity (L).
    """
    target, draft, prefix = as_model(target), as_model(draft), tuple(prefix)
    _check_args(gamma, "prefix", target, draft, prefix)
    violations = [f"pi{k} = {v} < 0" for k, v in joint.items() if v < 0]
    violations += [f"z = {z} is not (prefix of x = {x}) + token" for x, z in joint if not 1 <= len(z) <= gamma + 1 or x[: len(z) - 1] != z[:-1]]
    marginal: dict = defaultdict(Fraction)
    step: dict = defaultdict(Fraction)
    for (x, z), v in joint.items():
        marginal[x] += v
        step[z] += v
    blocks = _blocks(draft, gamma, prefix)
    violations += [f"sum_z pi(x={x}, z) = {marginal.get(x, 0)} != q(x) = {qx}" for x, qx in blocks.items() if marginal.get(x, 0) != qx]
    violations += [f"pi has mass on x = {x} with q(x) = 0" for x in marginal if x not in blocks]
    law = continuation_law(dict(step), target, gamma, prefix)
    violations += [f"(L) at y = {y}: {v} != p(y) = {_path_prob(target, prefix, y)}" for y, v in law.items() if v != _path_prob(target, prefix, y)]
    objective = sum((v * (len(z) - 1) for (_, z), v in joint.items()), Fraction(0))
    return VerifierCheck(not violations, objective, tuple(violations))


def check_verifier(target, draft, gamma: int, method, prefix=()) -> VerifierCheck:
    """:func:`check_joint` of :func:`verifier_joint`: is ``method`` a valid verifier on this instance?"""
    return check_joint(target, draft, gamma, verifier_joint(target, draft, gamma, method, prefix), prefix)


def compare_with_lp(target, draft, gamma: int, methods=("block", "token"), prefix=()) -> dict:
    """{"lp": LP optimum, method: E[accepted drafts] of each method}, all exact Fractions.

    Sun et al. 2025 (arXiv 2403.10444), Thm 2: block verification attains the LP optimum; token
    verification (Leviathan et al.) may fall strictly below it (the two-symbol post: 10/9 vs 11/9).
    """
    out = {"lp": optimal_verifier_lp(target, draft, gamma, prefix).optimum}
    out.update({m: expected_accepted(target, draft, gamma, m, prefix) for m in methods})
    return out


def compare_multi(target, draft, num_drafts: int, gamma: int, methods, draft_law: str = "iid", prefix=()) -> dict:
    """{"lp": optimum over all valid verifiers of K paths, method: E[accepted drafts]}, exact.

    The optimum is :func:`optimal_acceptance` for gamma = 1 and :func:`optimal_verifier_lp` over K
    paths otherwise; K-SEQ values may be sympy surds. Used for notebook 08's two-symbol table.
    """
    if gamma == 1:
        optimum = optimal_acceptance(target, draft, num_drafts, draft_law, prefix)
    else:
        optimum = optimal_verifier_lp(target, draft, gamma, prefix, num_drafts=num_drafts, draft_law=draft_law).optimum
    out = {"lp": optimum}
    out.update({m: expected_accepted_multi(target, draft, num_drafts, gamma, m, prefix, draft_law) for m in methods})
    return out


def two_symbol_grid(values, gamma: int) -> list[dict]:
    """One record per (p(A), q(A)) in values x values with 0 < q(A) < 1: i.i.d. two-symbol target
    (p(A), 1 - p(A)) and draft (q(A), 1 - q(A)); fields p_A, q_A, gamma, lp, block, token (Fractions).
    The grid of the two-symbol post's counterexample, for notebook 03."""
    rows = []
    for p_a, q_a in itertools.product(values, values):
        if 0 < q_a < 1:
            values_ = compare_with_lp((p_a, 1 - p_a), (q_a, 1 - q_a), gamma)
            rows.append({"p_A": p_a, "q_A": q_a, "gamma": gamma, **values_})
    return rows
