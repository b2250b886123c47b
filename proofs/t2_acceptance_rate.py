"""Claim (Leviathan et al. 2023, Thm 3.5): the acceptance rate of token
verification is

    beta = sum_x min(p(x), q(x)) = 1 - D_LK(p, q),   D_LK(p, q) = sum_x |p(x) - M(x)| = sum_x |q(x) - M(x)|,

with M = (p + q) / 2.

sympy checks (specresearch.exact.symbolic.acceptance_rate_checks): for symbolic vectors of size n = 2..6 and
every order pattern, sum|p - M| - (1 - beta) equals (sum p - 1 + sum q - 1)/2, i.e. vanishes for
distributions, and sum|q - M| = sum|p - M|; for general n, the per-term identity
|p - M| = M - min(p, q) (both orders) and linearity of Sum. Then, exactly on random rational
distributions, beta computed by specresearch.exact.theory.acceptance_rate equals 1 - D_LK and equals the
acceptance probability sum_x q(x) min(1, p(x)/q(x)) of one token-verification step.
Run: python proofs/t2_acceptance_rate.py
"""

import random
from fractions import Fraction

from specresearch.exact.symbolic import Check, acceptance_rate_checks, run_checks
from specresearch.exact.theory import acceptance_rate


def _random_distribution(rng: random.Random, vocab: int) -> list[Fraction]:
    weights = [rng.randint(0, 6) for _ in range(vocab)]
    weights[rng.randrange(vocab)] += 1
    return [Fraction(w, sum(weights)) for w in weights]


def exact_checks(trials: int = 200, seed: int = 0) -> list[Check]:
    rng, out = random.Random(seed), []
    for _ in range(trials):
        vocab = rng.randint(2, 6)
        p, q = _random_distribution(rng, vocab), _random_distribution(rng, vocab)
        d_lk = sum(abs(a - (a + b) / 2) for a, b in zip(p, q))
        accept = sum(b * min(1, a / b) for a, b in zip(p, q) if b)
        out.append(acceptance_rate(p, q) == 1 - d_lk == accept)
    return [Check(f"{trials} random rational pairs (V = 2..6, with zeros): beta = 1 - D_LK = P(accept)", all(out))]


def main() -> int:
    checks = list(acceptance_rate_checks(max_n=6)) + exact_checks()
    return run_checks("Lemma: beta = 1 - D_LK(p, q) = sum_x min(p, q) (Leviathan et al. 2023)", checks)


if __name__ == "__main__":
    raise SystemExit(main())
