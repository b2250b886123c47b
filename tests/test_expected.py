"""E[num_accepted | drafted block]: ``verify.expected_num_accepted`` against its exact twin, the twin against
``verify_exact``, a Monte Carlo check against the verifiers themselves, and the unbiasedness of the
per-step expectation for the per-step expected accepted count (exact enumeration on toy models).

False-positive budget: the only random assertions are the K = 6 Monte Carlo means below, each with a
Hoeffding bound of 1e-7 (num_accepted lies in [0, gamma]), so a correct implementation fails with
probability < 6e-7 < 1e-6. Seeds are fixed.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction as F
from itertools import product

import pytest
import torch

from specresearch import exact
from specresearch.core.draws import draw_uniforms
from specresearch.core.verify import VERIFIERS, expected_num_accepted
from specresearch.exact.single import (
    as_model,
    expected_accepted,
    expected_num_accepted_exact,
    random_rational_model,
    two_symbol_example,
    verify_exact,
)

METHODS = ("token", "block", "greedy")


def _tensor(rows) -> torch.Tensor:
    return torch.tensor([[float(v) for v in row] for row in rows], dtype=torch.float64)


def _random_block(seed, zero_prob=0.3):
    """Random rational rows (V in 2..5, gamma in 1..5) with exact zeros; drafts drawn from q (q(x) > 0)."""
    rng = random.Random(seed)
    vocab, gamma = rng.randint(2, 5), rng.randint(1, 5)
    row = lambda: random_rational_model(vocab, rng, depth=0, zero_prob=zero_prob)(())  # noqa: E731
    ps, qs = [row() for _ in range(gamma + 1)], [row() for _ in range(gamma)]
    xs = [rng.choices(range(vocab), weights=[float(v) for v in q])[0] for q in qs]
    return ps, qs, xs


def _law_mean(law) -> F:
    return sum((prob * n for (n, _token), prob in law.items()), F(0))


@pytest.mark.parametrize("method", METHODS)
def test_exact_closed_form_is_the_mean_of_the_exact_law(method):
    """The twin's closed form equals E[n] under ``verify_exact``'s law (an independent derivation)."""
    for seed in range(60):
        ps, qs, xs = _random_block(seed)
        assert expected_num_accepted_exact(ps, qs, xs, method) == _law_mean(verify_exact(ps, qs, xs, method))


def test_closed_forms_differ_between_token_and_block():
    """Block verification accepts more on the two-symbol post's example (power of the test above)."""
    target, draft = two_symbol_example()
    xs = [0, 0, 1]
    ps, qs = [target] * 4, [draft] * 3
    token, block = (expected_num_accepted_exact(ps, qs, xs, m) for m in ("token", "block"))
    assert token == F(1, 2) + F(1, 4) + F(1, 4)  # a_i = (1/2, 1/2, 1): P(n >= k) = 1/2, 1/4, 1/4
    assert block > token


