"""Sampler vs exact twin: every torch verifier in specresearch.core.verify against specresearch.exact.

For one verification instance (fixed rational rows and draft tokens) we run the torch verifier on
TRIALS = 200_000 copies in ONE batched call with seeded float64 uniforms, count the emitted
(num_accepted, next_token) pairs and compare them with the exact law from ``verify_exact``:

* outcomes of exact probability 0 must never occur (a hard assertion, no tolerance);
* a Pearson chi-square goodness-of-fit test (cells with expected count < 5 merged) must not reject
  at level ALPHA = 1e-8.

False-positive budget: this file runs K_STAT = 28 level-ALPHA tests that a correct implementation
should pass (20 single-row chi-square, 6 whole-step chi-square, 2 Monte Carlo means), so the
family-wise false-positive rate is below K_STAT * ALPHA = 2.8e-7 < 1e-6 (the chi-square
approximation is used in its tail; almost all cells have expected counts in the thousands).
Seeds are fixed, so a run is deterministic.
Power: the same test rejects token verification's output against the block twin on the two-symbol
example of the two-symbol post, so these tests can fail.
"""

from __future__ import annotations

import random
from collections import Counter
from fractions import Fraction as F
from itertools import product

import pytest
import torch
from scipy.stats import chi2

from specresearch.core.draws import draw_uniforms
from specresearch.core.verify import VERIFIERS
from specresearch.exact.single import (
    random_rational_model,
    step_distribution,
    two_symbol_example,
    verify_exact,
)

ALPHA = 1e-8
K_STAT = 28
TRIALS = 200_000
assert K_STAT * ALPHA < 1e-6


# ----------------------------------------------------------------------------- helpers


def _tensor(rows) -> torch.Tensor:
    return torch.tensor([[float(v) for v in row] for row in rows], dtype=torch.float64)


def _goodness_of_fit(counts: Counter, law: dict) -> tuple[float, int]:
    """(chi-square p-value, number of draws that fell on outcomes of exact probability 0)."""
    trials = sum(counts.values())
    impossible = sum(c for key, c in counts.items() if key not in law)
    cells = sorted((trials * float(prob), counts.get(key, 0)) for key, prob in law.items())
    small = [cell for cell in cells if cell[0] < 5]
    cells = cells[len(small):]
    if small:
        pooled = (sum(e for e, _ in small), sum(o for _, o in small))
        if pooled[0] < 5:  # still too small: merge into the smallest large cell
            pooled = (pooled[0] + cells[0][0], pooled[1] + cells[0][1])
            cells = cells[1:]
        cells.append(pooled)
    if len(cells) < 2:
        return 1.0, impossible
    stat = sum((o - e) ** 2 / e for e, o in cells)
    return float(chi2.sf(stat, len(cells) - 1)), impossible


def _run_rows(method, ps, qs, xs, seed) -> Counter:
    """Counts of (num_accepted, next_token) over TRIALS copies of one instance, one batched call."""
    gamma, vocab = len(xs), len(ps[0])
    generator = torch.Generator().manual_seed(seed)
    uniforms = draw_uniforms(TRIALS, gamma, generator=generator)  # [TRIALS, gamma+1] float64
    target = _tensor(ps).expand(TRIALS, gamma + 1, vocab)
    draft = _tensor(qs).expand(TRIALS, gamma, vocab)
    tokens = torch.tensor(xs, dtype=torch.int64).expand(TRIALS, gamma)
    result = VERIFIERS[method](target, draft, tokens, uniforms=uniforms)
    codes = torch.bincount(result.num_accepted * vocab + result.next_token, minlength=(gamma + 1) * vocab)
    return Counter({divmod(code, vocab): int(c) for code, c in enumerate(codes.tolist()) if c})


def _random_instance(seed):
    """Random rational rows (V <= 4, gamma <= 3) with exact zeros; drafts drawn from q (q(x) > 0)."""
    rng = random.Random(seed)
    vocab, gamma = rng.randint(2, 4), rng.randint(1, 3)
    row = lambda: random_rational_model(vocab, rng, depth=0, zero_prob=0.3)(())  # noqa: E731
    ps, qs = [row() for _ in range(gamma + 1)], [row() for _ in range(gamma)]
    xs = [rng.choices(range(vocab), weights=[float(v) for v in q])[0] for q in qs]
    return ps, qs, xs


