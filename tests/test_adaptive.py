"""Adaptive draft lengths: exactly lossless on small models, and the engine's ``stop_below`` on real loops.

* Exact (``specresearch.exact.adaptive``): with token and block verification and three context-dependent stopping
  rules (the draft's top probability, the drafted path's probability, the parity of the context), the law of the
  loop's first 3 tokens is the target's on 12 random models with exact zeros. The rule may read any fixed function of
  the context and the drafted tokens (even the target's rows there); what breaks it is a rule that looks at a token
  before deciding to keep it: "drop a drafted token whose q is below 1/2" is caught on the two-symbol example.
* Engine: ``stop_below=0`` never stops (the tokens of a fixed-gamma run, same seed); ``stop_below=1`` stops after one
  token (the tokens of gamma = 1); at T = 0 it is greedy decoding; through the engine, a ToyLM pair passes the
  statistical test (first 3 tokens, N = 1,000, exact Bonferroni p > 1e-7: false-positive rate <= 1e-7).
"""

from __future__ import annotations

import random
from collections import defaultdict
from fractions import Fraction as F

import pytest
import torch

from specresearch import exact
from specresearch.config import SamplingConfig
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.exact.adaptive import adaptive_step_law, confidence_rule, is_lossless_adaptive
from specresearch.exact.single import loop_law, target_distribution, verify_exact
from specresearch.experiments.stats import lossless_test
from specresearch.models.toy import ToyLM, tiny_llama

RULES = {
    "top token >= 1/2": confidence_rule(F(1, 2)),
    "path >= 1/3": confidence_rule(F(1, 3), "path"),
    "context parity": lambda prefix, block, rows, draft: (sum(prefix) + sum(block)) % 2 == 0,
}


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("method", ["token", "block"])
def test_adaptive_loops_are_lossless(rule, method):
    rng = random.Random(0)
    for seed in range(12):
        vocab = 2 + seed % 2
        target, draft = (exact.random_rational_model(vocab, rng, zero_prob=0.2) for _ in range(2))
        assert is_lossless_adaptive(target, draft, 3, method, RULES[rule], 3), (rule, method, seed)


def test_a_rule_that_reads_the_target_rows_is_still_lossless():
    """The condition is "not the verifier's random numbers and not a token before it is kept", not "draft side only"."""
    rng = random.Random(1)
    target, draft = (exact.random_rational_model(3, rng, zero_prob=0.2) for _ in range(2))
    model = exact.as_model(target)
    peek = lambda prefix, block, rows, d: model(prefix + block[:-1])[block[-1]] < F(1, 2)  # noqa: E731
    assert is_lossless_adaptive(target, draft, 3, "block", peek, 3)


def test_dropping_a_token_after_seeing_it_is_caught():
    """Draft x ~ q; keep it only if q(x) >= 1/2, else end the block before it (at least one token is kept)."""
    p, q = exact.two_symbol_example()
    target, draft = exact.as_model(p), exact.as_model(q)

    def step(prefix):
        law = defaultdict(F)
        for x0, q0 in enumerate(q):
            blocks = [((x0,), q0)]
            if q0 >= F(1, 2):  # x0 kept: draft x1 and keep it only if q(x1) >= 1/2
                blocks = [((x0, x1), q0 * q1) for x1, q1 in enumerate(q) if q1 >= F(1, 2)] + [((x0,), q0 * sum(v for v in q if v < F(1, 2)))]
            for block, prob in blocks:
                rows = [target(prefix + block[:i]) for i in range(len(block) + 1)]
                for (n, token), v in verify_exact(rows, [draft(prefix + block[:i]) for i in range(len(block))], list(block), "block").items():
                    law[block[:n] + (token,)] += prob * v
        return dict(law)

    assert loop_law(step, 3) != target_distribution(p, 3)


def test_longer_blocks_only_where_the_draft_is_sure():
    p, q = exact.two_symbol_example()  # q's top probability is 2/3 everywhere
    assert max(len(s) for s in adaptive_step_law(p, q, 3, "block", confidence_rule(F(3, 4)))) == 2  # one draft token
    assert max(len(s) for s in adaptive_step_law(p, q, 3, "block", confidence_rule(F(1, 2)))) == 4  # three


# ----------------------------------------------------------------------------- the engine

PROMPTS = [[5, 9, 2, 33, 7], [4, 8], [16, 23, 42, 3]]


def _markov(seed: int, vocab: int = 6) -> ToyLM:
    model = exact.random_rational_model(vocab, random.Random(seed), depth=1, zero_prob=0.2)
    return ToyLM(torch.tensor([[float(v) for v in model((t,))] for t in range(vocab)], dtype=torch.float64).log())


def test_stop_below_zero_and_one_are_the_fixed_lengths():
    target, draft = _markov(3), _markov(4)
    prompts = [[2, 5], [1], [3, 3, 0]]
    fixed = speculative_generate(target, draft, prompts, gamma=3, max_new_tokens=20, seed=5)
    assert speculative_generate(target, draft, prompts, gamma=3, max_new_tokens=20, seed=5, stop_below=0.0).tokens == fixed.tokens
    one = speculative_generate(target, draft, prompts, gamma=1, max_new_tokens=20, seed=5)
    stopped = speculative_generate(target, draft, prompts, gamma=3, max_new_tokens=20, seed=5, stop_below=1.0)
    assert stopped.tokens == one.tokens and all(s.gamma == 1 for s in stopped.steps)


def test_adaptive_greedy_is_greedy_decoding_with_shorter_blocks():
    target = tiny_llama(48, seed=0, init_std=0.6)
    draft = tiny_llama(48, seed=0, init_std=0.6)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator) * p.std())
    greedy = SamplingConfig(temperature=0.0)
    want = autoregressive_generate(target, PROMPTS, max_new_tokens=24, sampling=greedy).tokens
    for prompts in (PROMPTS, PROMPTS[:1]):
        out = speculative_generate(target, draft, prompts, gamma=4, max_new_tokens=24, sampling=greedy, stop_below=0.9)
        assert out.tokens == tuple(want[: len(prompts)])
    single = speculative_generate(target, draft, PROMPTS[:1], gamma=4, max_new_tokens=24, seed=0, stop_below=0.9)
    assert {s.gamma for s in single.steps} - {4}  # some blocks ended early


def test_adaptive_loop_is_lossless_through_the_engine():
    """One prompt per call (the stop is batch-wide), N = 1,000: a smoke test of the engine path, detecting only gross
    deviations; the exact tests above are the proof. The draft's top probability is below 0.45 after four of its six
    tokens, so blocks end early in most steps."""
    target, draft = _markov(3), _markov(4)
    adaptive = lossless_test(target, draft, "block", [2, 5], sampling=SamplingConfig(), gamma=3, k=3, max_new_tokens=4,
                             num_samples=1_000, seed=7, batch_size=1, stop_below=0.45)
    assert adaptive.bonferroni_p_value > 1e-7 and adaptive.impossible == 0
    steps = [s.gamma for seed in range(5) for s in speculative_generate(target, draft, [[2, 5]], gamma=3, max_new_tokens=60,
                                                                         seed=seed, stop_below=0.45).steps]
    assert 0.3 < sum(g < 3 for g in steps) / len(steps) < 0.95


def test_stop_below_is_checked():
    target, draft = _markov(3), _markov(4)
    with pytest.raises(ValueError, match="stop_below must be"):
        speculative_generate(target, draft, [[2]], stop_below=1.5)
    with pytest.raises(ValueError, match="does not combine"):
        speculative_generate(target, draft, [[2]], verifier="rrs", num_drafts=2, stop_below=0.5)
