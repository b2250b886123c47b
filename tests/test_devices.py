"""Devices: randomness drawn where its generator lives, float64 only where the device has it, the transformers route
leaving the caller's model as it was, and (marker ``cuda``, run by ``scripts/gpu_check.sh``; skipped on a machine
without CUDA) the engine on a GPU: greedy equality and sampled losslessness for every draft kind built from a config."""

import pytest
import torch
from helpers import feature_head

from specresearch.config import SamplingConfig
from specresearch.core.draws import draw_uniforms, uniforms, wide
from specresearch.core.sampling import sample_tokens
from specresearch.core.verify import block_verify
from specresearch.models.toy import tiny_llama

VOCAB = 48
GREEDY = SamplingConfig(temperature=0.0)
PROMPTS = [[5, 9, 2, 33, 7, 5, 9], [4, 8], [16, 23, 42, 3]]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh runs these)")


def test_uniforms_are_drawn_on_the_generators_device_and_moved_where_asked():
    """A CPU generator serving probabilities elsewhere draws on the CPU (the same stream as ever) and hands the
    uniforms over; "meta" stands in for a GPU here, as a device no CPU generator can draw on."""
    g = torch.Generator().manual_seed(3)
    moved = uniforms((2, 4), g, "meta")
    assert moved.device.type == "meta" and moved.dtype == torch.float64 and moved.shape == (2, 4)
    drawn = draw_uniforms(2, 3, torch.Generator().manual_seed(3))
    assert torch.equal(drawn, torch.rand(2, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64))
    assert wide(torch.ones(2)).dtype == torch.float64


def test_the_transformers_route_leaves_the_callers_model_as_it_was():
    """``hf.generate`` wraps a user's model for the engine without switching its layers, its attention or its mode."""
    from specresearch.engine import hf

    target, draft = tiny_llama(VOCAB, seed=0, init_std=0.6).model, tiny_llama(VOCAB, seed=1, init_std=0.6).model
    for model in (target, draft):
        model.train()
    before = [(type(m), m.config._attn_implementation, m.training) for m in (target, draft)]
    classes = [sorted({type(m).__name__ for m in model.modules()}) for model in (target, draft)]
    out = hf.generate(target, torch.tensor([[5, 9, 2]]), assistant_model=draft, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 9)
    assert [(type(m), m.config._attn_implementation, m.training) for m in (target, draft)] == before
    assert [sorted({type(m).__name__ for m in model.modules()}) for model in (target, draft)] == classes


# ------------------------------------------------------------------------------------------------------------------
# On a CUDA device (scripts/gpu_check.sh)


def _cuda_pair():
    from specresearch.models.causal_lm import CausalLM

    target = CausalLM(tiny_llama(VOCAB, seed=0, init_std=0.6, num_layers=3).model, device="cuda")
    return target


def _cuda_drafts(target):
    from specresearch.drafts.combined import LookupOrDraft
    from specresearch.drafts.dial import DialDraft
    from specresearch.drafts.feature import FeatureDraft
    from specresearch.drafts.ngram import NGramDraft
    from specresearch.drafts.registry import truncated_draft
    from specresearch.models.causal_lm import CausalLM

    head = feature_head(target.model, seed=2, scale=0.1)
    return {
        "truncated": lambda: truncated_draft(target, 1),
        "ngram": lambda: NGramDraft(VOCAB, max_ngram=2, device="cuda"),
        "feature": lambda: FeatureDraft(head, device="cuda"),
        "lookup+feature": lambda: LookupOrDraft(FeatureDraft(head, device="cuda"), min_match=1, draft_gamma=1),
        "dial": lambda: DialDraft(CausalLM(target.model, device="cuda"), "uniform", 0.7),
    }


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("kind", ["truncated", "ngram", "feature", "lookup+feature", "dial"])
def test_cuda_greedy_speculative_equals_greedy_autoregressive(kind):
    from specresearch.engine.generate import autoregressive_generate, speculative_generate

    target = _cuda_pair()
    reference = autoregressive_generate(target, PROMPTS, max_new_tokens=16, sampling=GREEDY)
    out = speculative_generate(target, _cuda_drafts(target)[kind](), PROMPTS, gamma=3, max_new_tokens=16, sampling=GREEDY)
    assert out.tokens == reference.tokens
    if kind in ("truncated", "ngram", "dial"):
        tree = speculative_generate(target, _cuda_drafts(target)[kind](), PROMPTS, verifier="traversal", num_drafts=2,
                                    gamma=3, max_new_tokens=16, sampling=GREEDY)
        assert tree.tokens == reference.tokens


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("kind", ["truncated", "ngram", "feature", "dial"])
def test_cuda_sampled_output_follows_the_target_law(kind):
    """Chi-square of the first 2 tokens over 4,000 runs against the exact law (``experiments.stats.lossless_test``;
    its ``FPR_NOTE`` states the false-positive rate, 1e-3 here)."""
    from specresearch.experiments.stats import lossless_test

    target = _cuda_pair()
    result = lossless_test(target, _cuda_drafts(target)[kind](), "block", PROMPTS[1], sampling=SamplingConfig(temperature=1.0),
                           gamma=2, k=2, max_new_tokens=3, num_samples=4000, seed=0, batch_size=500)
    assert not result.rejects(1e-3), result


@pytest.mark.cuda
@CUDA
def test_cuda_probabilities_take_a_cpu_generator():
    """The README's CPU generator with probabilities on the GPU: verifiers and the sampler draw on the CPU."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 3, VOCAB, generator=g), -1).cuda()
    q = torch.softmax(torch.randn(4, 2, VOCAB, generator=g), -1).cuda()
    x = torch.randint(0, VOCAB, (4, 2), generator=g).cuda()
    result = block_verify(p, q, x, torch.Generator().manual_seed(1))
    assert result.next_token.device.type == "cuda"
    assert sample_tokens(p[:, 0], torch.Generator().manual_seed(2)).device.type == "cuda"
    assert sample_tokens(p[:, 0], torch.Generator(device="cuda").manual_seed(2)).device.type == "cuda"
