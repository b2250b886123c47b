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
* Its static form (``drafts.gemma4.StaticGemma4Assistant``, the engine's captured steps): over the keys of the
  target's static cache, a re-feed of three slots gives each slot transformers' assistant's logits after its own
  prefix, and the chained draft after the last its second; after a tree step, the draft after the next token is
  transformers' on the kept path (1e-5); controls: a drafted token at its own slot's position (not the next token's),
  or the unkept nodes' keys seen, move them. ``compile="static"`` decodes chains and trees greedily as
  autoregressive decoding does, a step traces as one graph, compiled it computes the eager step's log at T = 1, and at
  T = 1 chains and traversal trees keep the law (exact Bonferroni, false-positive rate <= 1e-6 each).
* Its published layout: a directory transformers saved it to is read by ``draft_from_name`` (``draft_format`` names
  it), in the target's dtype, Gemma 4 unified's assistant class too; a target that stores no keys for sharing (a
  Llama) is refused in one line.
"""

import pytest
import torch
from helpers import check_captured_step

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


def _static_pair(target_model, assistant, prompt, refed: int):
    """The static forms: the target keeps ``prompt``; the assistant's rows stand ``refed - 1`` slots before the
    target's end (as after the captured loop's re-feed of ``refed`` slots whose last is the next token)."""
    draft = Gemma4AssistantDraft(assistant, CausalLM(target_model))
    target, static = draft.target.static_form(), draft.static_form()
    static.bind(target)
    ids = torch.tensor([prompt])
    target.allocate(1, 64)
    static.allocate(1, 64)
    _, features = target.prefill(ids, torch.ones_like(ids), hidden_layers=draft.feature_layers)
    static.prefill(ids, torch.ones_like(ids), leave=refed - 1)
    return target, static, features


def test_its_static_form_drafts_each_refed_slot_after_its_own_prefix():
    target_model, assistant = tiny_gemma4_pair(seed=0)
    token = torch.tensor([[33]])
    prompt = PROMPT + [33]  # the target keeps PROMPT; 33 is the next token
    target, static, features = _static_pair(target_model, assistant, PROMPT, 3)
    refed, inputs = torch.tensor([prompt[-3:]]), static.fuse(features[:, -3:])  # each slot's state of the slot before
    logits, predictions = static.forward(refed, inputs=inputs)
    for j, length in enumerate((len(prompt) - 2, len(prompt) - 1)):  # the re-fed slots before the next token
        theirs = _theirs(target_model, assistant, prompt[: length - 1], torch.tensor([[prompt[length - 1]]]))
        assert torch.allclose(logits[:, j], theirs[0], atol=1e-5)
    theirs = _theirs(target_model, assistant, PROMPT, token)
    second, _ = static.forward(logits[:, -1].argmax(-1)[:, None], inputs=predictions[:, -1:], offset=3)
    assert torch.allclose(logits[:, -1], theirs[0], atol=1e-5) and torch.allclose(second[:, 0], theirs[1], atol=1e-5)
    from specresearch.drafts.gemma4 import assistant_call  # the control: the second draft at its own slot's position

    uncapped, _ = assistant_call(static, target, logits[:, -1].argmax(-1)[:, None], predictions[:, -1:],
                                 torch.tensor([[len(prompt)]]))
    assert not torch.allclose(uncapped[:, 0], theirs[1], atol=1e-3)


def test_its_static_form_after_a_tree_step_sees_the_kept_path_only():
    """The target scores a tree [33; 41, 44; 47 under 44] and keeps [33, 41]: the unkept nodes stay in its buffers at
    positions before the next token's, and the draft after the next token is still transformers' on the kept prefix."""
    target_model, assistant = tiny_gemma4_pair(seed=0)
    target, static, _ = _static_pair(target_model, assistant, PROMPT, 1)
    tokens, depth = torch.tensor([[33, 41, 44, 47]]), torch.tensor([[0, 1, 1, 2]])
    visible = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]], dtype=torch.bool)
    _, hidden = target.forward(tokens, depth=depth, visible=visible, hidden_layers=static.feature_layers)
    target.keep_path(torch.tensor([[0, 1]]), torch.tensor([2]))
    static.commit(torch.tensor([2]))  # the re-feed of [33, 41] kept; 52 drafts from 41's state
    logits, _ = static.forward(torch.tensor([[52]]), inputs=static.fuse(hidden[:, 1:2]))
    theirs = _theirs(target_model, assistant, PROMPT + [33, 41], torch.tensor([[52]]))
    assert torch.allclose(logits[:, 0], theirs[0], atol=1e-5)
    target.rows.length.add_(2)  # the control: the unkept nodes' slots taken as kept (44's position is before 52's)
    static.rows.length.sub_(2)
    seen, _ = static.forward(torch.tensor([[52]]), inputs=static.fuse(hidden[:, 1:2]), offset=2)
    assert not torch.allclose(seen[:, 0], theirs[0], atol=1e-3)


STATIC_RUNS = [dict(gamma=1), dict(gamma=3), dict(gamma=3, num_drafts=2, verifier="traversal"),
               dict(gamma=3, num_drafts=2, verifier="onehot", draft_law="dynamic", tree_nodes=5)]


def test_in_the_captured_steps_its_greedy_drafts_give_the_targets_tokens():
    target_model, assistant = tiny_gemma4_pair(seed=0)
    target = CausalLM(target_model)
    draft = Gemma4AssistantDraft(assistant, target)
    prompts = [PROMPT, PROMPT[:5]]
    want = autoregressive_generate(target, prompts, max_new_tokens=12, sampling=GREEDY).tokens
    for options in STATIC_RUNS:
        out = speculative_generate(target, draft, prompts, max_new_tokens=12, sampling=GREEDY, compile="static",
                                   **options)
        assert out.tokens == want and all(record.target_seconds != record.target_seconds for record in out.steps)


@pytest.mark.parametrize("options", [STATIC_RUNS[1], STATIC_RUNS[3]], ids=["chain", "dynamic tree"])
def test_its_captured_step_traces_as_one_graph_and_compiled_computes_the_eager_step(options):
    target_model, assistant = tiny_gemma4_pair(seed=0)
    target = CausalLM(target_model)
    check_captured_step(target, Gemma4AssistantDraft(assistant, target), [PROMPT, PROMPT[:5]], options)


@pytest.mark.parametrize("rule, trees", [("block", 1), ("traversal", 2)])
def test_in_the_captured_steps_at_temperature_one_it_keeps_the_targets_law(rule, trees):
    target_model, assistant = tiny_gemma4_pair(seed=0)
    target = CausalLM(target_model)
    result = lossless_test(target, Gemma4AssistantDraft(assistant, target), rule, [5, 9, 3, 17],
                           sampling=SamplingConfig(), gamma=3, k=3, max_new_tokens=4, num_samples=4_000, seed=0,
                           batch_size=2_000, num_drafts=trees, compile="static")
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
