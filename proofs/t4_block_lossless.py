"""Claim (Sun et al. 2025, "Block Verification Accelerates Speculative Decoding", Theorem 1;
arXiv 2403.10444, and the forward form of the two-symbol post): block verification is lossless -- the
speculative loop with block verification emits tokens with exactly the target's law.

What is checked, and how:
1. Symbolically (specresearch.exact.symbolic.block_lossless_cases), for V = 2, gamma = 2 with context-dependent
   rows (7 target rows, 3 draft rows, 10 free positive parameters) and for V = 2 and V = 3 at gamma = 1:
   every min/max of block verification is resolved by a case split into strict inequalities; in every
   case either the validity condition (L) of specresearch.exact.lp ("emit Z, then continue from the target"
   has the target's law on V^(gamma+1); sufficient for losslessness of the whole loop by induction)
   holds as an identity of rational functions, or the case is certified empty (conditions, each > 0,
   whose sum is identically <= 0). Not covered symbolically: the boundaries (ties such as p = q, where
   some max(.) = 0 exactly) and exact zeros; those are covered by 3.
2. The symbolic implementation of the step law (block_step_law, numeric oracle) equals the exact twin
   specresearch.exact.step_distribution(..., "block") on random rational instances (two independent
   implementations of Algorithm 2).
3. Exactly (specresearch.exact.is_lossless: the law of the first n_tokens of the full loop, enumerated
   in Fractions) on random rational context-dependent models with exact zeros and frequent ties
   (denominators 3..12), V in {2, 3}, gamma in {1, 2, 3}, n_tokens = 4, and on a grid of i.i.d. two-symbol
   pairs including p = q and zero probabilities.
Run: python proofs/t4_block_lossless.py
"""

import collections
import random
from fractions import Fraction

from specresearch.exact.single import (
    as_model,
    is_lossless,
    random_rational_model,
    step_distribution,
)
from specresearch.exact.symbolic import (
    Check,
    NumericOracle,
    block_lossless_cases,
    block_step_law,
    run_checks,
)


def symbolic_checks(sizes=((2, 1), (3, 1), (2, 2))) -> list[Check]:
    out = []
    for vocab, gamma in sizes:
        cases = block_lossless_cases(vocab, gamma)
        counts = collections.Counter(case.status for case in cases)
        claim = f"V={vocab}, gamma={gamma}: {counts['lossless']} cases lossless identically, {counts['empty']} certified empty, of {len(cases)}"
        out.append(Check(claim, counts["FAILED"] == 0, [c.conditions for c in cases if c.status == "FAILED"]))
    return out


def twin_checks(trials: int = 20, seed: int = 1) -> list[Check]:
    rng, ok = random.Random(seed), []
    for _ in range(trials):
        vocab, gamma = rng.choice([(2, 2), (3, 2), (2, 3)])
        target = as_model(random_rational_model(vocab, rng, zero_prob=0.0, denominator=rng.randint(vocab, 12)))
        draft = as_model(random_rational_model(vocab, rng, zero_prob=0.0, denominator=rng.randint(vocab, 12)))
        mine = {z: v for z, v in block_step_law(target, draft, gamma, NumericOracle()).items() if v}
        ok.append(mine == step_distribution(target, draft, gamma, "block"))
    return [Check(f"{trials} random instances: symbolic block_step_law == exact.step_distribution('block')", all(ok))]


def exact_checks(trials: int = 40, seed: int = 2) -> list[Check]:
    rng, ok = random.Random(seed), []
    for _ in range(trials):
        vocab, gamma = rng.choice([2, 3]), rng.choice([1, 2, 3])
        models = [random_rational_model(vocab, rng, zero_prob=0.25, denominator=rng.randint(3, 12)) for _ in range(2)]
        ok.append(is_lossless(models[0], models[1], gamma, "block", 4))
    grid = [Fraction(k, 4) for k in range(5)]
    iid = [is_lossless((a, 1 - a), (b, 1 - b), 2, "block", 4) for a in grid for b in grid if b not in (0, 1) or a == b]
    return [
        Check(f"{trials} random context-dependent models (zeros, ties), V in {{2,3}}, gamma in {{1,2,3}}: loop law == target law on 4 tokens", all(ok)),
        Check(f"{len(iid)} i.i.d. two-symbol pairs on the grid k/4 (ties, zeros), gamma = 2: lossless on 4 tokens", all(iid)),
    ]


def main() -> int:
    checks = symbolic_checks() + twin_checks() + exact_checks()
    return run_checks("Theorem 1 (Sun et al.): block verification is lossless", checks)


if __name__ == "__main__":
    raise SystemExit(main())
