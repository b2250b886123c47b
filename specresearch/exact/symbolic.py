"""Symbolic (sympy) derivations behind the proofs in ``proofs/`` and notebooks 02-04.

Each ``*_checks`` function returns a tuple of :class:`Check` records: a claim, whether sympy verified it,
and the simplified residual (lhs - rhs) so a failure shows what is left. ``proofs/*.py`` print them with
:func:`run_checks`, which returns a non-zero exit code if any check fails.

Notation as in :mod:`specresearch`: p = target, q = draft (as in Leviathan et al. 2023; some write-ups swap
them), beta = sum_x min(p(x), q(x)), alpha = E[beta], gamma = block length, c = draft/target cost.

Case splits. sympy cannot decide ``Min(p, q)`` for free positive symbols, so identities with min/max are
proved case by case with a substitution that makes the order visible to sympy's assumptions:
``p = q (1 + d)`` (p >= q) or ``p = q (1 - e)`` (p <= q) with ``d, e >= 0``; sympy then evaluates every
Min/Max/Abs itself and the identity is checked by rational simplification.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass

import sympy as sp

__all__ = [
    "BlockCase",
    "Check",
    "NumericOracle",
    "acceptance_rate_checks",
    "block_lossless_cases",
    "block_step_law",
    "corollary_3_9_checks",
    "expected_tokens_checks",
    "identity",
    "run_checks",
    "token_derivation",
    "token_lossless_checks",
    "walltime_checks",
]


@dataclass(frozen=True)
class Check:
    """One machine-checked claim: ``holds`` is True iff sympy proved it; ``residual`` = lhs - rhs."""

    claim: str
    holds: bool
    residual: object = 0


def _is_zero(expr) -> bool:
    expr = sp.sympify(expr)
    if expr == 0:
        return True
    expr = sp.cancel(sp.together(sp.expand(expr)))
    return expr == 0 or sp.simplify(expr) == 0


def identity(claim: str, lhs, rhs) -> Check:
    """Check that ``lhs == rhs`` as an identity of rational functions (after sympy simplification)."""
    residual = sp.sympify(lhs) - sp.sympify(rhs)
    holds = _is_zero(residual)
    return Check(claim, holds, 0 if holds else sp.simplify(residual))


def run_checks(title: str, checks) -> int:
    """Print every check (PROVED / FAILED) and return the exit code: 0 iff all hold and there is one."""
    checks = list(checks)
    print(title)
    for check in checks:
        status = "PROVED" if check.holds else f"FAILED (residual {check.residual})"
        print(f"  [{status}] {check.claim}")
    failed = sum(not c.holds for c in checks)
    print(f"{len(checks) - failed}/{len(checks)} checks hold")
    return 0 if checks and not failed else 1


# ----------------------------------------------------------------------------- case substitutions


def _ordered_pair(q, index: int, above: bool):
    """p = q (1 + d) if ``above`` (p >= q) else q (1 - e); d, e >= 0 so sympy sees the order."""
    slack = sp.Symbol(f"{'d' if above else 'e'}{index}", nonnegative=True)
    return q * (1 + slack) if above else q * (1 - slack)


def _pattern_vectors(n: int, pattern):
    """q_1..q_n > 0 and p_i ordered against q_i by ``pattern`` (True: p_i >= q_i)."""
    qs = sp.symbols(f"q1:{n + 1}", positive=True)
    return [_ordered_pair(q, i + 1, above) for i, (q, above) in enumerate(zip(qs, pattern))], list(qs)


# ----------------------------------------------------------------------------- theorem 1 (token)


def _token_law(ps, qs, j):
    """P(X = x_j) of one token-verification step (Leviathan et al. 2023, arXiv 2211.17192): accept + reject * residual."""
    accept = [q * sp.Min(1, p / q) for p, q in zip(ps, qs)]
    residual = [sp.Max(0, p - q) for p, q in zip(ps, qs)]
    return accept[j] + (1 - sum(accept)) * residual[j] / sum(residual)


def _per_token_checks() -> list:
    p, q, beta = sp.symbols("p q beta", positive=True)
    out = []
    for above in (True, False):
        pv = _ordered_pair(q, 0, above)
        case = "p >= q" if above else "p <= q"
        law = q * sp.Min(1, pv / q) + (1 - beta) * sp.Max(0, pv - q) / (1 - beta)
        out.append(identity(f"[{case}] q min(1, p/q) + (1-beta) max(0, p-q)/(1-beta) = p", law, pv))
        out.append(identity(f"[{case}] q min(1, p/q) = min(p, q)", q * sp.Min(1, pv / q), sp.Min(pv, q)))
        out.append(identity(f"[{case}] max(0, p-q) = p - min(p, q)", sp.Max(0, pv - q), pv - sp.Min(pv, q)))
    return out


def _normaliser_checks(n: int) -> list:
    """sum max(0, p-q) = 1 - beta and P(X = x_j) = p_j for every order pattern of an n-vector."""
    out = []
    for pattern in itertools.product((True, False), repeat=n):
        ps, qs = _pattern_vectors(n, pattern)
        beta = sum(sp.Min(p, q) for p, q in zip(ps, qs))
        constraint = sum(ps) - 1  # = 0 for a distribution
        norm = sum(sp.Max(0, p - q) for p, q in zip(ps, qs))
        out.append(identity(f"n={n} {_pattern_name(pattern)}: sum max(0,p-q) - (1-beta) = sum p - 1", norm - (1 - beta), constraint))
        if any(pattern) and not all(pattern):  # otherwise sum p = sum q forces p = q: _degenerate_checks
            out.append(_token_law_check(n, pattern, ps, qs))
    return out


def _pattern_name(pattern) -> str:
    return "".join(">" if above else "<" for above in pattern)


def _token_law_check(n: int, pattern, ps, qs) -> Check:
    """P(X = x_j) = p_j for all j after imposing sum q = 1 and sum p = sum q (eliminating one slack)."""
    laws = [_token_law(ps, qs, j) - ps[j] for j in range(n)]  # Min/Max resolved here, under the pattern
    slack = sp.Symbol(f"d{pattern.index(True) + 1}", nonnegative=True)
    gap = sp.expand(sum(ps) - sum(qs))  # linear in the slack; solve gap = 0 without assuming a sign
    solved = -gap.subs(slack, 0) / sp.diff(gap, slack)
    last = {qs[-1]: 1 - sum(qs[:-1])}
    residual = sum(sp.cancel(sp.together(r.subs(slack, solved).subs(last))) ** 2 for r in laws)
    return identity(f"n={n} {_pattern_name(pattern)}: P(X = x_j) = p_j for all j (given sum p = sum q = 1)", residual, 0)


def _linear_sum(summand, index):
    """Sum over ``index`` split by linearity, constants pulled out (sympy's own Sum rules)."""
    return sp.Add(*[sp.simplify(term) for term in sp.Add.make_args(sp.Sum(summand, index).expand())])


def _general_n_checks() -> list:
    """General n: sum_i max(0, p_i - q_i) = sum_i (p_i - min_i) = 1 - beta by linearity of Sum."""
    i, n = sp.symbols("i n", integer=True, positive=True)
    p, m = sp.IndexedBase("p"), sp.IndexedBase("m")  # m_i = min(p_i, q_i), rewritten per term above
    one_minus_beta = _linear_sum(p[i] - m[i], (i, 1, n)).subs(sp.Sum(p[i], (i, 1, n)), 1)
    return [identity("general n: sum_i (p_i - min(p_i, q_i)) = 1 - sum_i min(p_i, q_i) given sum_i p_i = 1", one_minus_beta, 1 - sp.Sum(m[i], (i, 1, n)))]


def _degenerate_checks() -> list:
    """beta = 1 (all p_i <= q_i) and the all-(p_i >= q_i) pattern: equal sums force p = q, so every
    draft is accepted and P(X = x_j) = q_j min(1, p_j/q_j) = p_j."""
    out = []
    for n in range(2, 7):
        for above in (False, True):
            ps, qs = _pattern_vectors(n, (above,) * n)
            slacks = sorted(set().union(*(p.free_symbols for p in ps)) - set(qs), key=str)
            gap = sp.expand(sum(ps) - sum(qs))  # +-sum_i q_i slack_i: every term has one sign
            one_sign = all((t.is_nonnegative if above else t.is_nonpositive) for t in sp.Add.make_args(gap))
            forced = one_sign and set(gap.free_symbols) >= set(slacks)
            name = f"n={n} {_pattern_name((above,) * n)}"
            out.append(Check(f"{name}: sum p - sum q = {'+' if above else '-'}sum_i q_i slack_i, one sign per term; = 0 forces p = q", forced, 0 if forced else gap))
        equal = [p.subs({s: 0 for s in slacks}) for p in ps]
        accepted = sum((q * sp.Min(1, pe / q) - pe) ** 2 for pe, q in zip(equal, qs))
        out.append(identity(f"n={n} p = q (beta = 1): P(X = x_j) = q_j min(1, p_j/q_j) = p_j, never rejects", accepted, 0))
    return out


def token_lossless_checks(max_n: int = 6) -> tuple[Check, ...]:
    """Theorem 1 of Leviathan et al. and Chen et al. 2023 (arXiv 2211.17192, 2302.01318): token verification returns x with probability p(x).

    Per-token identity (both orders), the normaliser sum_x max(0, p - q) = 1 - beta and P(X = x) = p(x)
    for every order pattern of vectors of size 2..max_n, the general-n normaliser, and beta = 1.
    """
    checks = _per_token_checks()
    for n in range(2, max_n + 1):
        checks += _normaliser_checks(n)
    return tuple(checks + _general_n_checks() + _degenerate_checks())


def token_derivation() -> tuple[tuple[str, object], ...]:
    """The steps of the proof of Theorem 1 (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318, in this package's notation) as
    (sentence, sympy equation) pairs for display (``sympy.latex``); each step is checked by
    :func:`token_lossless_checks`."""
    p, q, beta, z = sp.symbols("p(x) q(x) beta Z", positive=True)
    accept, reject = sp.Symbol(r"P(\mathrm{accept}, x)"), sp.Symbol(r"P(\mathrm{reject})")
    px = sp.Symbol("P(X = x)")
    return (
        ("Split on the draft being accepted", sp.Eq(px, accept + reject * sp.Max(0, p - q) / z, evaluate=False)),
        ("Acceptance (multiply through the min)", sp.Eq(accept, q * sp.Min(1, p / q), evaluate=False)),
        ("", sp.Eq(q * sp.Min(1, p / q), sp.Min(p, q), evaluate=False)),
        ("Rejection: one minus the total acceptance", sp.Eq(reject, 1 - beta, evaluate=False)),
        ("Normaliser, using max(0, a - b) = a - min(a, b) and sum p = 1", sp.Eq(z, 1 - beta, evaluate=False)),
        ("Together", sp.Eq(px, sp.Min(p, q) + sp.Max(0, p - q), evaluate=False)),
        ("", sp.Eq(sp.Min(p, q) + sp.Max(0, p - q), p, evaluate=False)),
    )


# ----------------------------------------------------------------------------- theorem 2 (beta = 1 - D_LK)


def acceptance_rate_checks(max_n: int = 6) -> tuple[Check, ...]:
    """Leviathan et al. 2023, the acceptance-rate lemma: D_LK(p, q) = sum |p - M| = sum |q - M| = 1 - sum min(p, q), M = (p+q)/2.

    For every order pattern of vectors of size 2..max_n; the residual must equal a multiple of the
    constraints sum p - 1 and sum q - 1 (shown identically), and for general n by linearity.
    """
    checks = []
    for n in range(2, max_n + 1):
        for pattern in itertools.product((True, False), repeat=n):
            ps, qs = _pattern_vectors(n, pattern)
            ms = [(p + q) / 2 for p, q in zip(ps, qs)]
            beta = sum(sp.Min(p, q) for p, q in zip(ps, qs))
            constraints = (sum(ps) - 1 + sum(qs) - 1) / 2
            name = f"n={n} {_pattern_name(pattern)}"
            checks.append(identity(f"{name}: sum|p-M| - (1 - beta) = (sum p - 1 + sum q - 1)/2", sum(sp.Abs(p - m) for p, m in zip(ps, ms)) - (1 - beta), constraints))
            checks.append(identity(f"{name}: sum|q-M| = sum|p-M|", sum(sp.Abs(q - m) for q, m in zip(qs, ms)), sum(sp.Abs(p - m) for p, m in zip(ps, ms))))
    return tuple(checks + _general_lemma_checks())


def _general_lemma_checks() -> list:
    p, q = sp.symbols("p q", positive=True)
    out = []
    for above in (True, False):
        pv = _ordered_pair(q, 0, above)
        out.append(identity(f"[{'p >= q' if above else 'p <= q'}] |p - (p+q)/2| = (p+q)/2 - min(p, q)", sp.Abs(pv - (pv + q) / 2), (pv + q) / 2 - sp.Min(pv, q)))
    i, n = sp.symbols("i n", integer=True, positive=True)
    P, Q, Mn = sp.IndexedBase("p"), sp.IndexedBase("q"), sp.IndexedBase("m")
    total = _linear_sum(P[i] / 2 + Q[i] / 2 - Mn[i], (i, 1, n)).subs({sp.Sum(P[i], (i, 1, n)): 1, sp.Sum(Q[i], (i, 1, n)): 1})
    out.append(identity("general n: sum_i ((p_i+q_i)/2 - min_i) = 1 - sum_i min_i given sum p = sum q = 1", total, 1 - sp.Sum(Mn[i], (i, 1, n))))
    return out


# ----------------------------------------------------------------------------- Leviathan et al. Sec. 3


ALPHA, GAMMA, COST = sp.Symbol("alpha", nonnegative=True), sp.Symbol("gamma", integer=True, positive=True), sp.Symbol("c", nonnegative=True)


def expected_tokens_checks() -> tuple[Check, ...]:
    """Leviathan et al. 2023, Eq. (1): E[tokens] = (1 - alpha^(gamma+1)) / (1 - alpha), gamma symbolic.

    The number N of accepted drafts (i.i.d. acceptances with probability alpha) has
    P(N = n) = alpha^n (1 - alpha) for n < gamma and P(N = gamma) = alpha^gamma; tokens = N + 1.
    """
    n = sp.Symbol("n", integer=True, nonnegative=True)
    closed = (1 - ALPHA ** (GAMMA + 1)) / (1 - ALPHA)
    mass = sp.piecewise_fold(sp.Sum(ALPHA**n * (1 - ALPHA), (n, 0, GAMMA - 1)).doit() + ALPHA**GAMMA)
    mean = sp.piecewise_fold(sp.Sum((n + 1) * ALPHA**n * (1 - ALPHA), (n, 0, GAMMA - 1)).doit() + (GAMMA + 1) * ALPHA**GAMMA)
    tail = sp.piecewise_fold(sp.Sum(ALPHA**n, (n, 0, GAMMA)).doit())
    return (
        identity("sum_n P(N = n) = 1 (alpha != 1 branch)", _generic_branch(mass), 1),
        identity("E[N + 1] = (1 - alpha^(gamma+1))/(1 - alpha) (alpha != 1 branch)", _generic_branch(mean), closed),
        identity("E[N + 1] = gamma + 1 at alpha = 1", mean.subs(ALPHA, 1), GAMMA + 1),
        identity("E[N + 1] = sum_{k=0}^{gamma} P(N >= k) = sum alpha^k (tail sum)", _generic_branch(tail), closed),
    )


def _generic_branch(expr):
    """The alpha != 1 branch of a Piecewise produced by summing a geometric series."""
    if isinstance(expr, sp.Piecewise):
        return next(e for e, cond in expr.args if cond == sp.true or cond.has(sp.Ne) or not cond.has(sp.Eq))
    return expr


def walltime_checks() -> tuple[Check, ...]:
    """Leviathan et al. Thm 3.8: a step costs (gamma c + 1) target calls and yields E[tokens], so the
    wall-time improvement over plain decoding (1 token per call) is E[tokens] / (gamma c + 1)."""
    tokens = (1 - ALPHA ** (GAMMA + 1)) / (1 - ALPHA)
    time_per_token = (GAMMA * COST + 1) / tokens  # in units of one target call
    return (identity("improvement = 1 / time_per_token = (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1))", 1 / time_per_token, (1 - ALPHA ** (GAMMA + 1)) / ((1 - ALPHA) * (GAMMA * COST + 1))),)


def corollary_3_9_checks() -> tuple[Check, ...]:
    """Leviathan et al. Cor. 3.9: gamma = 1 gives exactly (1 + alpha)/(1 + c), which exceeds 1 iff alpha > c."""
    at_one = ((1 - ALPHA ** (GAMMA + 1)) / ((1 - ALPHA) * (GAMMA * COST + 1))).subs(GAMMA, 1)
    gap = sp.Symbol("delta", positive=True)  # alpha = c + delta, delta > 0
    excess = sp.factor(((1 + ALPHA) / (1 + COST) - 1).subs(ALPHA, COST + gap))
    return (
        identity("improvement(gamma = 1) = (1 + alpha)/(1 + c)", at_one, (1 + ALPHA) / (1 + COST)),
        identity("(1 + alpha)/(1 + c) - 1 = (alpha - c)/(1 + c)", (1 + ALPHA) / (1 + COST) - 1, (ALPHA - COST) / (1 + COST)),
        Check("alpha = c + delta, delta > 0  =>  (1 + alpha)/(1 + c) - 1 > 0", bool(excess.is_positive), excess),
    )


# ----------------------------------------------------------------------------- theorem 4 (block, symbolic)


class _NeedBranch(Exception):
    """Raised by :class:`_Oracle` when a comparison has no recorded sign yet."""


def _obvious_sign(value) -> int:
    """+1 / -1 if every coefficient of numerator and denominator has one sign (positive symbols), else 0."""
    if value == 0:
        return 0
    if not hasattr(value, "numer"):  # a plain number
        return 1 if value > 0 else -1
    return _poly_sign(value.numer) * _poly_sign(value.denom)


def _poly_sign(poly) -> int:
    signs = {c > 0 for c in poly.coeffs()}
    return (1 if signs == {True} else -1) if len(signs) == 1 else 0


def _sign_key(value):
    """(key, sign) with sign(value) = sign * sign(key): the product of the factors of numerator and
    denominator whose sign is not obvious; obvious factors only contribute to ``sign``."""
    sign, key = 1, value.numer.ring.one
    for poly in (value.numer, value.denom):
        coeff, factors = poly.factor_list()
        sign *= 1 if coeff > 0 else -1
        for factor, power in factors:
            obvious = _poly_sign(factor)
            if obvious:
                sign *= obvious**power
            elif power % 2:
                key *= factor
    return key, sign


class _Oracle:
    """Answers 'is expr > 0?' for rational-function field elements from a fixed list of choices,
    recording the conditions it used; signs that follow from positivity of the symbols (or from an
    earlier answer about the same non-obvious factors) are not branched on again."""

    def __init__(self, choices: tuple):
        self.choices, self.conditions, self.facts, self._known = choices, [], [], {}

    def positive(self, expr) -> bool:
        obvious = _obvious_sign(expr)
        if obvious or expr == 0:
            return obvious > 0
        key, sign = _sign_key(expr)
        if key in self._known:
            positive = (self._known[key] * sign) > 0
            self.facts.append(expr if positive else -expr)
            return positive
        if len(self.conditions) == len(self.choices):
            raise _NeedBranch
        positive = self.choices[len(self.conditions)]
        self._known[key] = sign if positive else -sign
        self.conditions.append(expr if positive else -expr)  # recorded as "this expression > 0"
        self.facts.append(self.conditions[-1])
        return positive


class NumericOracle:
    """The oracle for exact numbers (Fractions): compares directly. Lets :func:`block_step_law` be
    checked against :func:`specresearch.exact.step_distribution` on rational instances."""

    @staticmethod
    def positive(value) -> bool:
        return value > 0


def _enumerate_cases(compute):
    """Run ``compute(oracle)`` on every consistent sign pattern (depth-first); yield (oracle, result)."""
    stack = [()]
    while stack:
        choices = stack.pop()
        oracle = _Oracle(choices)
        try:
            result = compute(oracle)
        except _NeedBranch:
            stack += [choices + (False,), choices + (True,)]
            continue
        yield oracle, result


def _min1(x, oracle):
    return 1 if oracle.positive(x - 1) else x


def _block_given(target, draft, x: tuple, oracle) -> dict:
    """{z: P(Z = z | X = x)} of block verification (Sun et al. Alg. 2 backward form, the two-symbol post's forward form).

    ratio_i = min(ratio_{i-1} p(x_i)/q(x_i), 1); w_i(t) = max(ratio_i p(t|x^i) - q(t|x^i), 0);
    P(Z = x^i + t) = w_i(t)/(W_i + 1 - ratio_i) prod_{m=i+1}^{gamma-1} (1 - ratio_m)/(W_m + 1 - ratio_m)
    (1 - ratio_gamma) for i < gamma, and ratio_gamma p(t|x) for i = gamma.
    """
    gamma, vocab = len(x), len(target(()))
    one = target(())[0] ** 0  # the 1 of whatever number type the rows use
    ratios = [one]
    for i in range(gamma):
        ratios.append(_min1(ratios[-1] * target(x[:i])[x[i]] / draft(x[:i])[x[i]], oracle))
    law, survive = {}, 1 - ratios[gamma]
    for t in range(vocab):
        law[x + (t,)] = ratios[gamma] * target(x)[t]
    for i in reversed(range(gamma)):
        diffs = [ratios[i] * target(x[:i])[t] - draft(x[:i])[t] for t in range(vocab)]
        weights = [d if oracle.positive(d) else 0 for d in diffs]
        denom = sum(weights) + 1 - ratios[i]
        if denom == 0:  # no residual mass and ratio 1: h_i = 0, position i is never the last pass
            continue
        for t in range(vocab):
            law[x[:i] + (t,)] = weights[t] / denom * survive
        survive = survive * (1 - ratios[i]) / denom
    return law


def block_step_law(target, draft, gamma: int, oracle) -> dict:
    """{z: P(Z = z)} of one block-verification step, draft blocks enumerated (all q(x) > 0 assumed).

    Rows are rational-function field elements (decided by an :class:`_Oracle` case split) or exact
    numbers (``oracle = NumericOracle()``).
    """
    vocab, law = len(target(())), defaultdict(int)
    for x in itertools.product(range(vocab), repeat=gamma):
        qx = _product(draft(x[:i])[x[i]] for i in range(gamma))
        for z, prob in _block_given(target, draft, x, oracle).items():
            law[z] += qx * prob
    return dict(law)


def _product(values):
    out = 1
    for v in values:
        out = out * v
    return out


def _symbolic_models(vocab: int, gamma: int):
    """Target rows at depths 0..gamma, draft rows at 0..gamma-1, each (s_1/S, ..., s_{V-1}/S, 1/S) with
    S = 1 + sum s over positive symbols s, in a rational function field (so every entry is manifestly
    positive and arithmetic stays in lowest terms)."""
    names = {}
    for name, depth in (("p", gamma), ("q", gamma - 1)):
        for k in range(depth + 1):
            for prefix in itertools.product(range(vocab), repeat=k):
                tag = "".join("AB"[t] if vocab == 2 else str(t) for t in prefix)
                names[(name, prefix)] = [f"{name}{tag}_{t}" for t in range(vocab - 1)]
    field, *gens = sp.polys.fields.field(",".join(n for ns in names.values() for n in ns), sp.QQ)
    gens, rows = iter(gens), {}
    for key, ns in names.items():
        weights = [next(gens) for _ in ns] + [field.one]
        rows[key] = tuple(w / sum(weights) for w in weights)
    return (lambda prefix: rows[("p", tuple(prefix))]), (lambda prefix: rows[("q", tuple(prefix))])


@dataclass(frozen=True)
class BlockCase:
    """One region of parameter space (every expression in ``conditions`` > 0) and its verdict.

    ``status`` is ``"lossless"`` (condition (L) holds identically on the region), ``"empty"`` (the
    region is empty: ``certificate`` lists conditions whose sum is identically <= 0 although each is
    > 0) or ``"FAILED"`` (neither; ``residuals`` shows what is left).
    """

    conditions: tuple
    status: str
    certificate: tuple = ()
    residuals: tuple = ()


def _emptiness_certificate(facts: list, max_terms: int = 3) -> tuple:
    """Some <= max_terms facts (each asserted > 0) whose sum has an obvious sign <= 0, or ()."""
    unique = list(dict.fromkeys(facts))
    for size in range(1, max_terms + 1):
        for subset in itertools.combinations(unique, size):
            total = sum(subset[1:], subset[0])
            if total == 0 or _obvious_sign(total) < 0:
                return subset
    return ()


def block_lossless_cases(vocab: int = 2, gamma: int = 2, step_law=None) -> tuple[BlockCase, ...]:
    """Theorem 1 of Sun et al. 2025 (arXiv 2403.10444): block verification is lossless, symbolically.

    Target rows at depths 0..gamma and draft rows at depths 0..gamma-1 are free rational functions of
    positive symbols (:func:`_symbolic_models`); every min/max is resolved by a case split with strict
    inequalities (boundary ties are covered by exact rational instances in proofs/t4). In each case
    the validity condition (L) of :mod:`specresearch.exact.lp` (emit Z, then continue from the target =
    target law on V^(gamma+1)) is checked by exact rational-function arithmetic; a case where it fails
    must be certified empty. ``step_law`` (default :func:`block_step_law`) lets a test substitute a
    broken verifier and see the check fail.
    """
    from specresearch.exact.lp import continuation_law

    target, draft = _symbolic_models(vocab, gamma)
    step_law, cases = step_law or block_step_law, []
    for oracle, law in _enumerate_cases(lambda oracle: step_law(target, draft, gamma, oracle)):
        got = continuation_law(law, target, gamma)
        residuals = [v - _product(target(y[:i])[y[i]] for i in range(len(y))) for y, v in got.items()]
        conditions = tuple(c.as_expr() for c in oracle.conditions)
        if all(r == 0 for r in residuals):
            cases.append(BlockCase(conditions, "lossless"))
            continue
        certificate = tuple(c.as_expr() for c in _emptiness_certificate(oracle.facts))
        status = "empty" if certificate else "FAILED"
        cases.append(BlockCase(conditions, status, certificate, tuple(r.as_expr() for r in residuals)))
    return tuple(cases)
