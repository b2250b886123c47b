"""Rotary embeddings whose frequencies transformers picks per call (``models.rotary``): Phi-3's ``longrope`` (long
factors once a call reaches past ``original_max_position_embeddings``) and dynamic NTK scaling.

* A tiny Phi-3 with long factors, its original length 16, runs of 31 positions: greedy speculative decoding (chains
  of gamma 1, 3, 5, a traversal tree, the static cache with a draft of the same kind) gives autoregressive decoding's tokens, which are transformers'
  ``generate``'s and its uncached forward's argmax on the same (mended) model; two rows of different lengths decode
  as each alone; a run within the original length, or past it from its prompt on, is what transformers decodes
  unmended (a run whose prompt is within it and its tokens pass it is not: transformers recomputes Phi-3's cache
  with the long set once the sequence passes the original length, so its first tokens came from the short set).
* Planned, the static form's calls of a captured step trace as one graph (no host read), both sets.
* The decoding methods (``engine.decoding``) plan each call's length, rebuilding the cache where the set changes:
  greedy decoding draws each token from its prefix's set, transformers' ``generate`` on Phi-3 (which recomputes its
  cache at the crossing), unlike the engine's run, which rotates the whole run by one set.
* Unplanned, a call past the original length raises, naming the plan.
* The control: unmended, speculative decoding emits other tokens than autoregressive decoding.
* A draft that wraps models of such a kind (prompt lookup or the model; the dial's mixture) plans them.
* Inside transformers' ``generate`` (``engine.hf``): the run is planned, and the caller's target rotates as
  transformers built it afterwards.
* PhiMoE (its forward scales cos and sin by ``long_mscale`` past the original length, ``short_mscale`` within it, per
  call): the same.
* Every rope type transformers offers (linear, dynamic, YaRN, longrope, Llama 3, proportional) on a Llama, a run
  past the original length: speculative decoding = autoregressive = the uncached forward's argmax.
* Gemma 3 with long factors on its full layers only (rotary settings per layer type): the same.
* Dynamic NTK (a Llama whose rotary's original length is lowered to 16, which transformers sets to the config's
  ``max_position_embeddings``, so that the engine reaches past it): the same.
"""

import warnings

import pytest
import torch
from helpers import explain_static_calls

from specresearch.config import SamplingConfig
from specresearch.drafts.registry import draft_from_name
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.models import rotary
from specresearch.models.causal_lm import CausalLM

GREEDY = SamplingConfig(temperature=0.0)
PROMPT = [5, 9, 3, 17, 22, 8, 4, 7, 30, 31, 3]  # 11 tokens: 20 more pass the original length of 16
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=None)  # every run its full length


def _drawn(config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.5)
    return model


def long_phi3():
    from transformers import AutoConfig

    rope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 4, long_factor=[4.0, 3.0, 2.0, 8.0],
                original_max_position_embeddings=16)
    return _drawn(AutoConfig.for_model("phi3", **SMALL, max_position_embeddings=128,
                                       original_max_position_embeddings=16, rope_parameters=rope))


def long_phimoe():
    from transformers import AutoConfig

    rope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 4, long_factor=[4.0, 3.0, 2.0, 8.0],
                original_max_position_embeddings=16, short_mscale=1.0, long_mscale=1.8)
    return _drawn(AutoConfig.for_model("phimoe", **SMALL, max_position_embeddings=128, num_local_experts=4,
                                       num_experts_per_tok=2, rope_parameters=rope))


def gemma3_long_full_layers():
    from transformers import AutoConfig

    rope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 4, long_factor=[4.0, 3.0, 2.0, 8.0],
                original_max_position_embeddings=16)
    return _drawn(AutoConfig.for_model("gemma3_text", **SMALL, head_dim=8, max_position_embeddings=128, sliding_window=6,
                                       layer_types=["sliding_attention", "full_attention"],
                                       rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=1e4),
                                                        "full_attention": rope}))


