"""Claim (Sun et al. 2025, Theorem 2, arXiv 2403.10444; the two-symbol post's example):
block verification is optimal -- among ALL valid verifiers (those whose speculative loop reproduces the
target's law from every prefix) none has a larger expected number of accepted draft tokens per step --
and token verification can be strictly worse: p = (1/3, 2/3), q = (2/3, 1/3), gamma = 2 gives 11/9
accepted drafts for block verification and 10/9 for token verification.

How it is checked, exactly (Fractions, sympy's rational simplex): specresearch.exact.lp.optimal_verifier_lp
solves the linear program "maximise E[accepted drafts] over every joint law of (draft block, emitted
sequence) that has the draft marginal and satisfies the validity condition (L)" (its docstring derives
(L) and the two equivalent formulations). For each instance:
  * block verification's own joint law (from specresearch.exact.verify_exact) is feasible for the LP
    (so it is a valid verifier) and its objective equals the LP optimum (so it is optimal);
  * the LP optimum is the same in the "prefix" and the "coupling" formulations (small instances);
  * token verification is feasible and never above the optimum; where it is below, strictly.
Instances: the two-symbol example (gamma = 1, 2, 3) and random rational models (context-dependent, with
zeros) for V in {2, 3}, gamma in {1, 2, 3}.
Run: python proofs/t5_block_optimal.py
"""

import random
from fractions import Fraction

from specresearch.exact.lp import check_verifier, compare_with_lp, optimal_verifier_lp
from specresearch.exact.single import random_rational_model, two_symbol_example
from specresearch.exact.symbolic import Check, run_checks


def instance_checks(name: str, target, draft, gamma: int, coupling: bool) -> tuple[list[Check], dict]:
    values = compare_with_lp(target, draft, gamma)
    block, token = check_verifier(target, draft, gamma, "block"), check_verifier(target, draft, gamma, "token")
    checks = [
        Check(f"{name}: block joint is LP-feasible, objective {block.objective} == LP optimum {values['lp']}", block.feasible and block.objective == values["lp"] == values["block"]),
        Check(f"{name}: token joint is LP-feasible, objective {token.objective} <= optimum", token.feasible and token.objective == values["token"] <= values["lp"]),
    ]
    if coupling:
        other = optimal_verifier_lp(target, draft, gamma, formulation="coupling").optimum
        checks.append(Check(f"{name}: coupling formulation gives the same optimum ({other})", other == values["lp"]))
    return checks, values


def two_symbol_checks() -> list[Check]:
    target, draft = two_symbol_example()
    out = []
    for gamma in (1, 2, 3):
        checks, values = instance_checks(f"two-symbol, gamma={gamma}", target, draft, gamma, coupling=True)
        out += checks
    _, values = instance_checks("two-symbol, gamma=2", target, draft, 2, coupling=False)
    out.append(Check("two-symbol, gamma=2: LP = block = 11/9 > token = 10/9 (the two-symbol post)", values["lp"] == values["block"] == Fraction(11, 9) and values["token"] == Fraction(10, 9)))
    return out


def random_checks(trials: int = 16, seed: int = 3) -> list[Check]:
    rng, out, strict = random.Random(seed), [], 0
    for i in range(trials):
        vocab, gamma = rng.choice([2, 3]), rng.choice([1, 2, 3])
        target, draft = (random_rational_model(vocab, rng, zero_prob=0.1) for _ in range(2))
        checks, values = instance_checks(f"random #{i} V={vocab} gamma={gamma}", target, draft, gamma, coupling=vocab ** gamma <= 9)
        out += checks
        strict += values["token"] < values["lp"]
    out.append(Check(f"token verification strictly below the optimum on {strict} of {trials} random instances (expected: some)", strict > 0))
    return out


def main() -> int:
    return run_checks("Theorem 2 (Sun et al.): block verification is optimal among valid verifiers", two_symbol_checks() + random_checks())


if __name__ == "__main__":
    raise SystemExit(main())