# Seeds chosen (by scanning 1..59) so that every law has >= 3 outcomes and the mix covers gamma = 1..3,
# V = 2..4, a drafted token with p = 0 (seeds 5, 37) and token != block laws (all but 12 and 29).
RANDOM_SEEDS = [5, 11, 12, 24, 29, 37, 50, 51]

# Hand-made instance whose second draft token has p = 0 (and q > 0): p_1 = 3/4, p_2 = 0.
P_ZERO = (
    [(F(1, 2), F(1, 4), F(1, 4)), (F(0), F(1, 3), F(2, 3)), (F(1, 4), F(0), F(3, 4)), (F(1, 3),) * 3],
    [(F(1, 3),) * 3, (F(1, 2), F(1, 4), F(1, 4)), (F(1, 6), F(1, 2), F(1, 3))],
    [1, 0, 2],
)
# Same target, but the second draft token has q = 0 (the contract: never accepted; block sets p_2 = 0).
Q_ZERO = (P_ZERO[0], [P_ZERO[1][0], (F(1, 2), F(1, 2), F(0)), P_ZERO[1][2]], [1, 2, 2])

INSTANCES = {f"random{s}": _random_instance(s) for s in RANDOM_SEEDS} | {"p_zero": P_ZERO, "q_zero": Q_ZERO}


# ----------------------------------------------------------------------------- single rows


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("name", sorted(INSTANCES))
def test_sampler_matches_exact_twin(name, method):
    ps, qs, xs = INSTANCES[name]
    law = verify_exact(ps, qs, xs, method)
    counts = _run_rows(method, ps, qs, xs, seed=sorted(INSTANCES).index(name))
    p_value, impossible = _goodness_of_fit(counts, law)
    assert impossible == 0, f"{method} emitted outcomes of probability 0: {counts} vs {law}"
    assert p_value > ALPHA, f"{method} on {name}: p = {p_value:.3g}; counts {counts}, law {law}"


@pytest.mark.parametrize("name", sorted(INSTANCES))
def test_greedy_matches_exact_twin(name):
    """Greedy is deterministic: every copy must emit the single outcome of the exact law."""
    ps, qs, xs = INSTANCES[name]
    (outcome,) = verify_exact(ps, qs, xs, "greedy")
    assert _run_rows("greedy", ps, qs, xs, seed=0) == Counter({outcome: TRIALS})


def test_special_instances_exercise_the_zero_cases():
    """Guard the fixtures: the p = 0 / q = 0 drafts really sit at position 2 and matter."""
    ps, qs, xs = P_ZERO
    assert ps[1][xs[1]] == 0 < qs[1][xs[1]]
    assert Q_ZERO[1][1][Q_ZERO[2][1]] == 0
    assert verify_exact(*P_ZERO, "token") != verify_exact(*P_ZERO, "block")
    for instance in (P_ZERO, Q_ZERO):
        assert all(n <= 1 for n, _ in verify_exact(*instance, "token") | verify_exact(*instance, "block"))


# ----------------------------------------------------------------------------- whole steps (drafts sampled)


def _step_tables(target, draft, gamma, vocab):
    """All draft blocks with their probability and rows: tokens [K, gamma], probs [K], p [K, gamma+1, V], q."""
    blocks = list(product(range(vocab), repeat=gamma))
    probs, ps, qs = [], [], []
    for block in blocks:
        qs.append([draft(block[:i]) for i in range(gamma)])
        ps.append([target(block[:i]) for i in range(gamma + 1)])
        prob = F(1)
        for i, x in enumerate(block):
            prob *= qs[-1][i][x]
        probs.append(float(prob))
    to = lambda rows: torch.stack([_tensor(r) for r in rows])  # noqa: E731
    return torch.tensor(blocks, dtype=torch.int64), torch.tensor(probs, dtype=torch.float64), to(ps), to(qs)


