"""Rotary embeddings whose frequencies transformers picks per call (``models.rotary``): Phi-3's ``longrope`` (long
factors once a call reaches past ``original_max_position_embeddings``) and dynamic NTK scaling.

* A tiny Phi-3 with long factors, its original length 16, a prompt of 11 and 20 tokens, which pass it: greedy
  speculative decoding (chains of gamma 1, 3, 5, a traversal tree) gives autoregressive decoding's tokens, each the
  argmax of its prefix's uncached forward on the model as transformers built it (the short set up to 16 positions,
  the long one past them: ``models.prefix_sets``), which is transformers' ``generate`` (it recomputes Phi-3's cache
  at the crossing); two rows of different lengths decode as each alone; a run within the original length, or past
  it from its prompt on, is what transformers decodes; the static cache with a draft of the same kind decodes a run
  past it from its prompt as the growing loop, and refuses one that crosses it (``static_available`` says why,
  ``compile='auto'`` runs the growing loop).
* The cached calls of a run that crosses the length (a prompt, a chain call straddling it, a tree), two left-padded
  rows: each slot's logits and hidden states are its prefix's uncached forward's; once every row is past the length
  one forward a call is left.
* The control: with the run's set only (the prefix sets left out), the tokens before the crossing are not the
  model's.
* Planned, the static form's calls of a captured step trace as one graph (no host read), both sets.
* The decoding methods (``engine.decoding``) plan each call's length, rebuilding the cache where the set changes:
  greedy decoding draws each token from its prefix's set, as transformers' ``generate`` and the engine's run do, each
  row of a left-padded batch too.
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


def _prefix_argmax(make, prompt, new):
    """Greedy decoding by each prefix's uncached forward on the model as transformers builds it."""
    model, sequence = make(), list(prompt)
    with torch.no_grad():
        for _ in range(new):
            sequence.append(int(model(input_ids=torch.tensor([sequence])).logits[0, -1].argmax()))
    return sequence[len(prompt):]


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
    if kind == "dynamic":  # its set changes at every length past the original (rotary.set_change): one set a run,
        theirs = model.generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False)  # on the mended model
        assert theirs[0, len(PROMPT):].tolist() == list(want[0])
        with torch.no_grad():  # the uncached forward of the whole run: its argmax at each emitted position
            logits = model(input_ids=theirs).logits[0, len(PROMPT) - 1:-1]
        assert logits.argmax(-1).tolist() == list(want[0])
    else:  # each token from its prefix's set, as transformers built the model
        assert list(want[0]) == _prefix_argmax(MODELS[kind], PROMPT, 20)
        if kind != "longrope-per-layer-type":  # Phi-3's and PhiMoE's generate recompute the cache at the crossing
            theirs = MODELS[kind]().generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False)
            assert theirs[0, len(PROMPT):].tolist() == list(want[0])
    short = PROMPT[:7]
    both, _ = _decodings(target, [PROMPT, short], 20)
    assert list(both[0]) == list(want[0]) and list(both[1]) == list(_decodings(target, [short], 20)[0][0])


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("context", [8, 31])  # the original set, the long one
def test_a_planned_rotary_traces_in_a_captured_step_as_one_graph(kind, context):
    target = CausalLM(MODELS[kind]())
    target.plan_context(context, context)  # prompts past the change: one set; no host read left in its forward: what torch.compile and a CUDA graph need
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
    assert ours[0, len(PROMPT):].tolist() == list(autoregressive_generate(
        CausalLM(long_phi3()), [PROMPT], max_new_tokens=20, sampling=GREEDY).tokens[0])
    short = PROMPT[:7]  # a batch: a row within the length while the other passes it keeps its prefix's set
    ids, mask = torch.tensor([PROMPT, [0] * 4 + short]), torch.tensor([[1] * 11, [0] * 4 + [1] * 7])
    both = greedy(lm_logits_fn(CausalLM(long_phi3())), ids, 20, attention_mask=mask).sequences
    assert both[1, 11:].tolist() == _prefix_argmax(long_phi3, short, 20) and torch.equal(both[0], ours[0])


