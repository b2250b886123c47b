"""Claim (Leviathan et al. 2023, Eq. (1), Thm 3.8 and Corollary 3.9; quoted in the two-symbol post):

1. With i.i.d. acceptances of rate alpha, the number N of accepted drafts out of gamma is a truncated
   geometric variable, P(N = n) = alpha^n (1 - alpha) (n < gamma), P(N = gamma) = alpha^gamma, and
   E[tokens per iteration] = E[N + 1] = (1 - alpha^(gamma+1)) / (1 - alpha)   (gamma + 1 at alpha = 1).
2. A step costs gamma draft calls (c each, in target-call units) plus one target call, so the expected
   wall-time improvement factor is (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)).
3. Corollary 3.9: if alpha > c there is a gamma with improvement >= (1 + alpha)/(1 + c) > 1; gamma = 1
   gives exactly (1 + alpha)/(1 + c).

sympy checks (specresearch.exact.symbolic): the sums over the law of N with symbolic gamma (sympy summation,
both branches of its Piecewise), the tail-sum form, the improvement factor, and the gamma = 1 identity
with the sign of (1 + alpha)/(1 + c) - 1 for alpha = c + delta, delta > 0. Exact checks: on a rational
grid alpha, c in {k/40}, the best gamma (specresearch.exact.theory.optimal_gamma) reaches at least
(1 + alpha)/(1 + c) whenever alpha > c; and the closed form equals exact enumeration of token
verification (specresearch.exact.block_efficiency) on i.i.d. models for gamma = 1..4.
Run: python proofs/t3_expected_tokens.py
"""

from fractions import Fraction

from specresearch.exact.single import block_efficiency
from specresearch.exact.symbolic import (
    Check,
    corollary_3_9_checks,
    expected_tokens_checks,
    run_checks,
    walltime_checks,
)
from specresearch.exact.theory import (
    acceptance_rate,
    expected_tokens,
    optimal_gamma,
    walltime_improvement,
)


def grid_checks(steps: int = 40, max_gamma: int = 32) -> list[Check]:
    grid = [Fraction(k, steps) for k in range(steps)]
    pairs = [(a, c) for a in grid for c in grid if a > c]
    exact_at_one = all(walltime_improvement(a, 1, c) == (1 + a) / (1 + c) for a, c in pairs)
    reached = all(walltime_improvement(a, optimal_gamma(a, c, max_gamma), c) >= (1 + a) / (1 + c) > 1 for a, c in pairs)
    return [
        Check(f"grid of {len(pairs)} rational (alpha > c): improvement(gamma = 1) == (1 + alpha)/(1 + c)", exact_at_one),
        Check(f"grid of {len(pairs)} rational (alpha > c): best gamma <= {max_gamma} gives >= (1 + alpha)/(1 + c) > 1", reached),
    ]


def enumeration_checks() -> list[Check]:
    pairs = [((Fraction(1, 3), Fraction(2, 3)), (Fraction(2, 3), Fraction(1, 3))), ((Fraction(1, 2), Fraction(1, 4), Fraction(1, 4)), (Fraction(1, 5), Fraction(3, 5), Fraction(1, 5)))]
    ok = all(block_efficiency(p, q, g, "token") == expected_tokens(acceptance_rate(p, q), g) for p, q in pairs for g in range(1, 5))
    return [Check("exact enumeration of token verification (i.i.d. models, gamma = 1..4) == (1 - alpha^(gamma+1))/(1 - alpha)", ok)]


def main() -> int:
    checks = [*expected_tokens_checks(), *walltime_checks(), *corollary_3_9_checks(), *grid_checks(), *enumeration_checks()]
    return run_checks("Leviathan et al. Eq. (1), Thm 3.8, Cor. 3.9: expected tokens and wall-time improvement", checks)


if __name__ == "__main__":
    raise SystemExit(main())
