"""Gemma 4's assistants as a draft (``drafts.gemma4``): a tiny random-weight Gemma 4 pair (``models.families.
tiny_gemma4_pair``: a windowed layer then a global one, both storing their keys for sharing; window 6).

* Its drafts are transformers' assistant's: after a prompt of 12 tokens (past the window) and a chained second draft,
  the logits equal ``Gemma4AssistantForCausalLM``'s on the target's own shared keys and last hidden state (1e-5), with
  its head over centroid-picked tokens too; the controls: a window one position shorter, or the state of the slot
  itself in place of the slot before, move them.
* In the engine: greedy speculative decoding (chains of gamma 1 and 3, a sampled tree, a dynamic tree), two rows one of
  them left-padded, gives autoregressive decoding's tokens, and each row's as alone; a run with another target binds
  the draft to it (it reads the run's target's cache), and so does transformers' ``generate`` through ``engine.hf``
  with an unbound assistant; at T = 1 chains and K = 2
  traversal trees keep the target's law (exact Bonferroni test, false-positive rate <= 1e-6 each).
* Its published layout: a directory transformers saved it to is read by ``draft_from_name`` (``draft_format`` names
  it), in the target's dtype, Gemma 4 unified's assistant class too; a target that stores no keys for sharing (a
  Llama) is refused in one line.
"""

import pytest
import torch

from specresearch.config import SamplingConfig
from specresearch.drafts.gemma4 import Gemma4AssistantDraft
from specresearch.drafts.registry import draft_format, draft_from_name
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.experiments.stats import lossless_test
from specresearch.models.causal_lm import CausalLM
from specresearch.models.families import tiny_family_model, tiny_gemma4_pair

GREEDY = SamplingConfig(temperature=0.0)
PROMPT = [5, 9, 3, 17, 22, 8, 4, 7, 30, 31, 12, 40]  # 12 tokens: past the window of 6


def _theirs(target_model, assistant, prompt, token):
    """transformers' assistant on the target's forward of ``prompt``: the logits after ``token`` and after its argmax
    (chained, as its candidate generator drafts)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = target_model(input_ids=ids, output_hidden_states=True, return_shared_kv_states=True)
        state, shared = out.hidden_states[-1][:, -1:], dict(out.shared_kv_states)
        position, mask = torch.tensor([[len(prompt)]]), torch.ones(1, len(prompt) + 1, dtype=torch.long)
        logits = []
        for _ in range(2):
            embedding = target_model.get_input_embeddings()(token)
            step = assistant(inputs_embeds=torch.cat([embedding, state], -1), position_ids=position,
                             shared_kv_states=shared, attention_mask=mask)
            logits.append(step.logits[:, 0])
            token, state = step.logits.argmax(-1), step.last_hidden_state
    return logits


def _ours(draft, target, prompt, token, *, offset=1):
    ids = torch.tensor([prompt])
    _, features = target.prefill(ids, torch.ones_like(ids), hidden_layers=draft.feature_layers)
    draft.reset(1)
    draft.observe(features[:, -offset:][:, :1])
    first = draft.score(token)[:, -1]
    return [first, draft.score(first.argmax(-1)[:, None])[:, -1]]


def _ordered(assistant):
    """The same assistant with its head over centroid-picked tokens (``use_ordered_embeddings``)."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    config = Gemma4AssistantConfig(text_config=assistant.config.get_text_config().to_dict(),
                                   backbone_hidden_size=assistant.config.backbone_hidden_size, num_centroids=8,
                                   centroid_intermediate_top_k=4, use_ordered_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        ordered = Gemma4AssistantForCausalLM(config).eval()
        ordering = ordered.masked_embedding.token_ordering
        ordering.copy_(torch.randperm(ordering.numel()))
    return ordered


@pytest.mark.parametrize("ordered", [False, True])
def test_its_drafts_are_transformers_assistants(ordered):
    target_model, assistant = tiny_gemma4_pair(seed=0)
    assistant = _ordered(assistant) if ordered else assistant
    token = torch.tensor([[33]])
    theirs = _theirs(target_model, assistant, PROMPT, token)
    draft = Gemma4AssistantDraft(assistant, CausalLM(target_model))
    ours = _ours(draft, draft.target, PROMPT, token)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ours, theirs))
    draft.window -= 1  # the control: a window one position shorter
    assert not torch.allclose(_ours(draft, draft.target, PROMPT, token)[0], theirs[0], atol=1e-3)
    draft.window += 1  # the control: the state of the slot itself, not the slot before
    assert not torch.allclose(_ours(draft, draft.target, PROMPT, token, offset=2)[0], theirs[0], atol=1e-3)


