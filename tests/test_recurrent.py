"""Targets and drafts with recurrent layers (``models.recurrent``): linear attention, state spaces, short convolutions.

* Families (tiny, random weights): Qwen3.5 (Gated DeltaNet beside gated attention), Qwen3-Next, Mamba and
  Falcon-Mamba (no attention layer: they take the call's columns of the 2-D mask), Mamba-2, Jamba (whose scan
  overwrites the cached state before transformers records it), Bamba, Falcon-H1 (attention and a state space in
  one layer), Granite-4 hybrid, Nemotron-H (MLP-only layers), OLMo-hybrid, Kimi Linear (latent attention beside
  Kimi Delta Attention), Zamba2, LFM2 (short convolutions), RecurrentGemma, Inkling's three variants, Zaya and Zamba
  (scored one token at a time: their layers record their state once a call; the control scores calls whole):
  ``CausalLM``'s chain probe passes at
  construction (uneven per-row rollbacks within a call and across one-token calls, each call's logits against an
  uncached forward), greedy speculative decoding gives the autoregressive tokens, and those are transformers' own
  ``generate``'s.
* A call of more than KEEP tokens after a cached state goes in pieces: Mamba's and Jamba's kernels scan the rest of a
  longer call from a zero state.
* Windows beside recurrent layers (Lara mini): the cache keeps full attention layers where the config names sliding
  ones, and the recurrent layers take the call's columns of the 2-D mask in the mapping of masks.
* Mamba-2 mixers (Mamba-2, Bamba, Granite-4 hybrid, Falcon-H1, Nemotron-H, Zamba2) with a bounded time step: transformers
  bounds it in their scans only; mended (``recurrent.clamp_time_steps``), their forward moves by a rounding, the probe
  takes them and greedy decoding is transformers' ``generate``'s and speculative decoding's; unmended (the control), the
  probe refuses them. Zamba2, which bounds its own, is among the families above.
* RecurrentGemma, whose recurrent blocks keep their states on themselves in transformers (``models.griffin`` moves
  them into the cache): the mended forward is transformers' uncached forward (its recurrence wider than the model too);
  a left-padded row decodes as alone; unmended (the control), the probe refuses it in one line.
* Refused in one line: captured steps of a recurrent target's trees (its chains have them: ``tests/test_static_states.py``).
* Inkling 1, 2 and 2-loop (short convolutions, a relative bias and log scaling that transformers counts in cache
  slots): mended to read positions off the masks, a chain, uneven rollbacks, a tree and a token after it match an
  uncached forward; unmended (the control) they do not, and the probe refuses them.
* Its draft trees run one row per path, giving its greedy tokens (sampled and dynamic trees).
* T = 1: a Qwen3.5 target with a Llama draft (chains and K = 2 traversal trees), and a Llama target with a Qwen3.5
  draft, keep the target's law (exact Bonferroni test, false-positive rate <= 1e-6 each).
* Rows: after ``select_rows`` / ``repeat_rows`` each row's next logits are an uncached forward's; the records stay
  bounded on a long run without rollbacks.
"""

import pytest
import torch
from helpers import tree_path, visible_from_parents

from specresearch.config import SamplingConfig
from specresearch.drafts.registry import draft_from_name
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.engine.static import static_available
from specresearch.experiments.stats import lossless_test
from specresearch.models import griffin, recurrent
from specresearch.models.attention import attention_layout
from specresearch.models.causal_lm import CausalLM
from specresearch.models.families import RECURRENT_FAMILIES, tiny_recurrent_model
from specresearch.models.probe import logit_gap
from specresearch.models.toy import tiny_llama

GREEDY = SamplingConfig(temperature=0.0)
PROMPTS = [[5, 9, 3, 17, 22, 8], [7, 2, 11]]


def _uncached(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0, -1].float()


