"""Dial drafts (specresearch.drafts.dial): the perturbed law they define, cache coherence through the engine,
greedy equality and losslessness (they are ordinary drafts), on tiny random models.

The only statistical assertion is the losslessness test: the exact conservative (Bonferroni-binomial)
p-value of ``stats.lossless_test`` must exceed 1e-7, so a correct engine fails with probability < 1e-7.
"""

import pytest
import torch
from helpers import check_warm_up_gives_back

from specresearch.config import SamplingConfig
from specresearch.drafts.dial import DialDraft, dial_draft_from_name, is_dial_name
from specresearch.drafts.registry import draft_from_name
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.experiments.stats import lossless_test
from specresearch.models.causal_lm import CausalLM
from specresearch.models.toy import tiny_llama

VOCAB = 16


@pytest.fixture(scope="module")
def pair():
    return tiny_llama(VOCAB, seed=0, init_std=0.6), tiny_llama(VOCAB, seed=1, init_std=0.6)


def _dial(target, other, kind="mix", amount=0.5):
    return DialDraft(CausalLM(target.model, device="cpu"), kind, amount, other if kind == "mix" else None)


def _fresh_probs(model, ids):
    with torch.no_grad():
        return torch.softmax(model.model(input_ids=torch.tensor([ids])).logits[0, -1].double(), -1)