def test_in_the_engine_its_greedy_drafts_give_the_targets_tokens_and_rows_decode_as_alone():
    target_model, assistant = tiny_gemma4_pair(seed=0)
    target = CausalLM(target_model)
    draft = Gemma4AssistantDraft(assistant, target)
    prompts = [PROMPT, PROMPT[:5]]
    want = autoregressive_generate(target, prompts, max_new_tokens=12, sampling=GREEDY).tokens
    runs = [dict(gamma=1), dict(gamma=3), dict(gamma=3, num_drafts=2, verifier="traversal"),
            dict(gamma=3, num_drafts=2, verifier="onehot", draft_law="dynamic")]
    for options in runs:
        assert speculative_generate(target, draft, prompts, max_new_tokens=12, sampling=GREEDY, **options).tokens == want
    alone = speculative_generate(target, draft, prompts[1:], max_new_tokens=12, sampling=GREEDY, gamma=3).tokens
    assert alone[0] == want[1]
    other = CausalLM(target_model)  # another run's target: the draft is bound to it and reads its cache
    assert speculative_generate(other, draft, prompts, max_new_tokens=12, sampling=GREEDY, gamma=3).tokens == want
    assert draft.target is other


def test_inside_transformers_generate_an_unbound_assistant_drafts_for_the_model_generate_runs():
    from specresearch.engine import hf

    target_model, assistant = tiny_gemma4_pair(seed=0)
    ids = torch.tensor([PROMPT])
    want = target_model.generate(ids, max_new_tokens=10, do_sample=False)
    draft = Gemma4AssistantDraft(assistant)  # bound by engine.hf to the wrapper it puts around target_model
    out = target_model.generate(ids, max_new_tokens=10, do_sample=False, custom_generate=hf.speculative(draft, gamma=3))
    assert torch.equal(out, want) and draft.target.model is target_model


@pytest.mark.parametrize("rule, trees", [("block", 1), ("token", 1), ("traversal", 2)])
def test_at_temperature_one_it_keeps_the_targets_law(rule, trees):
    target_model, assistant = tiny_gemma4_pair(seed=0)
    target = CausalLM(target_model)
    result = lossless_test(target, Gemma4AssistantDraft(assistant, target), rule, [5, 9, 3, 17],
                           sampling=SamplingConfig(), gamma=3, k=3, max_new_tokens=4, num_samples=4_000, seed=0,
                           batch_size=2_000, num_drafts=trees)
    assert result.impossible == 0 and result.bonferroni_p_value > 1e-6, result.p_value


@pytest.mark.parametrize("unified", [False, True])
def test_its_published_layout_is_read_and_a_target_without_shared_keys_refused(tmp_path, unified):
    target_model, assistant = tiny_gemma4_pair(seed=0)
    if unified:  # Gemma 4 unified's assistant: the same architecture under its own model type
        from transformers import Gemma4UnifiedAssistantConfig, Gemma4UnifiedAssistantForCausalLM

        config = Gemma4UnifiedAssistantConfig(text_config=assistant.config.get_text_config().to_dict(),
                                              backbone_hidden_size=assistant.config.backbone_hidden_size)
        twin = Gemma4UnifiedAssistantForCausalLM(config).eval()
        twin.load_state_dict(assistant.state_dict())
        assistant = twin
    assistant.save_pretrained(tmp_path)
    assert "Gemma 4 assistant" in draft_format(tmp_path)
    target = CausalLM(target_model)
    draft = draft_from_name(str(tmp_path), target)
    assert isinstance(draft, Gemma4AssistantDraft) and type(draft.assistant) is type(assistant)
    token = torch.tensor([[33]])
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(_ours(draft, target, PROMPT, token),
                                                                _theirs(target_model, assistant, PROMPT, token)))
    with pytest.raises(ValueError, match=r"stores none: use it with the Gemma 4 model"):
        draft_from_name(str(tmp_path), CausalLM(tiny_family_model("llama", "eager")))