@pytest.mark.parametrize("family", sorted(RECURRENT_FAMILIES))
def test_a_recurrent_family_passes_the_chain_probe_and_decodes_greedily_as_itself_and_transformers(family):
    model = tiny_recurrent_model(family)
    target = CausalLM(model)  # the probe runs here: it raises on any call that differs from an uncached forward
    assert target.recurrent
    want = autoregressive_generate(target, PROMPTS, max_new_tokens=10, sampling=GREEDY).tokens
    theirs = model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=10, do_sample=False)[0, len(PROMPTS[0]):]
    assert list(want[0])[: len(theirs)] == theirs.tolist() and len(theirs) >= 5
    draft = draft_from_name("ngram", target)
    for gamma in (1, 3):
        assert speculative_generate(target, draft, PROMPTS, max_new_tokens=10, sampling=GREEDY, gamma=gamma).tokens == want


BOUNDED = ["mamba2", "bamba", "granitemoehybrid", "falcon_h1", "nemotron_h", "zamba2"]  # Mamba-2 mixers


@pytest.mark.parametrize("family", BOUNDED)
def test_a_mamba2_mixer_bounds_its_time_step_in_cached_steps_as_in_its_scan(family, monkeypatch):
    # Zamba2 bounds it itself (below, by time_step_min); the others as a checkpoint may (Nemotron 3: [1e-4, 0.1])
    options = RECURRENT_FAMILIES[family] if family == "zamba2" else {**RECURRENT_FAMILIES[family],
                                                                     "time_step_limit": (0.05, 0.5)}
    reference = tiny_recurrent_model(family, options)
    tokens = [5, 9, 3, 17, 22, 8, 4, 7, 30, 31]
    with torch.no_grad():
        before = reference(input_ids=torch.tensor([tokens])).logits
    assert recurrent.clamp_time_steps(reference) == len(recurrent_mixers(reference)) > 0
    assert recurrent.clamp_time_steps(reference) == 0  # once
    with torch.no_grad():  # the forward (the scan) moves by a rounding at the limit only
        assert logit_gap(reference(input_ids=torch.tensor([tokens])).logits, before) < 1e-5
    model = tiny_recurrent_model(family, options)
    target = CausalLM(model)  # the probe: each cached call against an uncached forward
    want = autoregressive_generate(target, PROMPTS, max_new_tokens=10, sampling=GREEDY).tokens
    theirs = model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=10, do_sample=False)[0, len(PROMPTS[0]):]
    assert list(want[0])[: len(theirs)] == theirs.tolist() and len(theirs) >= 5
    assert speculative_generate(target, draft_from_name("ngram", target), PROMPTS, max_new_tokens=10,
                                sampling=GREEDY, gamma=3).tokens == want
    monkeypatch.setattr(recurrent, "clamp_time_steps", lambda model: 0)  # the control: steps unbounded
    with pytest.raises(ValueError, match="otherwise than an uncached forward"):
        CausalLM(tiny_recurrent_model(family, options))


def recurrent_mixers(model) -> list:
    return [module for module in model.modules() if hasattr(module, "time_step_limit")]


@pytest.mark.parametrize("lru_width", [32, 48])  # the model's width, and wider (transformers sizes a state by the former)
def test_recurrent_gemma_keeps_its_blocks_states_in_the_cache_and_decodes_a_padded_row_as_alone(lru_width, monkeypatch):
    options = {**RECURRENT_FAMILIES["recurrent_gemma"], "lru_width": lru_width}
    reference, model = tiny_recurrent_model("recurrent_gemma", options), tiny_recurrent_model("recurrent_gemma", options)
    tokens = torch.tensor([[5, 9, 3, 17, 22, 8, 4, 7, 30, 31]])
    assert griffin.keep_states_in_cache(model) == 3 and griffin.keep_states_in_cache(model) == 0  # each block, once
    with torch.no_grad():  # the same arithmetic as transformers' blocks on a whole sequence
        assert logit_gap(model(input_ids=tokens).logits, reference(input_ids=tokens, use_cache=False).logits) < 1e-6
    target = CausalLM(model)  # the probe: chains, uneven rollbacks, each call against an uncached forward
    want = autoregressive_generate(target, PROMPTS, max_new_tokens=10, sampling=GREEDY).tokens
    assert want[1] == autoregressive_generate(target, PROMPTS[1:], max_new_tokens=10, sampling=GREEDY).tokens[0]
    theirs = reference.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=10, do_sample=False)[0, len(PROMPTS[0]):]
    assert list(want[0]) == theirs.tolist()
    monkeypatch.setattr(griffin, "keep_states_in_cache", lambda model: 0)  # the control: states on the blocks
    with pytest.raises(ValueError, match=r"fails CausalLM.s probe .*RecurrentGemmaForCausalLM.s cache holds \d+ tokens"):
        CausalLM(tiny_recurrent_model("recurrent_gemma", options))


