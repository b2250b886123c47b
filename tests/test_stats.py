"""stats.lossless_test: the statistical losslessness test of the whole engine.

Tiny exact models (a Markov ToyLM built from a random rational model, so the exact twin
``exact.target_distribution`` gives the true law): the law computation equals the twin, the partition is
a partition, correct verifiers pass, the deliberately wrong verifier is rejected at the same sample size,
impossible outputs give p = 0. One slow test runs the embedded SmolLM2 pair.

False-positive rates: the "correct verifier passes" tests assert ``bonferroni_p_value > 1e-7``; that
p-value is exact and conservative (union bound over exact binomial tests), so a correct engine fails
with probability <= 1e-7 per test. They also assert the chi-square ``p_value > 1e-7`` (asymptotic; at so
small a level the chi-square tail is only approximate, which is why the Bonferroni bound is the one the
FPR claim rests on). Seeds are fixed, so every run is the same run.
"""

import math
import random

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from specresearch import exact
from specresearch.config import SamplingConfig
from specresearch.core.verify import VerifyResult
from specresearch.exact.sampling import transformed_model
from specresearch.experiments.stats import (
    chi_square,
    describe_cell,
    lossless_test,
    sequence_law,
    wrong_residual_verify,
)
from specresearch.models.toy import ToyLM

VOCAB = 6
PROMPT = [2, 5]
LEVEL = 1e-7
SAMPLES = 12_000
SAMPLINGS = [SamplingConfig(), SamplingConfig(temperature=0.5, top_k=4)]


def _markov(seed: int):
    """Exact rational Markov model (rows depend on the last token, with exact zeros) and its ToyLM."""
    model = exact.random_rational_model(VOCAB, random.Random(seed), depth=1, zero_prob=0.2)
    rows = [[float(p) for p in model((t,))] for t in range(VOCAB)]
    return model, ToyLM(torch.tensor(rows, dtype=torch.float64).log())


@pytest.fixture(scope="module")
def pair():
    target_exact, target = _markov(3)
    _, draft = _markov(4)
    return target_exact, target, draft


@pytest.mark.parametrize("sampling", SAMPLINGS + [SamplingConfig(top_p=0.8)])
def test_law_equals_the_exact_twin(pair, sampling):
    target_exact, target, _ = pair
    law = sequence_law(target, PROMPT, sampling=sampling, k=3, num_samples=10**6)
    want = exact.target_distribution(transformed_model(target_exact, sampling), 3, prefix=tuple(PROMPT))
    leaves = {s: p for s, p in law.big.items() if len(s) == 3}
    assert set(leaves) == {s for s, p in want.items() if p * 10**6 >= 5}  # every sequence above the threshold
    for seq, prob in leaves.items():
        assert prob == pytest.approx(float(want[seq]), rel=1e-5)


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("num_samples", [300, 5000])
def test_cells_partition_the_sequences(pair, sampling, num_samples):
    """Summing the exact law over the sequences in each cell gives the cell probabilities; counts >= 5."""
    target_exact, target, _ = pair
    law = sequence_law(target, PROMPT, sampling=sampling, k=3, num_samples=num_samples)
    mass = [0.0] * len(law.cells)
    for seq, prob in exact.target_distribution(transformed_model(target_exact, sampling), 3, tuple(PROMPT)).items():
        mass[law.index(seq)] += float(prob)
    np.testing.assert_allclose(mass, law.probs, atol=1e-6)
    assert min(law.probs) * num_samples >= 5 and sum(law.probs) == pytest.approx(1.0)
    assert len(set(law.cells)) == len(law.cells) > 1