@pytest.mark.parametrize(("kind", "amount"), [("mix", 0.3), ("uniform", 0.6), ("temperature", 2.0), ("mix", 0.0)])
def test_logits_define_the_documented_raw_law(pair, kind, amount):
    target, other = pair
    ids = [3, 1, 4, 1, 5]
    draft = _dial(target, other, kind, amount)
    q = torch.softmax(draft.prefill(torch.tensor([ids]), torch.ones(1, 5, dtype=torch.long))[0].double(), -1)
    p, d = _fresh_probs(target, ids), _fresh_probs(other, ids)
    if kind == "mix":
        want = amount * p + (1 - amount) * d
    elif kind == "uniform":
        want = amount * p + (1 - amount) / VOCAB
    else:
        with torch.no_grad():
            want = torch.softmax(target.model(input_ids=torch.tensor([ids])).logits[0, -1].double() / amount, -1)
    torch.testing.assert_close(q, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(q, p, atol=1e-3)  # the perturbation is visible


def test_full_weight_on_the_target_stays_exact_through_rollbacks(pair):
    """lam = 1: q = p at every step of a batched, left-padded run (rows of different lengths, per-row
    rollbacks of the last block), so the dial's own cache follows the target's (overlap sum_x min(p, q) = 1)."""
    target, other = pair
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    out = speculative_generate(target, _dial(target, other, "mix", 1.0), prompts, verifier="block", gamma=3,
                               max_new_tokens=20, sampling=SamplingConfig(temperature=1.0), seed=[1, 2, 3],
                               expectations=("token", "block"))
    overlaps = [o for s in out.steps for o, a in zip(s.overlap, s.active) if a]
    assert len(overlaps) >= 3 * 5 and min(overlaps) > 1 - 1e-5
    half = speculative_generate(target, _dial(target, other, "mix", 0.5), prompts, verifier="block", gamma=3,
                                max_new_tokens=20, sampling=SamplingConfig(temperature=1.0), seed=[1, 2, 3],
                                expectations=("token",))
    assert min(o for s in half.steps for o in s.overlap) < 0.99  # the overlap does measure the perturbation


@pytest.mark.parametrize("verifier", ["token", "block"])
def test_greedy_speculative_equals_greedy_autoregressive(pair, verifier):
    target, other = pair
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    greedy = SamplingConfig(temperature=0.0)
    reference = autoregressive_generate(target, prompts, max_new_tokens=12, sampling=greedy)
    for kind, amount in (("mix", 0.4), ("uniform", 0.3), ("temperature", 3.0)):
        out = speculative_generate(target, _dial(target, other, kind, amount), prompts, verifier=verifier, gamma=4,
                                   max_new_tokens=12, sampling=greedy)
        assert out.tokens == reference.tokens


def test_lossless_with_a_dial_draft(pair):
    """The output law equals the target's (exact conservative p-value > 1e-7: false-positive rate < 1e-7)."""
    target, other = pair
    result = lossless_test(target, _dial(target, other, "mix", 0.4), "block", [1, 2, 3],
                           sampling=SamplingConfig(temperature=1.0), gamma=3, k=3, num_samples=3000, seed=5,
                           batch_size=1000)
    assert result.impossible == 0
    assert result.bonferroni_p_value > 1e-7
    assert result.dof >= 10  # enough cells for the test to see a wrong law


def test_names_and_bad_input(pair):
    target, other = pair
    assert is_dial_name("dial-mix:0.5") and is_dial_name("dial-temp:2") and not is_dial_name("v8k-4l")
    draft = draft_from_name("dial-uniform:0.25", target)
    assert isinstance(draft, DialDraft) and (draft.kind, draft.amount) == ("uniform", 0.25)
    assert dial_draft_from_name("dial-temp:1.5", target).kind == "temperature"
    with pytest.raises(ValueError, match="name must be"):
        dial_draft_from_name("dial-mix", target)
    with pytest.raises(ValueError, match="not a number"):
        dial_draft_from_name("dial-uniform:half", target)
    with pytest.raises(ValueError, match="amount must be a mixture weight"):
        _dial(target, other, "mix", 1.5)
    with pytest.raises(ValueError, match="amount must be a temperature"):
        _dial(target, other, "temperature", 0.0)
    with pytest.raises(ValueError, match="other must be given"):
        DialDraft(CausalLM(target.model, device="cpu"), "uniform", 0.5, other)
    with pytest.raises(ValueError, match="kind must be one of"):
        DialDraft(CausalLM(target.model, device="cpu"), "noise", 0.5)
    with pytest.raises(ValueError, match="vocab_size"):
        DialDraft(CausalLM(target.model, device="cpu"), "mix", 0.5, tiny_llama(VOCAB + 1, seed=2))


@pytest.mark.parametrize(("kind", "amount"), [("mix", 0.7), ("uniform", 0.8), ("temperature", 1.5)])
def test_in_the_captured_steps_a_dial_draft_drafts_what_it_drafts_growing(pair, kind, amount):
    """Its static form (the target's and the mixed-in model's static forms, combined alike): greedy chains and a
    traversal tree give the target's tokens with the growing loop's accepted counts step for step but the last (cut
    there, not shortened; its drafts are accepted often, so the counts say something), T = 1 keeps the target's law
    (false-positive rate < 1e-7), and a warm-up gives back both models' extents. A dial mix with a feature head has none (refused in one line)."""
    target, other = pair
    draft = _dial(target, other, kind, amount)
    prompts, greedy = [[3, 1, 4, 1, 5], [2, 7]], SamplingConfig(temperature=0.0)
    want = autoregressive_generate(target, prompts, max_new_tokens=12, sampling=greedy).tokens
    for options in (dict(gamma=3), dict(gamma=2, num_drafts=2, verifier="traversal")):
        out = speculative_generate(target, draft, prompts, max_new_tokens=12, sampling=greedy, compile="static",
                                   **options)
        grown = speculative_generate(target, draft, prompts, max_new_tokens=12, sampling=greedy, **options)
        assert out.tokens == want and sum(map(sum, (s.num_accepted for s in out.steps))) > 6
        assert [s.num_accepted for s in out.steps][:-1] == [s.num_accepted for s in grown.steps][: len(out.steps) - 1]
    result = lossless_test(target, draft, "block", [3, 1, 4], sampling=SamplingConfig(), gamma=3, k=3,
                           max_new_tokens=4, num_samples=4_000, seed=0, batch_size=2_000, compile="static")
    assert result.impossible == 0 and result.bonferroni_p_value > 1e-7, result.p_value
    check_warm_up_gives_back(target, draft, prompts, dict(gamma=3))  # both models' extents (held_rows)


def test_a_dial_mix_with_a_feature_head_has_no_static_form(pair):
    from helpers import feature_head

    from specresearch.drafts.feature import FeatureDraft
    from specresearch.engine.static import static_available

    target, _ = pair
    mixed = DialDraft(CausalLM(target.model, device="cpu"), "mix", 0.5, FeatureDraft(feature_head(target.model)))
    assert "a dial mix with FeatureDraft, which has no whole-model static form" in static_available(target, mixed)