def test_trees_run_path_by_path_captured_trees_are_refused_and_a_draft_may_be_recurrent():
    target = CausalLM(tiny_recurrent_model("qwen3_5_text"))
    llama = tiny_llama(64, seed=1, init_std=0.5)
    want = autoregressive_generate(target, PROMPTS, max_new_tokens=10, sampling=GREEDY).tokens
    for options in (dict(num_drafts=3, gamma=3, verifier="traversal"),
                    dict(num_drafts=2, gamma=3, verifier="onehot", draft_law="dynamic")):  # the target: one row a path
        assert speculative_generate(target, llama, PROMPTS, max_new_tokens=10, sampling=GREEDY, **options).tokens == want
    assert static_available(target, llama) is None  # chains have captured steps (tests/test_static_states.py)
    assert "recurrent layers" in static_available(target, llama, num_drafts=3, verifier="traversal")
    # transformers' recurrent kernels compute in float32: a float64 model is probed at float32's tolerance, and taken
    assert CausalLM(tiny_recurrent_model("qwen3_5_text").double()).recurrent
    want = autoregressive_generate(llama, PROMPTS, max_new_tokens=10, sampling=GREEDY).tokens
    for options in (dict(gamma=4), dict(num_drafts=2, gamma=3, verifier="traversal"),
                    dict(num_drafts=2, gamma=3, verifier="onehot", draft_law="dynamic")):  # the draft runs chains
        assert speculative_generate(llama, target, PROMPTS, max_new_tokens=10, sampling=GREEDY, **options).tokens == want


def test_a_recurrent_target_and_a_recurrent_draft_keep_the_targets_law():
    qwen = CausalLM(tiny_recurrent_model("qwen3_5_text"))
    llama = tiny_llama(64, seed=1, init_std=0.5)
    for target, draft, rule, trees in ((qwen, llama, "block", 1), (llama, qwen, "block", 1), (qwen, llama, "traversal", 2)):
        result = lossless_test(target, draft, rule, [5, 9, 3, 17], sampling=SamplingConfig(), gamma=3, k=3,
                               max_new_tokens=4, num_samples=4_000, seed=0, batch_size=2_000, num_drafts=trees)
        assert result.impossible == 0 and result.bonferroni_p_value > 1e-6, (type(target.model).__name__, result.p_value)


def test_rows_selected_and_repeated_keep_their_states_and_records_stay_bounded():
    model = tiny_recurrent_model("qwen3_5_text")
    lm = CausalLM(model)
    prompts = [[5, 9, 3, 17], [0, 0, 7, 2], [0, 11, 4, 8]]
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1]])
    lm.prefill(torch.tensor(prompts), mask)
    histories = [[t for t, m in zip(p, row) if m] for p, row in zip(prompts, mask.tolist())]
    lm.score(torch.tensor([[30, 31, 32]] * 3))
    lm.rollback([0, 2, 1])
    histories = [h + [30, 31, 32][: 3 - n] for h, n in zip(histories, [0, 2, 1])]
    lm.select_rows(torch.tensor([2, 0]))
    lm.repeat_rows(2)  # rows 2, 2, 0, 0
    rows = [histories[2], histories[2], histories[0], histories[0]]
    after = lm.score(torch.tensor([[40], [41], [42], [43]]))[:, 0]
    for i, (row, token) in enumerate(zip(rows, [40, 41, 42, 43])):
        assert torch.allclose(after[i], _uncached(model, row + [token]), atol=1e-4), i
    lm.prefill(torch.tensor([[5, 9]]), torch.ones(1, 2, dtype=torch.long))
    for token in range(100):
        lm.score(torch.tensor([[token % 60]]))
    for layer in recurrent.recurrent_layers(lm._cache):
        assert len(layer.recurrent_states_history[0]) <= recurrent.KEEP + 1
        assert layer.conv_states[0].shape[-1] <= recurrent.KEEP + 1 + layer.conv_kernel_size[0]
    with pytest.raises(ValueError, match="can undo the"):
        lm.rollback(recurrent.KEEP + 2)