@pytest.mark.parametrize("method", METHODS)
def test_torch_matches_exact_twin_batched(method):
    """One batched call over blocks of one gamma (padding with independent random rows) vs the twin."""
    blocks = [_random_block(seed) for seed in range(200)]
    by_shape: dict = {}
    for block in blocks:
        by_shape.setdefault((len(block[2]), len(block[0][0])), []).append(block)
    checked = 0
    for group in by_shape.values():
        target = torch.stack([_tensor(ps) for ps, _, _ in group])
        draft = torch.stack([_tensor(qs) for _, qs, _ in group])
        tokens = torch.tensor([xs for _, _, xs in group])
        got = expected_num_accepted(target, draft, tokens, method)
        want = torch.tensor([float(expected_num_accepted_exact(*b, method)) for b in group], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        checked += len(group)
    assert checked == 200


def test_float32_large_vocabulary_matches_float64():
    """The path used on real models (V in the tens of thousands, float32) agrees with float64."""
    generator = torch.Generator().manual_seed(0)
    target = torch.softmax(2 * torch.randn(3, 6, 5000, generator=generator, dtype=torch.float64), -1)
    draft = torch.softmax(torch.log(target[:, :5]) + torch.randn(3, 5, 5000, generator=generator, dtype=torch.float64), -1)
    tokens = torch.multinomial(draft.reshape(-1, 5000), 1, generator=generator).reshape(3, 5)
    for method in ("token", "block"):
        high = expected_num_accepted(target, draft, tokens, method)
        low = expected_num_accepted(target.float(), draft.float(), tokens, method)
        assert low.dtype == torch.float32
        torch.testing.assert_close(low.double(), high, rtol=1e-4, atol=1e-5)


# Hoeffding: P(|mean - mu| >= t) <= 2 exp(-2 N t^2 / gamma^2) = 1e-7 at the t below.
TRIALS = 200_000


def _hoeffding_radius(gamma: int) -> float:
    return gamma * math.sqrt(math.log(2 / 1e-7) / (2 * TRIALS))


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("seed", [3, 7, 11])
def test_monte_carlo_mean_of_the_verifier_matches(method, seed):
    """The mean num_accepted of the verifier itself over TRIALS uniforms is within the Hoeffding radius
    (false-positive rate 1e-7 each; 6 tests). The gap between token and block exceeds it on these blocks,
    so swapping the methods would fail."""
    ps, qs, xs = _random_block(seed, zero_prob=0.1)
    gamma, vocab = len(xs), len(ps[0])
    target = _tensor(ps).expand(TRIALS, gamma + 1, vocab)
    draft = _tensor(qs).expand(TRIALS, gamma, vocab)
    tokens = torch.tensor(xs).expand(TRIALS, gamma)
    uniforms = draw_uniforms(TRIALS, gamma, generator=torch.Generator().manual_seed(seed))
    realised = VERIFIERS[method](target, draft, tokens, uniforms=uniforms).num_accepted.double().mean()
    closed = expected_num_accepted(target[:1], draft[:1], tokens[:1], method)[0]
    assert abs(float(realised - closed)) < _hoeffding_radius(gamma)
    other = expected_num_accepted_exact(ps, qs, xs, "block" if method == "token" else "token")
    assert abs(float(other) - float(closed)) > 2 * _hoeffding_radius(gamma)


def _toy_models(seed):
    rng = random.Random(seed)
    vocab = 3
    return (random_rational_model(vocab, rng, depth=2, zero_prob=0.2),
            random_rational_model(vocab, rng, depth=2, zero_prob=0.2))


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("seed", [0, 1])
def test_per_step_expectation_is_unbiased_at_every_context(method, seed):
    """Exactly: sum over draft blocks of q(block) * E[n | block] = ``exact.expected_accepted`` at the context.

    So at every context c where a step starts, the per-step closed form of EITHER method, evaluated on the
    block the run drew, has the expectation of that method's own accepted count at c. Summed over a
    trajectory, the per-step expectations have the expected value of the realised counts (for the
    verifier that ran) and of the counterfactual verifier's counts at those same contexts.
    """
    target, draft = _toy_models(seed)
    target_model, draft_model = as_model(target), as_model(draft)
    for gamma in (1, 2, 3):
        for prefix in [(), (0,), (2, 1), (1, 1, 0)]:
            total = F(0)
            for tokens in product(range(3), repeat=gamma):
                draft_rows = [draft_model(prefix + tokens[:i]) for i in range(gamma)]
                prob = math.prod((row[x] for row, x in zip(draft_rows, tokens)), start=F(1))
                if prob == 0:
                    continue
                target_rows = [target_model(prefix + tokens[:i]) for i in range(gamma + 1)]
                total += prob * expected_num_accepted_exact(target_rows, draft_rows, list(tokens), method)
            assert total == expected_accepted(target, draft, gamma, method, prefix)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "beam"}, "method must be one of"),
        ({"draft_tokens": torch.zeros(2, 3, dtype=torch.long)}, "target_probs must be"),
        ({"target_probs": torch.full((2, 3, 4), 0.3, dtype=torch.float64)}, "target_probs rows must sum to 1"),
    ],
)
def test_bad_input_names_the_argument(kwargs, match):
    good = {
        "target_probs": torch.full((2, 3, 4), 0.25, dtype=torch.float64),
        "draft_probs": torch.full((2, 2, 4), 0.25, dtype=torch.float64),
        "draft_tokens": torch.zeros(2, 2, dtype=torch.long),
        "method": "token",
    }
    with pytest.raises(ValueError, match=match):
        expected_num_accepted(**(good | kwargs))
    if "method" in kwargs:
        with pytest.raises(ValueError, match="method must be one of"):
            exact.expected_num_accepted_exact([(F(1),)] * 2, [(F(1),)], [0], "beam")
