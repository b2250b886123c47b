"""``feature_distill.loop_expectations``: the token-verification loop's expected examined / accepted drafts
and steps, computed along target-sampled sequences, equal the loop's own expectations: exactly (rationals)
against a direct enumeration of the loop, and count for count against the engine at temperature 0."""

import itertools
import random
from fractions import Fraction

import pytest
import torch

from specresearch import exact
from specresearch.config import SamplingConfig
from specresearch.drafts.feature import FeatureDraft, FeatureHead, FeatureHeadConfig
from specresearch.engine.generate import speculative_generate
from specresearch.models.toy import tiny_llama
from specresearch.training.feature_measure import (
    loop_expectations,
    measure_feature_draft,
    planned_loop_expectations,
)


def _enumerated_loop(p, q, gamma: int, n: int, vocab: int, length=None) -> tuple[Fraction, ...]:
    """E[examined, accepted, steps, drafted] over the first n positions, by walking every step of Leviathan et
    al.'s loop: draft blocks enumerated with their probabilities, each verified by ``exact.verify_exact(...,
    "token")``. ``length(prefix)``: the draft length of a step that starts after ``prefix`` (default gamma)."""
    totals = [Fraction(0)] * 4
    step_length = length or (lambda prefix: gamma)

    def walk(prefix: tuple[int, ...], mass: Fraction) -> None:
        s = len(prefix)
        if s >= n:
            return
        gamma = step_length(prefix)
        totals[2] += mass
        totals[3] += mass * gamma
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
    assert tuple(along) == _enumerated_loop(p, q, gamma, n, vocab)[:3]
    assert 0 < along[1] < along[0] and along[2] <= n


@pytest.mark.parametrize("vocab", [2, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_planned_lengths_along_target_sequences_equal_the_enumerated_loop(vocab, seed):
    """A step's length chosen from the context it starts after (3 after a repeated token, else 1, as the
    combined draft plans after a lookup match), q depending on the context alone: summed over the target's
    sequences, planned_loop_expectations is exactly the enumerated loop's (examined, accepted, steps, drafted)."""
    rng = random.Random(seed)
    p, q = exact.random_rational_model(vocab, rng), exact.random_rational_model(vocab, rng)
    n = 4

    def length(prefix):
        return 3 if len(prefix) >= 2 and prefix[-1] == prefix[-2] else 1

    along = [Fraction(0)] * 4
    for seq, prob in exact.target_distribution(p, n).items():
        accept = [min(p(seq[:i])[x], q(seq[:i])[x]) / p(seq[:i])[x] for i, x in enumerate(seq)]
        for k, value in enumerate(planned_loop_expectations([accept] * 3, [length(seq[:i]) for i in range(n)])):
            along[k] += prob * value
    enumerated = _enumerated_loop(p, q, 3, n, vocab, length)
    assert tuple(along) == enumerated
    seq = next(iter(exact.target_distribution(p, n)))  # counted: what each step adds, by where it starts
    accept = [[min(p(seq[:i])[x], q(seq[:i])[x]) / p(seq[:i])[x] for i, x in enumerate(seq)]] * 3
    lengths = [length(seq[:i]) for i in range(n)]
    _, _, steps, drafted = planned_loop_expectations(accept, lengths)
    assert planned_loop_expectations(accept, lengths, [g - 1 for g in lengths])[3] == drafted - steps
    assert along[3] > along[2]  # some step drafts 3 tokens
    assert tuple(along) != _enumerated_loop(p, q, 1, n, vocab)  # the plan matters


def test_an_accepted_run_hides_the_next_position():
    """Acceptance alternating 1, 0, 1, 0 at gamma 1: the loop drafts only the easy positions (a bonus token
    follows each), so its acceptance is 1 while the per-position mean is 1/2; with gamma 2 the hard ones are drafted too."""
    assert loop_expectations([[1, 0, 1, 0]], 1) == (2, 2, 2)
    assert loop_expectations([[1, 0, 1, 0], [1, 0, 1, 0]], 2) == (4, 2, 2)
    examined, accepted, steps = loop_expectations([[0.5] * 6], 1)  # independent positions: acceptance is alpha
    assert accepted / examined == pytest.approx(0.5)
    with pytest.raises(ValueError, match="gamma"):
        loop_expectations([[0.5] * 6], 2)
    assert planned_loop_expectations([[1, 0, 1, 0]] * 2, [1] * 4) == (2, 2, 2, 2)
    assert planned_loop_expectations([[1, 0, 1, 0]] * 2, [2, 1, 1, 1]) == (3, 2, 2, 3)  # 0 accepted, 1 rejected; 2 accepted, 3 bonus
    with pytest.raises(ValueError, match="lengths"):
        planned_loop_expectations([[0.5] * 4], [1, 2, 1, 1])


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


def test_lookup_rules_agree_off_the_matches_and_mix_by_concavity():
    """measure_lookup_rules on a tiny target and head, a repetitive prompt: off the lookup matches every rule
    is the head; on them the combined rule is lookup's law (recomputed here from the target's logits and
    drafts.ngram_probs), the mixture accepts at least the weighted mean of the two, the oracle the larger."""
    from specresearch.drafts.ngram import ngram_match_length, ngram_probs
    from specresearch.training.feature_measure import measure_lookup_rules

    target = tiny_llama(48, seed=0, init_std=0.6, num_layers=3)
    head = FeatureHead(target.model, FeatureHeadConfig("t", feature_layers=(-1,), init_layer=-1))
    prompt = torch.tensor([5, 9, 2, 33, 7, 5, 9, 2, 33, 7, 5, 9])
    out = measure_lookup_rules(target.model, head, prompt, temperature=1.0, mixes=(0.25, 0.5), depths=2, max_new_tokens=24, seed=3)
    head_, comb, oracle = out["head"], out["combined"], out["oracle"]
    assert comb["matched"][0] > 0 and comb["positions"][0] - comb["matched"][0] > 0  # both kinds of positions occur
    for rule in out.values():
        for d in range(2):
            assert rule["alpha"][d] - rule["alpha_matched"][d] == pytest.approx(head_["alpha"][d] - head_["alpha_matched"][d])
    for m in (0.25, 0.5):
        mix = out[f"mix:{m:g}"]["alpha_matched"][0]
        assert mix >= m * comb["alpha_matched"][0] + (1 - m) * head_["alpha_matched"][0] - 1e-9
    assert oracle["alpha"][0] >= max(comb["alpha"][0], head_["alpha"][0]) - 1e-9
    # the combined rule on the matches, from the target's own logits
    generator = torch.Generator().manual_seed(3)
    from specresearch.training.corpus import sample_continuations

    seq = torch.cat([prompt, sample_continuations(target.model, [prompt], [1.0], 24, generator)[0]])
    with torch.no_grad():
        p = torch.softmax(target.model(input_ids=seq[None]).logits[0].double(), -1)
    direct = sum(float(torch.minimum(p[j - 1], ngram_probs(seq[:j], 48).double()).sum())
                 for j in range(len(prompt), len(seq)) if ngram_match_length(seq[:j]) >= 2)
    assert comb["alpha_matched"][0] == pytest.approx(direct, rel=1e-5)
    gamma2 = comb["loop"][1]  # steps after a match draft 2, others 1: more drafted than steps
    assert gamma2[3] > gamma2[2] and head_["loop"][0][3] == head_["loop"][0][2]
    assert gamma2[4] < gamma2[3] and head_["loop"][1][4] == head_["loop"][1][3]  # the head drafts only steps without a match
    with pytest.raises(ValueError, match="mixes"):
        measure_lookup_rules(target.model, head, prompt, mixes=(1.0,))
