"""``feature_distill.loop_expectations``: the token-verification loop's expected examined / accepted drafts
and steps, computed along target-sampled sequences, equal the loop's own expectations: exactly (rationals)
against a direct enumeration of the loop, and count for count against the engine at temperature 0."""

import itertools
import random
from fractions import Fraction

import pytest
import torch

from specresearch import exact
from specresearch.feature_distill import loop_expectations, measure_feature_draft
from specresearch.feature_drafts import FeatureDraft, FeatureHead, FeatureHeadConfig
from specresearch.generate import speculative_generate
from specresearch.models import tiny_llama
from specresearch.sampling import SamplingConfig


def _enumerated_loop(p, q, gamma: int, n: int, vocab: int) -> tuple[Fraction, Fraction, Fraction]:
    """E[examined, accepted, steps] over the first n positions, by walking every step of Leviathan et al.'s loop:
    draft blocks enumerated with their probabilities, each verified by ``exact.verify_exact(..., "token")``."""
    totals = [Fraction(0)] * 3

    def walk(prefix: tuple[int, ...], mass: Fraction) -> None:
        s = len(prefix)
        if s >= n:
            return
        totals[2] += mass
        for block in itertools.product(range(vocab), repeat=gamma):
            draft_rows = [q(prefix + block[:k]) for k in range(gamma)]
            weight = mass
            for row, y in zip(draft_rows, block):
                weight *= row[y]
            if weight == 0:
                continue
            target_rows = [p(prefix + block[:k]) for k in range(gamma + 1)]
            for (accepted, token), prob in exact.verify_exact(target_rows, draft_rows, list(block), "token").items():
                examined_positions = range(s, s + accepted + (accepted < gamma))
                totals[0] += weight * prob * sum(i < n for i in examined_positions)
                totals[1] += weight * prob * sum(i < n for i in range(s, s + accepted))
                walk(prefix + block[:accepted] + (token,), weight * prob)

    walk((), Fraction(1))
    return tuple(totals)


@pytest.mark.parametrize(("gamma", "vocab"), [(1, 3), (2, 3), (3, 2)])
@pytest.mark.parametrize("seed", [0, 1])
def test_expectations_along_target_sequences_equal_the_enumerated_loop(gamma, vocab, seed):
    """Context-dependent rational p and q (zeros included), the first 4 positions: sum over the target's
    sequences of P(x) * loop_expectations(min(p, q)(x_i) / p(x_i)) is exactly the loop's expectation."""
    rng = random.Random(seed)
    p, q = exact.random_rational_model(vocab, rng), exact.random_rational_model(vocab, rng)
    n = 4
    along = [Fraction(0)] * 3
    for seq, prob in exact.target_distribution(p, n).items():
        accept = []
        for i, x in enumerate(seq):
            px, qx = p(seq[:i])[x], q(seq[:i])[x]
            accept.append(min(px, qx) / px)
        for k, value in enumerate(loop_expectations([accept] * gamma, gamma)):
            along[k] += prob * value
    assert tuple(along) == _enumerated_loop(p, q, gamma, n, vocab)
    assert 0 < along[1] < along[0] and along[2] <= n


def test_an_accepted_run_hides_the_next_position():
    """Acceptance alternating 1, 0, 1, 0 at gamma 1: the loop drafts only the easy positions (a bonus token
    follows each), so its acceptance is 1 while the per-position mean is 1/2; with gamma 2 the hard ones are drafted too."""
    assert loop_expectations([[1, 0, 1, 0]], 1) == (2, 2, 2)
    assert loop_expectations([[1, 0, 1, 0], [1, 0, 1, 0]], 2) == (4, 2, 2)
    examined, accepted, steps = loop_expectations([[0.5] * 6], 1)  # independent positions: acceptance is alpha
    assert accepted / examined == pytest.approx(0.5)
    with pytest.raises(ValueError, match="gamma"):
        loop_expectations([[0.5] * 6], 2)


def test_greedy_loop_counts_equal_the_engine_at_gamma_1():
    """A tiny target and a head reading its final feature: at temperature 0 and gamma 1 the expectations are
    counts, and they equal the engine's accepted / examined drafts and steps on the same prompts."""
    target = tiny_llama(48, seed=0, init_std=0.6, num_layers=3)
    head = FeatureHead(target.model, FeatureHeadConfig("t", feature_layers=(-1,), init_layer=-1))
    prompts = [[5, 9, 2, 33, 7, 5, 9], [4, 8], [16, 23, 42, 3]]
    measured = measure_feature_draft(target.model, head, [torch.tensor(ids) for ids in prompts], temperatures=(1.0,), depths=1,
                                     max_new_tokens=16, progress=False)
    examined = accepted = steps = 0
    for ids in prompts:
        out = speculative_generate(target, FeatureDraft(head), [ids], verifier="token", gamma=1, max_new_tokens=16,
                                   sampling=SamplingConfig(temperature=0.0))
        for step in out.steps:
            if step.active[0] and step.gamma:
                steps += 1
                accepted += step.num_accepted[0]
                examined += step.num_accepted[0] + (step.num_accepted[0] < step.gamma)
    assert 0 < accepted < examined
    assert measured.loop[0.0][0] == pytest.approx((examined, accepted, steps))
    assert measured.loop_acceptance(0.0)[0] == pytest.approx(accepted / examined)
    assert measured.loop_tokens_per_step(0.0)[0] == pytest.approx((accepted + steps) / steps)
