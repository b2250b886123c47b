"""Reproducibility: the same seed gives the same tokens; per-prompt seeds make a row independent of its batch.

``seed`` an int: one generator for the batch (rows share its stream, so a row's tokens depend on the batch).
``seed`` a list of one int per prompt: per-row generators and gamma never shortened, so a prompt gives the
same tokens alone, at any batch position, next to any other prompts (generate.py module docstring).
ToyLM logits do not depend on the batch, so equality there is exact; tiny Llama logits differ across batch
shapes by float rounding (~1e-7), which could flip a sample only if a uniform fell within ~1e-7 of a CDF
boundary -- the seeds are fixed, so these tests are deterministic.
"""

import pytest
import torch

from specresearch.config import SamplingConfig
from specresearch.drafts.ngram import NGramDraft
from specresearch.drafts.registry import truncated_draft
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.experiments.stats import chi_square, sequence_law
from specresearch.models.toy import ToyLM, tiny_llama

VOCAB = 16
PROMPTS = [[3, 1, 4, 1, 5], [9], [2, 6, 5, 3], [5, 8, 9, 7, 9, 3]]
SEEDS = [11, 22, 33, 44]
SAMPLING = SamplingConfig(temperature=0.9, top_k=10)


def _toys():
    g = torch.Generator().manual_seed(0)
    return ToyLM(torch.randn(VOCAB, VOCAB, generator=g)), ToyLM(torch.randn(VOCAB, VOCAB, generator=g))


@pytest.fixture(scope="module")
def llamas():
    target = tiny_llama(VOCAB, seed=0, init_std=0.6, num_layers=2)
    return target, truncated_draft(target, 1)


def _spec(target, draft, prompts, seed, verifier="block", **kwargs):
    return speculative_generate(target, draft, prompts, verifier=verifier, gamma=3, max_new_tokens=14,
                                sampling=SAMPLING, seed=seed, **kwargs).tokens


@pytest.mark.parametrize("verifier", ["token", "block"])
def test_same_seed_same_tokens_across_runs(llamas, verifier):
    target, draft = llamas
    assert _spec(target, draft, PROMPTS, 5, verifier) == _spec(target, draft, PROMPTS, 5, verifier)
    assert _spec(target, draft, PROMPTS, SEEDS, verifier) == _spec(target, draft, PROMPTS, SEEDS, verifier)
    ar = [autoregressive_generate(target, PROMPTS, max_new_tokens=14, sampling=SAMPLING, seed=5).tokens for _ in "ab"]
    assert ar[0] == ar[1]


@pytest.mark.parametrize("verifier", ["token", "block", "greedy"])
@pytest.mark.parametrize("models", ["toy", "llama"])
def test_per_prompt_seed_gives_the_same_tokens_alone_or_batched(llamas, verifier, models):
    target, draft = _toys() if models == "toy" else llamas
    batched = _spec(target, draft, PROMPTS, SEEDS, verifier)
    alone = tuple(_spec(target, draft, [p], [s], verifier)[0] for p, s in zip(PROMPTS, SEEDS))
    assert batched == alone
    reordered = _spec(target, draft, PROMPTS[::-1], SEEDS[::-1], verifier)  # other batch positions
    assert reordered == batched[::-1]


def test_per_prompt_seed_with_eos_and_an_ngram_draft():
    target, _ = _toys()
    draft = NGramDraft(VOCAB, max_ngram=2)
    batched = _spec(target, draft, PROMPTS, SEEDS, eos_token_id=0)
    alone = tuple(_spec(target, draft, [p], [s], eos_token_id=0)[0] for p, s in zip(PROMPTS, SEEDS))
    assert batched == alone and any(len(row) < 14 for row in batched)  # some row did stop at EOS


def test_per_prompt_seed_autoregressive(llamas):
    target, _ = llamas
    batched = autoregressive_generate(target, PROMPTS, max_new_tokens=14, sampling=SAMPLING, seed=SEEDS).tokens
    for prompt, seed, row in zip(PROMPTS, SEEDS, batched):
        alone = autoregressive_generate(target, [prompt], max_new_tokens=14, sampling=SAMPLING, seed=[seed])
        assert alone.tokens[0] == row


def test_a_generator_as_seed_is_used_as_it_is(llamas):
    target, draft = llamas
    seeded = _spec(target, draft, PROMPTS, 5)
    assert _spec(target, draft, PROMPTS, torch.Generator().manual_seed(5)) == seeded
    generator = torch.Generator().manual_seed(5)
    first = autoregressive_generate(target, PROMPTS, max_new_tokens=14, sampling=SAMPLING, seed=generator).tokens
    assert first == autoregressive_generate(target, PROMPTS, max_new_tokens=14, sampling=SAMPLING, seed=5).tokens
    again = autoregressive_generate(target, PROMPTS, max_new_tokens=14, sampling=SAMPLING, seed=generator).tokens
    assert again != first  # the generator was advanced, not reseeded


def test_different_seeds_give_different_tokens(llamas):
    """56 tokens from distributions far from one-hot: equal outputs for two seeds are far below 1e-6 likely."""
    target, draft = llamas
    assert _spec(target, draft, PROMPTS, SEEDS) != _spec(target, draft, PROMPTS, [s + 1 for s in SEEDS])
    same_prompt = _spec(target, draft, [PROMPTS[0]] * 2, [1, 2])
    assert same_prompt[0] != same_prompt[1]  # per-row seeds really are per row


@pytest.mark.parametrize("verifier", ["token", "block"])
def test_per_prompt_seeds_keep_the_output_law(verifier):
    """Per-row randomness (and the unshortened gamma) must not change the law: 4000 rows, one seed each,
    first 3 tokens vs the exact target law. Exact Bonferroni-binomial p-value > 1e-7: FPR <= 1e-7."""
    target, draft = _toys()
    n = 4000
    out = speculative_generate(target, draft, [[3]] * n, verifier=verifier, gamma=3, max_new_tokens=3,
                               sampling=SAMPLING, seed=list(range(n)))
    law = sequence_law(target, [3], sampling=SAMPLING, k=3, num_samples=n)
    counts = [0] * len(law.cells)
    for row in out.tokens:
        counts[law.index(row)] += 1
    _, dof, p_value, bonferroni = chi_square(counts, law.probs)
    assert dof > 10 and bonferroni > 1e-7 and p_value > 1e-7