@pytest.mark.parametrize("family", ["mamba", "jamba"])
def test_a_long_call_after_a_cached_state_goes_in_pieces_and_matches_the_forward(family):
    # Mamba v1's and Jamba's kernels scan all but a call's last KEEP tokens from a zero state: one 150-token call after
    # the prompt was 11 off the logits' forward; CausalLM scores it KEEP tokens at a time
    model = tiny_recurrent_model(family)
    lm = CausalLM(model)
    tokens = torch.randint(3, 64, (2, 220), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 70, dtype=torch.long)
    mask[1, :9] = 0  # a left-padded row
    lm.prefill(tokens[:, :70], mask)
    got = lm.score(tokens[:, 70:])
    for row, start in enumerate([0, 9]):
        with torch.no_grad():
            want = model(input_ids=tokens[row:row + 1, start:]).logits[0, 70 - start:].float()
        assert torch.allclose(got[row], want, atol=1e-4), (row, (got[row] - want).abs().max())


INKLING = ["inkling_text", "inkling2_text", "inkling2_loop_text"]


def _inkling_gap(lm: CausalLM, model) -> float:
    """Two rows (one left-padded) through a chain call, uneven rollbacks, a draft tree (path by path) and a token
    after it: the largest difference of ``lm``'s logits from an uncached forward of each node's history, as the
    probe measures it (a fraction of the logits' scale)."""
    parents, depth = [-1, 0, 1, 0, 3, 2], torch.tensor([[0, 1, 2, 1, 2, 3]] * 2)
    lm.prefill(torch.tensor([[5, 9, 3, 17, 22, 8], [0, 0, 0, 7, 2, 11]]), torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]]))
    histories, worst = [[5, 9, 3, 17, 22, 8], [7, 2, 11]], 0.0
    chain = [30, 31, 32, 33]
    logits = lm.score(torch.tensor([chain, chain]))
    for b in range(2):
        worst = max(worst, max(logit_gap(logits[b, i], _uncached(model, histories[b] + chain[:i + 1]))
                               for i in range(4)))
    lm.rollback([1, 3])
    histories = [histories[0] + chain[:3], histories[1] + chain[:1]]
    rows = torch.tensor([[12, 40, 41, 42, 43, 44], [13, 45, 46, 47, 48, 49]])
    lm.begin_tree()
    logits = lm.score_tree(rows, depth, visible_from_parents(parents).expand(2, -1, -1))
    for b in range(2):
        worst = max(worst, max(logit_gap(logits[b, i], _uncached(model, histories[b] + tree_path(rows[b], parents, i)))
                               for i in range(6)))
    lm.end_tree(torch.tensor([[True, True, True, False, False, True], [True, False, False, True, True, False]]))
    histories = [histories[0] + [12, 40, 41, 44], histories[1] + [13, 47, 48]]
    logits = lm.score(torch.tensor([[50], [51]]))
    for b, token in enumerate((50, 51)):
        worst = max(worst, logit_gap(logits[b, 0], _uncached(model, histories[b] + [token])))
    return worst


