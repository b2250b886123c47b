"""Every proofs/*.py exits 0, and the checking machinery can fail: false claims give a non-zero exit."""

import subprocess
import sys
from pathlib import Path

import pytest
import sympy as sp

from specresearch.exact.symbolic import (
    Check,
    block_lossless_cases,
    identity,
    run_checks,
)

ROOT = Path(__file__).resolve().parents[1]
PROOFS = sorted((ROOT / "proofs").glob("*.py"))


def test_there_are_five_proofs():
    assert [p.stem[:2] for p in PROOFS] == ["t1", "t2", "t3", "t4", "t5"]


@pytest.mark.slow
@pytest.mark.parametrize("proof", PROOFS, ids=[p.stem for p in PROOFS])
def test_proof_script_exits_zero(proof):
    run = subprocess.run([sys.executable, str(proof)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "FAILED" not in run.stdout


def test_identity_rejects_a_wrong_token_residual():
    # Token verification with the residual max(0, q - p) instead of max(0, p - q) is not lossless.
    q, d = sp.Symbol("q", positive=True), sp.Symbol("d", positive=True)
    p = q * (1 + d)
    assert identity("right", q * sp.Min(1, p / q) + sp.Max(0, p - q), p).holds
    wrong = identity("wrong", q * sp.Min(1, p / q) + sp.Max(0, q - p), p)
    assert not wrong.holds and wrong.residual != 0


def test_run_checks_exit_codes(capsys):
    assert run_checks("ok", [Check("true", True)]) == 0
    assert run_checks("bad", [Check("true", True), Check("false", False, 1)]) == 1
    assert run_checks("empty", []) == 1  # proving nothing is a failure
    assert "FAILED" in capsys.readouterr().out


def test_a_failing_proof_script_exits_non_zero(tmp_path):
    script = tmp_path / "false_claim.py"
    script.write_text(
        "import sympy as sp\n"
        "from specresearch.exact.symbolic import identity, run_checks\n"
        "p, q = sp.symbols('p q', positive=True)\n"
        "raise SystemExit(run_checks('false', [identity('min(p, q) = p', sp.Min(p, q), p)]))\n"
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "FAILED" in run.stdout


def _always_accept_law(target, draft, gamma, oracle):
    """Broken verifier: accept the whole draft block, then one target token (not lossless)."""
    from itertools import product

    law = {}
    for x in product(range(len(target(()))), repeat=gamma):
        qx = draft(())[x[0]] if gamma == 1 else draft(())[x[0]] * draft(x[:1])[x[1]]
        for t, pt in enumerate(target(x)):
            law[x + (t,)] = qx * pt
    return law


def test_symbolic_block_check_fails_for_a_broken_verifier():
    cases = block_lossless_cases(2, 1, step_law=_always_accept_law)
    assert any(case.status == "FAILED" for case in cases)


def test_symbolic_block_check_passes_for_block_verification():
    assert {case.status for case in block_lossless_cases(2, 1)} == {"lossless"}


def test_symbolic_block_law_matches_the_exact_twin():
    # Two independent implementations of block verification (symbolic.py and exact.py) agree exactly.
    import random

    from specresearch.exact.single import (
        as_model,
        random_rational_model,
        step_distribution,
    )
    from specresearch.exact.symbolic import NumericOracle, block_step_law

    rng = random.Random(4)
    for vocab, gamma in [(2, 2), (3, 2), (2, 3)]:
        target, draft = (as_model(random_rational_model(vocab, rng, zero_prob=0.0)) for _ in range(2))
        mine = {z: v for z, v in block_step_law(target, draft, gamma, NumericOracle()).items() if v}
        assert mine == step_distribution(target, draft, gamma, "block")