def _run_step(method, target, draft, gamma, vocab, seed) -> Counter:
    """Counts of emitted sequences (accepted drafts + next token) with drafts sampled from q."""
    blocks, probs, ps, qs = _step_tables(target, draft, gamma, vocab)
    generator = torch.Generator().manual_seed(seed)
    pick = torch.multinomial(probs, TRIALS, replacement=True, generator=generator)  # [TRIALS]
    uniforms = draw_uniforms(TRIALS, gamma, generator=generator)
    tokens = blocks[pick]
    result = VERIFIERS[method](ps[pick], qs[pick], tokens, uniforms=uniforms)
    padded = torch.cat([tokens, torch.full((TRIALS, 1), vocab)], 1)  # [TRIALS, gamma+1], vocab = "empty"
    padded[torch.arange(TRIALS), result.num_accepted] = result.next_token
    padded[torch.arange(gamma + 1)[None, :] > result.num_accepted[:, None]] = vocab
    rows, counts = padded.unique(dim=0, return_counts=True)
    return Counter({tuple(t for t in row if t != vocab): int(c) for row, c in zip(rows.tolist(), counts.tolist())})


def _step_models():
    """The two-symbol example and two context-dependent random models (V = 3, gamma = 2 and 3), seeds
    chosen so that token and block verification have different step laws."""
    target, draft = two_symbol_example()
    models = {"two_symbol": (lambda prefix: target, lambda prefix: draft, 2, 2)}
    for seed, gamma in ((37, 2), (39, 3)):
        rng = random.Random(seed)
        models[f"random{seed}"] = (random_rational_model(3, rng), random_rational_model(3, rng), gamma, 3)
    return models


STEP_MODELS = _step_models()


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("name", sorted(STEP_MODELS))
def test_whole_step_matches_step_distribution(name, method):
    target, draft, gamma, vocab = STEP_MODELS[name]
    law = step_distribution(target, draft, gamma, method)
    counts = _run_step(method, target, draft, gamma, vocab, seed=5)
    p_value, impossible = _goodness_of_fit(counts, law)
    assert impossible == 0, f"{method} on {name}: impossible sequences {counts} vs {law}"
    assert p_value > ALPHA, f"{method} on {name}: p = {p_value:.3g}"


# ----------------------------------------------------------------------------- power


def test_test_rejects_token_output_against_block_twin():
    """Power check on the two-symbol example (gamma = 2): the number of accepted tokens is
    (1/3, 2/9, 4/9) for token and (1/3, 1/9, 5/9) for block verification, all cells positive, so
    the chi-square test itself (not the zero-probability check) must reject the wrong twin."""
    target, draft, gamma, vocab = STEP_MODELS["two_symbol"]
    counts = _run_step("token", target, draft, gamma, vocab, seed=5)
    accepted = Counter()
    for seq, c in counts.items():
        accepted[len(seq) - 1] += c
    block_law = Counter()
    for seq, prob in step_distribution(target, draft, gamma, "block").items():
        block_law[len(seq) - 1] += prob
    assert dict(block_law) == {0: F(1, 3), 1: F(1, 9), 2: F(5, 9)}
    p_value, impossible = _goodness_of_fit(accepted, block_law)
    assert impossible == 0 and p_value < ALPHA
    # Per row too: on draft AA the token verifier emits (1, B), impossible under block verification.
    ps, qs = [target(())] * 3, [draft(())] * 2
    _, impossible = _goodness_of_fit(_run_rows("token", ps, qs, [0, 0], seed=3), verify_exact(ps, qs, [0, 0], "block"))
    assert impossible > 0


# ----------------------------------------------------------------------------- Monte Carlo helper


def test_simulate_accepted_recovers_two_symbol_values():
    """specresearch.experiments.montecarlo (used by notebook 01) on TRIALS steps: the exact 10/9 and 11/9 lie within
    z = norm.isf(ALPHA / 2) standard errors (two of the K_STAT level-ALPHA tests)."""
    from scipy.stats import norm

    from specresearch.experiments.montecarlo import simulate_accepted

    target, draft = two_symbol_example()
    for method, truth in (("token", F(10, 9)), ("block", F(11, 9))):
        estimate = simulate_accepted(target, draft, 2, method, TRIALS, seed=1)
        assert estimate.trials == TRIALS and estimate.contains(truth, norm.isf(ALPHA / 2)), (method, estimate)
    assert not simulate_accepted(target, draft, 2, "token", TRIALS, seed=1).contains(F(11, 9), norm.isf(ALPHA / 2))
    with pytest.raises(ValueError, match="method must be one of"):
        simulate_accepted(target, draft, 2, "beam", 10, seed=0)
    with pytest.raises(ValueError, match="gamma must be an integer >= 1"):
        simulate_accepted(target, draft, 0, "token", 10, seed=0)