@pytest.mark.parametrize("family", INKLING)
def test_inkling_places_its_relative_bias_and_log_scale_by_position(family, monkeypatch):
    """Inkling's attention gathers a relative bias at (query slot - key slot) and log-scales its full layers' queries
    and bias by the query's slot count (Inkling 2: by the position ids it is handed); after uneven rollbacks and in
    a tree's paths a slot is not a position. ``positions_from_masks`` takes both from the masks: a chain, uneven
    rollbacks, a tree and a token after it give an uncached forward's logits (windows of 6, a bias extent of 8 and the
    log scaling from position 2 all reached), on each kernel the family offers. The controls: unmended, its logits
    are off and the probe refuses it; Inkling 1 with the bias mended but its scale left by slot is off too."""
    for kernel in ("eager", "sdpa") if family == "inkling_text" else ("eager",):  # Inkling 2 offers eager only
        model = tiny_recurrent_model(family)
        model.set_attn_implementation(kernel)
        assert _inkling_gap(CausalLM(model), model) < 1e-4, kernel
    import specresearch.models.causal_lm as causal_lm
    import specresearch.models.positions as positions

    unmended = tiny_recurrent_model(family)
    with monkeypatch.context() as patch:
        patch.setattr(positions, "slot_placement", lambda model, config: None)
        patch.setattr(causal_lm, "positions_from_masks", lambda model: False)
        assert _inkling_gap(CausalLM(unmended, probe=False), unmended) > 1e-2
        with pytest.raises(ValueError, match="otherwise than an uncached forward"):
            CausalLM(unmended)
    with pytest.raises(ValueError, match="takes its relative position bias"):
        attention_layout(unmended)
    if family == "inkling_text":
        lm = CausalLM(tiny_recurrent_model(family), probe=False)
        for module in lm.model.modules():
            if getattr(module, "specresearch_tau", None):  # the full layer: its scale by slot again
                module.config, module.specresearch_tau = lm.model.config, None
                module.q_norm._forward_hooks.clear()
        assert _inkling_gap(lm, model) > 1e-2


@pytest.mark.parametrize("family", ["zaya", "zamba", "minimax"])
def test_a_family_recording_its_state_once_a_call_has_its_cached_calls_go_one_token_at_a_time(family, monkeypatch):
    """Zaya's, Zamba's and MiniMax's layers record their state once a call, not once a token (Zamba's one-token scan
    none: it updates the state in place, and the wrapper records its copy of the state before the call), so a call's
    tokens could not be rolled back one by one: ``CausalLM`` scores their cached calls one token at a time
    (``recurrent.ONE_TOKEN_CALLS``), and they pass the probe (the family test above). Scoring calls whole (the
    control), the probe's uneven rollbacks fail; so do Zamba's without the wrapper's record of a one-token call."""
    model = tiny_recurrent_model(family)
    assert recurrent.piece_size(model) == 1 and recurrent.piece_size(tiny_recurrent_model("qwen3_5_text")) == recurrent.KEEP
    with monkeypatch.context() as patch:
        patch.setattr(recurrent, "ONE_TOKEN_CALLS", ())
        with pytest.raises(ValueError, match="can undo the"):
            CausalLM(model)
    if family == "zamba":
        own = recurrent.after_call
        monkeypatch.setattr(recurrent, "after_call", lambda kept, tokens: own(kept, 0))
        with pytest.raises(ValueError, match="can undo the"):
            CausalLM(tiny_recurrent_model(family))


def test_minimax_runs_in_its_own_cache_class_and_windows_its_full_layers():
    """MiniMax's forward takes its own cache class only: the wrapper's is that class over transformers' layers, its
    lightning attention's state in a recorded layer (``recurrent._minimax_cache``; the family test above runs it:
    probe, greedy = ``generate``). With ``sliding_window`` set its full layers window although transformers' cache
    names them full (``attention.WINDOWS_FULL``): the probe takes it past the window of 6, and greedy decoding gives
    the tokens of its uncached forward's argmax, one token at a time. Unwindowed (the control), the probe refuses it.
    (transformers' own ``generate`` gives other tokens there: its cache's length is read off the first layer, a
    lightning layer, which counts none.)"""
    from specresearch.models import attention

    windowed = {**RECURRENT_FAMILIES["minimax"], "sliding_window": 6}
    model = tiny_recurrent_model("minimax", windowed)
    lm = CausalLM(model)
    assert dict(lm._attention.windows)["full_attention"] == 6
    tokens = autoregressive_generate(lm, PROMPTS, max_new_tokens=8, sampling=GREEDY).tokens
    for prompt, row in zip(PROMPTS, tokens):
        sequence = list(prompt)
        for _ in range(8):
            sequence.append(int(_uncached(model, sequence).argmax()))
        assert list(row) == sequence[len(prompt):]
    assert type(lm._cache).__name__ == "RecordedMiniMaxCache"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention, "WINDOWS_FULL", ())
        with pytest.raises(ValueError, match="probe"):
            CausalLM(tiny_recurrent_model("minimax", windowed))