def test_impossible_sequence_is_detected(pair):
    _, target, _ = pair
    law = sequence_law(target, PROMPT, sampling=SamplingConfig(top_k=2), k=2, num_samples=100)
    row = law.rows[()]
    outside = int((row == 0).nonzero()[0])  # a token outside the top-2
    assert law.index((outside, 0)) is None
    first = int(row.argmax())
    assert law.index((first, int(law.rows[(first,)].argmax()))) is not None
    assert law.index((first, int((law.rows[(first,)] == 0).nonzero()[0]))) is None  # impossible second token


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("verifier", ["token", "block"])
def test_correct_verifiers_pass(pair, verifier, sampling):
    """Token and block verification are lossless (Leviathan et al. Thm 1; Sun et al. Thm 1): not rejected
    at 1e-7. FPR <= 1e-7 (Bonferroni p-value, exact); see the module docstring."""
    _, target, draft = pair
    result = lossless_test(target, draft, verifier, PROMPT, sampling=sampling, gamma=3, k=3, max_new_tokens=4,
                           num_samples=SAMPLES, seed=7, batch_size=SAMPLES // 2)
    assert result.impossible == 0 and result.num_samples == SAMPLES == sum(result.counts)
    assert result.bonferroni_p_value > LEVEL
    assert result.p_value > LEVEL and not result.rejects(LEVEL)
    assert result.dof == len(result.cells) - 1 > 10


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_wrong_residual_verifier_is_rejected(pair, sampling):
    """Power: resampling from p instead of norm(max(p - q, 0)) after a rejection is caught at the same N."""
    _, target, draft = pair
    result = lossless_test(target, draft, wrong_residual_verify, PROMPT, sampling=sampling, gamma=3, k=3,
                           max_new_tokens=4, num_samples=SAMPLES, seed=7, batch_size=SAMPLES // 2)
    assert result.p_value < LEVEL and result.bonferroni_p_value < LEVEL and result.rejects(LEVEL)


def test_greedy_verifier_is_lossless_only_for_greedy_sampling(pair):
    _, target, draft = pair
    greedy = lossless_test(target, draft, "greedy", PROMPT, sampling=SamplingConfig(temperature=0), gamma=2,
                           k=3, num_samples=50, seed=0)
    assert greedy.counts == (50,) and greedy.dof == 0 and greedy.p_value == 1.0  # the one argmax path
    sampled = lossless_test(target, draft, "greedy", PROMPT, sampling=SamplingConfig(), gamma=2, k=3,
                            num_samples=2000, seed=0)
    assert sampled.p_value < LEVEL  # greedy verification does not sample from p


def _argmin_verifier(target_probs, draft_probs, draft_tokens, generator=None, *, uniforms=None, validate=True):
    """Rejects every draft and emits the LEAST likely token: outside the top-k, probability 0."""
    least = target_probs[:, 0].argmin(-1)
    return VerifyResult(torch.zeros_like(least), least)


def test_impossible_outputs_give_p_value_zero(pair):
    _, target, draft = pair
    result = lossless_test(target, draft, _argmin_verifier, PROMPT, sampling=SamplingConfig(top_k=3), gamma=2,
                           k=2, num_samples=40, seed=0)
    assert result.impossible == 40 and result.p_value == 0.0 and math.isinf(result.statistic)


def test_chi_square_matches_scipy():
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(7))
    counts = rng.multinomial(500, probs)
    statistic, dof, p_value, bonferroni = chi_square(counts.tolist(), probs.tolist())
    want = scipy_stats.chisquare(counts, 500 * probs)
    assert statistic == pytest.approx(want.statistic) and p_value == pytest.approx(want.pvalue) and dof == 6
    smallest = min(scipy_stats.binomtest(int(c), 500, p).pvalue for c, p in zip(counts, probs))
    assert bonferroni == pytest.approx(min(1.0, 7 * smallest))


def test_bad_arguments(pair):
    _, target, draft = pair
    with pytest.raises(ValueError, match="k must be"):
        sequence_law(target, PROMPT, sampling=SamplingConfig(), k=0, num_samples=10)
    with pytest.raises(ValueError, match="num_samples"):
        sequence_law(target, PROMPT, sampling=SamplingConfig(), k=1, num_samples=1)
    with pytest.raises(ValueError, match="min_expected"):
        sequence_law(target, PROMPT, sampling=SamplingConfig(), k=1, num_samples=10, min_expected=0)
    with pytest.raises(ValueError, match="max_new_tokens must be >= k"):
        lossless_test(target, draft, "token", PROMPT, sampling=SamplingConfig(), gamma=2, k=3, max_new_tokens=2,
                      num_samples=10, seed=0)
    law = sequence_law(target, PROMPT, sampling=SamplingConfig(), k=2, num_samples=10)
    with pytest.raises(ValueError, match="recompute"):
        lossless_test(target, draft, "token", PROMPT, sampling=SamplingConfig(), gamma=2, k=3, num_samples=10,
                      seed=0, law=law)


def test_describe_cell():
    assert describe_cell(("seq", (1, 2))) == "1|2"
    assert describe_cell(("rest", (1,))) == "1|*"
    assert describe_cell(("rest", ())) == "*"
    assert describe_cell(("tail",)) == "other"

    class Words:
        def decode(self, ids):
            return "".join({1: "-", 2: "by"}[i] for i in ids)

    assert describe_cell(("seq", (1, 2, 1)), Words()) == "'-by-'"  # one readable string, not '-'|'by'|'-'
    assert describe_cell(("rest", (2,)), Words()) == "'by' *"


@pytest.mark.slow
def test_embedded_pair_block_verification_passes():
    """SmolLM2-135M target, its first layer as draft, T = 1, block verification, 300 samples of 3 tokens.
    FPR <= 1e-7 (Bonferroni p-value)."""
    from specresearch.drafts.registry import truncated_draft
    from specresearch.models.embedded import load_embedded

    target, tokenizer = load_embedded(device="cpu")
    prompt = tokenizer("Hello", add_special_tokens=False)["input_ids"]
    result = lossless_test(target, truncated_draft(target, 1), "block", prompt, sampling=SamplingConfig(),
                           gamma=2, k=3, num_samples=300, seed=0, batch_size=150)
    assert result.impossible == 0 and result.dof >= 5
    assert result.bonferroni_p_value > LEVEL and result.p_value > LEVEL


def test_detectable_tv_is_the_deviation_rejected_with_the_stated_power():
    """The least visible deviation of total variation delta (|d_i| proportional to p_i, half the mass up, half down)
    is rejected at level 1e-3 in about 90% of 1,000 simulated runs at N = 2,000 (binomial sd of the rate 0.01); a
    deviation half as large far less often. Fixed seed: deterministic."""
    import numpy as np

    from specresearch.experiments.stats import chi_square, detectable_tv

    cells, n = 10, 2000
    p = np.full(cells, 1 / cells)
    delta = detectable_tv(n, cells)
    assert detectable_tv(4 * n, cells) == pytest.approx(delta / 2, rel=1e-6)  # 1 / sqrt(N)
    rng = np.random.default_rng(0)
    rates = []
    for size in (delta, delta / 2):
        q = p * (1 + 2 * size * np.where(np.arange(cells) < cells // 2, 1, -1))  # TV(p, q) = size
        assert abs(q - p).sum() / 2 == pytest.approx(size)
        rates.append(np.mean([chi_square(rng.multinomial(n, q), p)[2] < 1e-3 for _ in range(1000)]))
    assert 0.86 <= rates[0] <= 0.96 and rates[1] < 0.3, rates