def dynamic_llama():
    from transformers import AutoConfig

    model = _drawn(AutoConfig.for_model("llama", **SMALL, max_position_embeddings=64,
                                        rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0)))
    model.model.rotary_emb.original_max_seq_len = 16
    return model


MODELS = {"longrope": long_phi3, "longrope-moe": long_phimoe, "longrope-per-layer-type": gemma3_long_full_layers,
          "dynamic": dynamic_llama}


def _decodings(target, prompts, new):
    want = autoregressive_generate(target, prompts, max_new_tokens=new, sampling=GREEDY).tokens
    draft = draft_from_name("ngram", target)
    runs = [speculative_generate(target, draft, prompts, max_new_tokens=new, sampling=GREEDY, gamma=gamma).tokens
            for gamma in (1, 3, 5)]
    return want, runs


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_call_dependent_rotary_decodes_speculatively_as_autoregressively_past_its_original_length(kind):
    model = MODELS[kind]()
    target = CausalLM(model)
    assert rotary.planned_context(model) is None
    want, runs = _decodings(target, [PROMPT], 20)
    assert rotary.planned_context(model) == len(PROMPT) + 20
    assert all(run == want for run in runs)
    tree = speculative_generate(target, draft_from_name("ngram", target), [PROMPT], max_new_tokens=20, sampling=GREEDY,
                                gamma=3, num_drafts=2, verifier="traversal").tokens
    assert tree == want
    if kind == "longrope":  # a static form (the captured steps' cache), run eagerly; a draft of the same kind
        draft = CausalLM(long_phi3())
        assert speculative_generate(target, draft, [PROMPT], max_new_tokens=20, sampling=GREEDY, gamma=3,
                                    compile="static").tokens == want
        assert rotary.planned_context(draft.model) == len(PROMPT) + 20
    theirs = model.generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False)
    assert theirs[0, len(PROMPT):].tolist() == list(want[0])
    with torch.no_grad():  # the uncached forward of the whole run: its argmax at each emitted position
        logits = model(input_ids=theirs).logits[0, len(PROMPT) - 1:-1]
    assert logits.argmax(-1).tolist() == list(want[0])
    short = PROMPT[:7]
    both, _ = _decodings(target, [PROMPT, short], 20)
    assert list(both[0]) == list(want[0]) and list(both[1]) == list(_decodings(target, [short], 20)[0][0])


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("context", [8, 31])  # the original set, the long one
def test_a_planned_rotary_traces_in_a_captured_step_as_one_graph(kind, context):
    target = CausalLM(MODELS[kind]())
    target.plan_context(context)  # no host read left in its forward: what torch.compile and a CUDA graph need
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        explained = explain_static_calls(target.static_form())
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.parametrize("kind", ["longrope", "longrope-moe"])
@pytest.mark.parametrize("prompt, new", [(PROMPT, 5), (PROMPT * 2, 10)])  # 16 positions; a prompt of 22
def test_a_run_within_the_original_length_or_past_it_from_the_prompt_is_what_transformers_decodes_unmended(kind, prompt,
                                                                                                          new):
    target = CausalLM(MODELS[kind]())
    want = autoregressive_generate(target, [prompt], max_new_tokens=new, sampling=GREEDY).tokens
    theirs = MODELS[kind]().generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
    assert theirs[0, len(prompt):].tolist() == list(want[0])


def test_the_decoding_methods_draw_each_token_from_its_prefix_as_transformers_phi3_does():
    from specresearch.engine.decoding import greedy, lm_logits_fn

    ids = torch.tensor([PROMPT])  # 11 tokens and 20 more: the set changes at the crossing, the cache is rebuilt
    ours = greedy(lm_logits_fn(CausalLM(long_phi3())), ids, 20).sequences
    theirs = long_phi3().generate(ids, max_new_tokens=20, do_sample=False)  # recomputes its cache at the crossing
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours[0, len(PROMPT):], torch.tensor(autoregressive_generate(
        CausalLM(long_phi3()), [PROMPT], max_new_tokens=20, sampling=GREEDY).tokens[0]))  # one set for the run


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_an_unplanned_call_past_the_original_length_raises(kind):
    target = CausalLM(MODELS[kind]())
    target.prefill(torch.tensor([PROMPT]), torch.ones(1, len(PROMPT), dtype=torch.long))
    with pytest.raises(ValueError, match=r"reaches position 17 past its original 16.*plan_context"):
        target.score(torch.tensor([[5] * 6]))