@pytest.mark.parametrize("kind", ["longrope", "longrope-moe", "longrope-per-layer-type"])
def test_the_cached_calls_of_a_run_that_crosses_the_original_length_are_each_prefixs_uncached_forward(kind):
    reference, target = MODELS[kind](), CausalLM(MODELS[kind]())
    forwards = []
    target.model.register_forward_hook(lambda *_: forwards.append(1))
    rows = [PROMPT, PROMPT[:7]]  # 11 and 7 tokens, left-padded: the first row crosses 16 in the chain call below
    target.plan_context(len(PROMPT) + 20, 7)
    ids = torch.tensor([rows[0], [0] * 4 + rows[1]])
    mask = torch.tensor([[1] * 11, [0] * 4 + [1] * 7])
    sequences = [list(rows[0]), list(rows[1])]

    def expect(b, prefix):  # logits and layer-1 hidden state of row b's prefix of that length, uncached
        with torch.no_grad():
            out = reference(input_ids=torch.tensor([sequences[b][:prefix]]), output_hidden_states=True)
        return out.logits[0, -1], out.hidden_states[1][0, -1]

    logits, hidden = target.prefill(ids, mask, hidden_layers=[1])
    for b in range(2):
        assert torch.allclose(logits[b], expect(b, len(rows[b]))[0], atol=1e-4)
    chain = torch.tensor([[3, 8, 2, 9, 4, 11, 6, 5], [7, 1, 9, 2, 8, 3, 4, 6]])  # row 0: prefixes 12..19
    logits, hidden = target.score(chain, hidden_layers=[1])
    for b in range(2):
        sequences[b] += chain[b].tolist()
        for j in range(8):
            want_logits, want_hidden = expect(b, len(rows[b]) + j + 1)
            assert torch.allclose(logits[b, j], want_logits, atol=1e-4), (b, j)
            assert torch.allclose(hidden[b, j], want_hidden, atol=1e-4), (b, j)
    target.rollback([6, 2])  # kept: row 0 at 13 tokens (within 16), row 1 at 13
    sequences = [sequences[0][:13], sequences[1][:13]]
    target.begin_tree()  # a root at depth 0 and two children; then a grandchild: prefixes 14..16 and 17
    depth = torch.tensor([[0, 1, 1, 2, 3], [0, 1, 1, 2, 3]])
    visible = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]],
                           dtype=torch.bool).expand(2, 5, 5)
    nodes = torch.tensor([[4, 12, 13, 14, 15], [21, 22, 23, 24, 25]])
    logits = target.score_tree(nodes, depth, visible)
    for b in range(2):
        for i, path in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 3, 4]]):
            tokens = sequences[b] + nodes[b, path].tolist()
            with torch.no_grad():
                want = reference(input_ids=torch.tensor([tokens])).logits[0, -1]
            assert torch.allclose(logits[b, i], want, atol=1e-4), (b, i)
    target.end_tree(torch.tensor([[1, 1, 0, 1, 1], [1, 1, 0, 1, 1]]))  # both rows at 17 tokens: past 16
    before = len(forwards)
    target.score(torch.tensor([[5], [6]]))
    assert len(forwards) - before == 1  # the short cache is no longer kept


@pytest.mark.parametrize("kind", ["longrope", "longrope-moe"])
def test_with_the_runs_set_only_the_tokens_before_the_crossing_are_not_the_models(kind, monkeypatch):
    monkeypatch.setattr(rotary, "set_change", lambda model, context: None)  # the control: no prefix sets
    want = autoregressive_generate(CausalLM(MODELS[kind]()), [PROMPT], max_new_tokens=20, sampling=GREEDY).tokens[0]
    assert list(want) != _prefix_argmax(MODELS[kind], PROMPT, 20)


def test_a_static_cache_decodes_a_run_past_the_length_from_its_prompt_and_refuses_one_that_crosses_it():
    from specresearch.engine.static import static_available

    target, draft = CausalLM(long_phi3()), CausalLM(long_phi3())
    prompt = PROMPT * 2  # 22 tokens: past 16 from the prompt on, one set
    want = autoregressive_generate(target, [prompt], max_new_tokens=10, sampling=GREEDY).tokens
    assert speculative_generate(target, draft, [prompt], max_new_tokens=10, sampling=GREEDY, gamma=3,
                                compile="static").tokens == want
    assert rotary.planned_context(draft.model) == len(prompt) + 10
    with pytest.raises(ValueError, match=r"changes its rotary set past position 16.*compile='off'"):
        speculative_generate(target, draft, [PROMPT], max_new_tokens=20, sampling=GREEDY, gamma=3, compile="static")
    assert "prefix's set" in static_available(target, draft)  # planned by the run: compile='auto' takes the loop


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

    def make():
        rope = dict(rope_type=kind, rope_theta=10000.0, **ROPE_TYPES[kind])
        model = _drawn(AutoConfig.for_model("llama", **SMALL, max_position_embeddings=64, rope_parameters=rope))
        model.model.rotary_emb.original_max_seq_len = 16  # dynamic NTK's (transformers: max_position_embeddings)
        return model

    model = make()
    target = CausalLM(model)
    want, runs = _decodings(target, [PROMPT], 20)
    assert all(run == want for run in runs)
    if kind == "longrope":  # its set changes at 16: each token from its prefix's
        assert list(want[0]) == _prefix_argmax(make, PROMPT, 20)
        return
    with torch.no_grad():  # one set (dynamic NTK: the run's, rotary.set_change), the whole run's uncached forward
        logits = model(input_ids=torch.tensor([PROMPT + list(want[0])])).logits[0, len(PROMPT) - 1:-1]
    assert logits.argmax(-1).tolist() == list(want[0])

