"""Closed forms of speculative decoding's speed-up (Leviathan et al. 2023, Sec. 3), exact in Fractions.

Notation as in the package docstring: p = target, q = draft, gamma = block length, alpha = the
expected acceptance rate E[beta], beta = sum_x min(p(x), q(x)) (Leviathan et al. 2023, arXiv 2211.17192, Lemma / Corollary 3.6),
c = cost of one draft call relative to one target call.

All functions take exact numbers (int, ``fractions.Fraction``, sympy ``Rational``) or floats, which
are read as the decimal they print as (``0.8`` -> ``4/5``), and return ``Fraction``. The symbolic
derivations of these formulas live in :mod:`specresearch.exact.symbolic` and ``proofs/t3_expected_tokens.py``.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Sequence

from specresearch.checks import check_int

__all__ = ["acceptance_rate", "expected_tokens", "iid_example", "optimal_gamma", "walltime_improvement"]


def _fraction(value, name: str) -> Fraction:
    """``value`` as an exact Fraction; floats are read as their shortest decimal repr."""
    if isinstance(value, float):
        if value != value or abs(value) == float("inf"):
            raise ValueError(f"{name} must be finite, got {value!r}")
        return Fraction(str(value))
    if isinstance(value, (int, Fraction)) and not isinstance(value, bool):
        return Fraction(value)
    if getattr(value, "is_Rational", False):  # sympy Integer / Rational
        return Fraction(int(value.p), int(value.q))
    raise ValueError(f"{name} must be an int, Fraction, float or sympy Rational, got {value!r}")


def _alpha(alpha) -> Fraction:
    alpha = _fraction(alpha, "alpha")
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be an acceptance rate in [0, 1], got {alpha}")
    return alpha


def _gamma(gamma) -> int:
    check_int("gamma", gamma, meaning="draft block length")
    return gamma


def expected_tokens(alpha, gamma: int) -> Fraction:
    """E[tokens emitted per target call] = (1 - alpha^(gamma+1)) / (1 - alpha); gamma + 1 at alpha = 1.

    Leviathan et al. 2023, Eq. (1) (Thm 3.8); the two-symbol post quotes it. Derived as a truncated geometric
    series in ``proofs/t3_expected_tokens.py``.
    """
    alpha, gamma = _alpha(alpha), _gamma(gamma)
    return sum((alpha**k for k in range(gamma + 1)), Fraction(0))


def walltime_improvement(alpha, gamma: int, c) -> Fraction:
    """Expected wall-time improvement factor (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)).

    Leviathan et al. 2023, Thm 3.8: ``c`` is the cost of a draft call in units of a target call (c >= 0).
    """
    c = _fraction(c, "c")
    if c < 0:
        raise ValueError(f"c (draft/target cost ratio) must be >= 0, got {c}")
    return expected_tokens(alpha, gamma) / (gamma * c + 1)


def optimal_gamma(alpha, c, max_gamma: int = 64) -> int:
    """The gamma in 1..max_gamma maximising :func:`walltime_improvement` (smallest one on ties).

    Leviathan et al. 2023, Sec. 3.5 / Fig. 3. The maximum may be < 1 (speculation does not pay), which
    happens only when alpha <= c (Corollary 3.9 gives a speed-up whenever alpha > c).
    """
    alpha, max_gamma = _alpha(alpha), _gamma(max_gamma)
    gains = [walltime_improvement(alpha, g, c) for g in range(1, max_gamma + 1)]
    return 1 + gains.index(max(gains))


def acceptance_rate(target_probs: Sequence, draft_probs: Sequence) -> Fraction:
    """beta = sum_x min(p(x), q(x)) = 1 - D_LK(p, q) for one pair of distributions over V tokens.

    Leviathan et al. 2023 (the definition of D_LK and its lemma). Args: ``target_probs`` [V], ``draft_probs`` [V], each
    summing to exactly 1.
    """
    p = _distribution(target_probs, "target_probs")
    q = _distribution(draft_probs, "draft_probs")
    if len(p) != len(q):
        raise ValueError(f"target_probs and draft_probs must have the same vocabulary size, got {len(p)} and {len(q)}")
    return sum((min(a, b) for a, b in zip(p, q)), Fraction(0))


def _distribution(probs: Sequence, name: str) -> tuple[Fraction, ...]:
    if isinstance(probs, (str, bytes)) or not hasattr(probs, "__len__") or len(probs) == 0:
        raise ValueError(f"{name} must be a non-empty sequence of probabilities, got {probs!r}")
    values = tuple(_fraction(v, f"{name}[{i}]") for i, v in enumerate(probs))
    if any(v < 0 for v in values) or sum(values) != 1:
        raise ValueError(f"{name} must be non-negative and sum to exactly 1, got sum {sum(values)}")
    return values


def iid_example(alpha) -> tuple[tuple[Fraction, ...], tuple[Fraction, ...]]:
    """A context-free (target_probs, draft_probs) pair over 3 tokens with acceptance rate exactly ``alpha``:
    p = (alpha, 1 - alpha, 0), q = (alpha, 0, 1 - alpha). Used to check the closed forms against exact
    enumeration (:mod:`specresearch.exact`) of i.i.d. models."""
    alpha = _alpha(alpha)
    return (alpha, 1 - alpha, Fraction(0)), (alpha, Fraction(0), 1 - alpha)