@pytest.mark.parametrize("kind", ["longrope", "longrope-moe"])
def test_unmended_speculative_decoding_emits_other_tokens_than_autoregressive(kind, monkeypatch):
    monkeypatch.setattr(rotary, "fix_rotaries", lambda model: 0)  # the control: frequencies chosen per call
    target = CausalLM(MODELS[kind]())
    want, runs = _decodings(target, [PROMPT], 20)
    assert all(run != want for run in runs)


@pytest.mark.parametrize("wrapper", ["lookup-or-draft", "dial"])
def test_a_draft_that_wraps_a_model_plans_it(wrapper):
    from specresearch.drafts.combined import LookupOrDraft
    from specresearch.drafts.dial import DialDraft

    target, inner, other = CausalLM(long_phi3()), CausalLM(long_phi3()), CausalLM(long_phi3())
    want = autoregressive_generate(target, [PROMPT], max_new_tokens=20, sampling=GREEDY).tokens
    draft = LookupOrDraft(inner) if wrapper == "lookup-or-draft" else DialDraft(inner, "mix", 0.5, other)
    assert speculative_generate(target, draft, [PROMPT], max_new_tokens=20, sampling=GREEDY, gamma=3).tokens == want
    planned = [inner] if wrapper == "lookup-or-draft" else [inner, other]
    assert all(rotary.planned_context(lm.model) == len(PROMPT) + 20 for lm in planned)


def test_inside_transformers_generate_the_run_is_planned_and_the_callers_target_left_as_built():
    from specresearch.engine import hf

    model = long_phi3()
    want = autoregressive_generate(CausalLM(long_phi3()), [PROMPT], max_new_tokens=20, sampling=GREEDY).tokens
    out = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=20,
                         custom_generate=hf.speculative(long_phi3(), gamma=3))
    assert out[0, len(PROMPT):].tolist() == list(want[0])
    rotary_emb = model.model.rotary_emb
    assert "forward" not in vars(rotary_emb) and rotary.planned_context(model) is None
    assert torch.equal(rotary_emb.inv_freq, long_phi3().model.rotary_emb.inv_freq)


# every rope type transformers offers, on a Llama whose original length (16) a run of 31 positions passes
ROPE_TYPES = {
    "linear": dict(factor=2.0),
    "dynamic": dict(factor=4.0),
    "yarn": dict(factor=4.0, original_max_position_embeddings=16),
    "longrope": dict(short_factor=[1.0] * 4, long_factor=[4.0, 3.0, 2.0, 8.0], original_max_position_embeddings=16),
    "llama3": dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16),
    "proportional": dict(factor=2.0, partial_rotary_factor=0.5),
}


def test_every_rope_type_transformers_offers_has_settings_here():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert set(ROPE_INIT_FUNCTIONS) == set(ROPE_TYPES)  # a new type: give it settings above


@pytest.mark.parametrize("kind", sorted(ROPE_TYPES))
def test_a_run_past_the_original_length_decodes_alike_whatever_the_rope_type(kind):
    from transformers import AutoConfig

    rope = dict(rope_type=kind, rope_theta=10000.0, **ROPE_TYPES[kind])
    model = _drawn(AutoConfig.for_model("llama", **SMALL, max_position_embeddings=64, rope_parameters=rope))
    model.model.rotary_emb.original_max_seq_len = 16  # dynamic NTK's (transformers: max_position_embeddings)
    target = CausalLM(model)
    want, runs = _decodings(target, [PROMPT], 20)
    assert all(run == want for run in runs)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT + list(want[0])])).logits[0, len(PROMPT) - 1:-1]
    assert logits.argmax(-1).tolist() == list(want[0])

