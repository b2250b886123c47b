"""SpecTr's K-SEQ, exactly: rho* as an algebraic number and the step law in the field Q(rho*).

Sun et al., "SpecTr: Fast Speculative Decoding via Optimal Transport", NeurIPS 2023 (arXiv
2310.15141). Notation as in :mod:`specresearch.exact.multi` (p = target, q = draft, K drafts, L = 1).
rho* is in general irrational (a quadratic surd for K = 2, a root of a degree-K polynomial otherwise),
so K-SEQ's laws are computed in Q(rho*) with sympy's algebraic fields rather than in Fractions.
:mod:`specresearch.exact.multi` dispatches ``method="kseq"`` here.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from fractions import Fraction

import sympy

from specresearch.checks import check_int
from specresearch.exact import single as exact

__all__ = ["RhoField", "kseq_law", "kseq_public_law", "kseq_rho"]

Row = tuple[Fraction, ...]

_ZERO = Fraction(0)
_ONE = Fraction(1)


def _kseq_g(p_row: Row, q_row: Row, k: int, rho: Fraction) -> Fraction:
    """sum_{j < K} (1 - beta(rho))^j - rho: zero exactly at rho* (the SpecTr equation divided by beta)."""
    beta = sum((min(q, p / rho) for p, q in zip(p_row, q_row)), _ZERO)
    return sum(((1 - beta) ** j for j in range(k)), _ZERO) - rho


def kseq_rho(target_row, draft_row, num_drafts):
    """SpecTr's K-SEQ threshold rho* in [1, K], exactly (Sun et al., NeurIPS 2023, arXiv 2310.15141).

    rho* solves 1 - (1 - beta(rho))^K = rho beta(rho), beta(rho) = sum_x min(q(x), p(x) / rho).
    Dividing by beta > 0 gives g(rho) = sum_{j<K} (1 - beta)^j - rho = 0; g is strictly decreasing,
    g(1) >= 0 >= g(K). Between consecutive breakpoints p(x)/q(x), beta = a + b / rho (a = q-mass of
    tokens with p/q >= rho, b = p-mass of the other tokens with q > 0), so rho^(K-1) g is a polynomial of degree K: the
    root is found on the bracketing piece with sympy.

    Args:
        target_row, draft_row: V exact probabilities each (p and q at the step's prefix).
        num_drafts: K >= 1.
    Returns:
        A Fraction when rho* is rational, else an exact sympy algebraic number (a quadratic surd for
        K = 2, e.g. (5 + sqrt(13)) / 6 for :func:`specresearch.exact.two_symbol_example`; a ``CRootOf``
        for K >= 3).
    """
    p_row = exact.as_model(target_row)(())
    q_row = exact.as_model(draft_row, len(p_row))(())
    k = num_drafts
    check_int("num_drafts", k)
    points = sorted({_ONE, Fraction(k)} | {p / q for p, q in zip(p_row, q_row) if q > 0 and 1 < p / q < k})
    for lo, hi in zip(points, points[1:]):
        g_lo, g_hi = _kseq_g(p_row, q_row, k, lo), _kseq_g(p_row, q_row, k, hi)
        if g_lo == 0:
            return lo
        if g_hi == 0:
            return hi
        if g_lo > 0 > g_hi:
            return _kseq_root(p_row, q_row, k, lo, hi)
    assert k == 1 or _kseq_g(p_row, q_row, k, points[0]) == 0, "g(1) >= 0 >= g(K) must bracket rho*"
    return points[0]


def _kseq_root(p_row: Row, q_row: Row, k: int, lo: Fraction, hi: Fraction):
    """The root of g in the open piece (lo, hi), where beta(rho) = a + b / rho."""
    mid = (lo + hi) / 2
    a = sum((q for p, q in zip(p_row, q_row) if q > 0 and p / q >= mid), _ZERO)
    b = sum((p for p, q in zip(p_row, q_row) if q > 0 and p / q < mid), _ZERO)
    rho = sympy.Symbol("rho", positive=True)
    one_minus_beta = 1 - sympy.Rational(a.numerator, a.denominator) - sympy.Rational(b.numerator, b.denominator) / rho
    poly = sympy.Poly(sympy.expand(rho ** (k - 1) * (sum(one_minus_beta**j for j in range(k)) - rho)), rho)
    lo_s, hi_s = sympy.Rational(lo.numerator, lo.denominator), sympy.Rational(hi.numerator, hi.denominator)
    roots = [r for r in poly.real_roots() if lo_s < r < hi_s]
    assert len(roots) == 1, f"expected one root of {poly} in ({lo}, {hi}), got {roots}"
    root = roots[0]
    return Fraction(int(root.p), int(root.q)) if root.is_Rational else root


class RhoField:
    """Exact arithmetic in Q(rho*): Fractions when rho* is rational, sympy ANP elements otherwise.

    ``num`` embeds a Fraction, ``rho`` is rho* itself, ``div`` divides, ``at_most(r)`` decides
    rho* <= r for a rational r exactly, ``public`` converts an element to a Fraction or a sympy number.
    """

    def __init__(self, rho):
        self.rational = isinstance(rho, Fraction)
        self.domain = None if self.rational else sympy.QQ.algebraic_field(rho)
        self.rho_exact = rho
        self.rho = rho if self.rational else self.domain.from_sympy(rho)
        self.zero, self.one = self.num(_ZERO), self.num(_ONE)
        self._at_most: dict = {}

    def num(self, value: Fraction):
        return value if self.rational else self.domain.from_QQ(sympy.QQ(value.numerator, value.denominator), sympy.QQ)

    def at_most(self, ratio: Fraction) -> bool:
        """rho* <= ratio, decided exactly by sympy once per ratio (the comparison is slow)."""
        if ratio not in self._at_most:
            self._at_most[ratio] = bool(self.rho_exact <= ratio)
        return self._at_most[ratio]

    def div(self, a, b):
        return a / b if self.rational else self.domain.quo(a, b)

    def public(self, value):
        """Fraction, or a sympy expression in rho* (radicals for a quadratic surd)."""
        return value if self.rational else self.domain.to_sympy(value)


def kseq_law(target, draft, paths, prefix=(), field: RhoField | None = None):
    """The law of one K-SEQ verification in Q(rho*): ``(field, {emitted tokens: field element})``.

    ``target``, ``draft``: callables ``prefix -> row`` (:func:`specresearch.exact.as_model`); ``paths``:
    K tuples of one token; ``field``: reuse the RhoField of this prefix (rho* depends on it only).
    """
    p_row, q_row = target(prefix), draft(prefix)
    field = field or RhoField(kseq_rho(p_row, q_row, len(paths)))
    law: dict = defaultdict(lambda: field.zero)
    mass = field.one
    for (x,) in paths:
        # min(1, p / (rho q)): compare the rational ratio with rho* exactly, then divide in the field.
        if q_row[x] == 0:
            accept = field.zero
        elif field.at_most(p_row[x] / q_row[x]):
            accept = field.one
        else:
            accept = field.div(field.num(p_row[x] / q_row[x]), field.rho)
        for t, pt in enumerate(target(prefix + (x,))):
            if pt:
                law[(x, t)] += mass * accept * field.num(pt)
        mass *= field.one - accept
    weights = [field.num(p) - field.rho * field.num(q) if q == 0 or (field.at_most(p / q) and p / q != field.rho_exact) else field.zero for p, q in zip(p_row, q_row)]
    total = functools.reduce(lambda a, b: a + b, weights, field.zero)
    token_law = [field.num(p) for p in p_row] if total == field.zero else [field.div(w, total) for w in weights]
    for t, prob in enumerate(token_law):
        law[(t,)] += mass * prob
    return field, {seq: v for seq, v in law.items() if v != field.zero}


def kseq_public_law(target, draft, paths, prefix=()) -> dict:
    """SpecTr K-SEQ (Sun et al., NeurIPS 2023, Algorithm 'K-SEQ'), L = 1, reading the K draft tokens.

    For i = 1..K accept X_i w.p. min(1, p(X_i) / (rho* q(X_i))); the first acceptance emits X_i and a
    bonus token from p(. | X_i); if none is accepted emit a token from norm(max(p - rho* q, 0)), which
    at rho* is SpecTr's residual (p - min(q, p / rho) (1 - (1 - beta)^K) / beta) / (1 - beta)^K.
    Values are Fractions or exact sympy numbers (see :func:`kseq_rho`).
    """
    field, law = kseq_law(target, draft, paths, prefix)
    return {seq: field.public(v) for seq, v in law.items()}
