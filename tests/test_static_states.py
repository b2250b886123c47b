"""The static form of models with recurrent layers (``models.static_states``): the captured steps' cache for linear
attention, state spaces and short convolutions, which keep no slot per token.

* Every recurrent family the toolkit builds (``models.families.RECURRENT_FAMILIES``: Qwen3.5, Qwen3-Next, Mamba,
  Falcon-Mamba, Mamba-2, Jamba, Bamba, Falcon-H1, Granite-4 hybrid, Nemotron-H, OLMo-hybrid, Kimi Linear, Lara mini,
  LFM2, Zamba2, Zamba, Zaya, MiniMax (its own cache class), RecurrentGemma, Inkling 1 / 2 / 2-loop) scores
  ``models.probe.static_chain_calls`` as uncached forwards do (two left-padded rows, a chain kept to different counts
  per row, a draft's one-token calls kept across them, a chain after), within the probe's tolerance.
* A prompt of one token (nothing before the first step) starts from cleared states (the control keeps the first
  token's and decodes otherwise).
* Controls, each a mutation that must fail: a call handed the kept state itself (Zamba's one-token scan updates it in
  place), one count kept for every row (Qwen3.5, Mamba), Zamba's unrecorded one-token state left out, RecurrentGemma's
  block reading validity off the static mask.
* Through the engine (``compile="static"``): greedy chains with a Llama draft, with the model as its own draft, and
  autoregressive decoding give the growing loop's tokens (eight families); trees are refused (``static_available``),
  with a recurrent model behind prompt lookup or a dial draft too, whose chains run captured (one graph, compiled =
  eager, the warm-up giving back the wrapped model's states). The captured step is one graph, compiled
  (``aot_eager``) = eager at T = 1, and a warm-up gives back the kept states (``held_states``; left out, the check
  fails); a step reads the host once (the target or the draft recurrent, one row or two); a runner asks for its state
  when it prepares the step, after the prefill has made the recurrent buffers; inductor's compiled steps (Qwen3.5)
  decode as the eager ones, their first run included.
* The toolkit's feature head over a recurrent target (``drafts.feature.head_layer_config``: Qwen3.5's MLP and norms
  copied from its last layer, not its gated attention; Mamba without attention heads gets one of 32 here): greedy
  chains give the target's tokens in the growing loop and in captured steps.
* T = 1: captured chains keep the target's law (exact Bonferroni test, false-positive rate <= 1e-6), a Qwen3.5 target
  with a Llama draft and the reverse; seeded runs repeat.
"""

import pytest
import torch
from helpers import check_captured_step, check_warm_up_gives_back, feature_head, reads_per_step

from specresearch.config import SamplingConfig
from specresearch.drafts.combined import LookupOrDraft
from specresearch.drafts.dial import DialDraft
from specresearch.drafts.feature import FeatureDraft, head_layer_config
from specresearch.engine.captured import StepRunner
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.engine.prompts import encode_prompts
from specresearch.engine.static import StaticPlan, build_run, static_available, static_generate
from specresearch.experiments.stats import lossless_test
from specresearch.models.causal_lm import CausalLM
from specresearch.models.families import RECURRENT_FAMILIES, tiny_recurrent_model
from specresearch.models.probe import TOLERANCE, logit_gap, static_chain_calls
from specresearch.models.static_lm import StaticCausalLM
from specresearch.models.static_states import StaticStateLayer
from specresearch.models.toy import tiny_llama

GREEDY = SamplingConfig(temperature=0.0)
PROMPTS = [[5, 9, 3, 17, 22, 8], [7, 2, 11]]
STATIC = sorted(RECURRENT_FAMILIES)
BOUND = TOLERANCE[torch.float32]  # the probe's: max |difference| over the logits' scale


def _worst_gap(family: str) -> float:
    model, reference = tiny_recurrent_model(family), tiny_recurrent_model(family)
    lm = CausalLM(model, probe=False)
    gaps = []
    for logits, sequence in static_chain_calls(lm.static_form()):
        with torch.no_grad():
            want = reference(input_ids=torch.tensor([sequence])).logits[0, -1].float()
        gaps.append(logit_gap(logits, want))
    assert len(gaps) == 18  # 8 rows of the first chain, 6 of the drafted calls, 4 of the last chain
    return max(gaps)


@pytest.mark.parametrize("family", STATIC)
def test_the_static_form_of_a_recurrent_family_scores_chains_as_uncached_forwards(family):
    assert _worst_gap(family) < BOUND


def _handed_itself(layer):
    """The mutation: a call handed the kept state itself, not a copy."""
    layer.recorded = set()
    for i, held in layer.held.items():
        layer.recurrent_states[i] = held[layer.call.offset]
    for i, inputs in layer.inputs.items():
        layer.conv_states[i] = inputs[..., layer.call.offset: layer.call.offset + layer.conv_kernel_size[i]]


def _one_count(original):
    def commit(layer, n):
        original(layer, n.max().expand_as(n))
    return commit


@pytest.mark.parametrize("family, mutate", [
    ("zamba", lambda mp: mp.setattr(StaticStateLayer, "begin_call", _handed_itself)),
    ("qwen3_5_text", lambda mp: mp.setattr(StaticStateLayer, "commit", _one_count(StaticStateLayer.commit))),
    ("mamba", lambda mp: mp.setattr(StaticStateLayer, "commit", _one_count(StaticStateLayer.commit))),
    ("zamba", lambda mp: mp.setattr(StaticStateLayer, "end_call", lambda layer: None)),
    ("recurrent_gemma", lambda mp: mp.setattr(StaticStateLayer, "steps_only", False)),
])
def test_controls_each_mutation_scores_otherwise_than_an_uncached_forward(family, mutate, monkeypatch):
    mutate(monkeypatch)
    assert _worst_gap(family) > 10 * BOUND


ENGINE = ["qwen3_5_text", "mamba", "falcon_h1", "jamba", "zamba", "minimax", "recurrent_gemma", "lfm2"]


@pytest.mark.parametrize("family", ENGINE)
def test_captured_greedy_chains_on_a_recurrent_target_give_its_tokens(family):
    target = CausalLM(tiny_recurrent_model(family))
    llama = tiny_llama(64, seed=1, init_std=0.5)
    want = autoregressive_generate(target, PROMPTS, max_new_tokens=12, sampling=GREEDY).tokens
    assert autoregressive_generate(target, PROMPTS, max_new_tokens=12, sampling=GREEDY, compile="static").tokens == want
    for draft, gamma in ((llama, 3), (target, 2)):
        out = speculative_generate(target, draft, PROMPTS, max_new_tokens=12, sampling=GREEDY, gamma=gamma,
                                   compile="static")
        assert out.tokens == want, (family, gamma)
    # a recurrent draft for a Llama target: its re-feed kept in part, then one-token calls at offsets
    want = autoregressive_generate(llama, PROMPTS, max_new_tokens=12, sampling=GREEDY).tokens
    assert speculative_generate(llama, target, PROMPTS, max_new_tokens=12, sampling=GREEDY, gamma=4,
                                compile="static").tokens == want


@pytest.mark.parametrize("family", ["qwen3_5_text", "mamba", "zamba", "recurrent_gemma"])
def test_one_token_prompts_start_from_cleared_states(family, monkeypatch):
    """A prompt of one token leaves nothing before the first step: the buffers are made from it and cleared."""
    target = CausalLM(tiny_recurrent_model(family))
    prompts = [[5], [9]]
    want = autoregressive_generate(target, prompts, max_new_tokens=10, sampling=GREEDY).tokens
    assert autoregressive_generate(target, prompts, max_new_tokens=10, sampling=GREEDY, compile="static").tokens == want
    load = StaticStateLayer.load
    monkeypatch.setattr(StaticStateLayer, "load", lambda layer, grown, clear=False: load(layer, grown))
    if family == "qwen3_5_text":  # the control: the first token's states kept, and fed again by the first step
        assert autoregressive_generate(target, prompts, max_new_tokens=10, sampling=GREEDY,
                                       compile="static").tokens != want


def test_trees_and_wrappers_over_a_recurrent_model_are_refused():
    target = CausalLM(tiny_recurrent_model("qwen3_5_text"))
    llama = tiny_llama(64, seed=1, init_std=0.5)
    assert static_available(target, llama) is None and static_available(llama, target) is None
    for options in (dict(num_drafts=2, verifier="traversal"), dict(draft_law="dynamic", verifier="onehot")):
        assert "recurrent layers" in static_available(target, llama, **options)
        assert "recurrent layers" in static_available(llama, target, **options)
    with pytest.raises(ValueError, match="runs captured steps, but the target .* has recurrent layers"):
        speculative_generate(target, llama, PROMPTS, max_new_tokens=4, num_drafts=2, gamma=2, verifier="traversal",
                             compile="static")
    with pytest.raises(ValueError, match="scores chains, not trees"):
        static_generate(target, llama, PROMPTS, plan=StaticPlan("tree", "onehot", 2, 2, 4, "dynamic"), max_new_tokens=4,
                        sampling=GREEDY)
    for wrapper in (LookupOrDraft(target), DialDraft(target, "temperature", 1.5)):  # chains captured, trees refused
        assert wrapper.static_refusal is None and static_available(llama, wrapper) is None
        assert "recurrent layers" in static_available(llama, wrapper, num_drafts=2, verifier="traversal")


@pytest.mark.parametrize("wrap", ["lookup", "dial mix", "dial temperature"])
def test_prompt_lookup_and_dial_drafts_over_recurrent_models_run_captured_chains(wrap):
    """The wrappers hand their recurrent models the run's span and their kept states to the warm-up: greedy chains
    give the target's tokens, the step is one graph, compiled = eager, its warm-up gives back what it changes."""
    qwen = CausalLM(tiny_recurrent_model("qwen3_5_text"))
    llama = tiny_llama(64, seed=1, init_std=0.5)
    if wrap == "lookup":  # a recurrent draft behind prompt lookup, for a Llama target
        target, draft = llama, LookupOrDraft(qwen, draft_gamma=None)
    elif wrap == "dial mix":  # the recurrent target mixed with a Llama
        target, draft = qwen, DialDraft(CausalLM(qwen.model, device="cpu"), "mix", 0.5, llama)
    else:
        target, draft = qwen, DialDraft(CausalLM(qwen.model, device="cpu"), "temperature", 1.5)
    want = autoregressive_generate(target, PROMPTS, max_new_tokens=12, sampling=GREEDY).tokens
    assert speculative_generate(target, draft, PROMPTS, max_new_tokens=12, sampling=GREEDY, gamma=3,
                                compile="static").tokens == want
    check_captured_step(target, draft, PROMPTS, dict(gamma=3))


def test_a_captured_recurrent_step_is_one_graph_compiled_as_eager_and_its_warm_up_gives_back_the_states():
    target = CausalLM(tiny_recurrent_model("qwen3_5_text"))
    llama = tiny_llama(64, seed=1, init_std=0.5)
    check_captured_step(target, llama, PROMPTS, dict(gamma=3))  # the target recurrent
    check_captured_step(llama, target, PROMPTS, dict(gamma=2))  # the draft recurrent


def test_inductor_compiles_recurrent_steps_that_decode_as_the_eager_ones():
    """``compile="inductor"`` (the CPU's compiled mode): its first run, which warms the step up, gives the greedy
    tokens (the runner asked for its state before the prefill decoded others), and at T = 1 the eager static run's."""
    llama = tiny_llama(64, seed=1, init_std=0.5)
    target = CausalLM(tiny_recurrent_model("qwen3_5_text"))
    want = autoregressive_generate(target, PROMPTS, max_new_tokens=12, sampling=GREEDY).tokens
    assert speculative_generate(target, llama, PROMPTS, max_new_tokens=12, sampling=GREEDY, gamma=3,
                                compile="inductor").tokens == want
    runs = [speculative_generate(target, llama, PROMPTS, max_new_tokens=12, seed=7, gamma=3, compile=mode).tokens
            for mode in ("static", "inductor")]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("rows", [1, 2])
def test_a_captured_recurrent_step_reads_the_host_once(rows):
    """Every read a step makes (``engine.timing.HostReads``, long minus short run): one, the target recurrent and the
    draft recurrent, at T = 1, rows ending at different steps."""
    qwen = CausalLM(tiny_recurrent_model("qwen3_5_text"))
    llama = tiny_llama(64, seed=1, init_std=0.5)
    for target, draft in ((qwen, llama), (llama, qwen)):
        def run(n, target=target, draft=draft):
            return speculative_generate(target, draft, PROMPTS[:rows], max_new_tokens=n, gamma=3, compile="static")
        assert reads_per_step(run, (8, 24))["all"] == 1.0


def test_control_a_warm_up_that_leaves_the_kept_states_out_changes_the_run(monkeypatch):
    target = CausalLM(tiny_recurrent_model("falcon_h1"))
    llama = tiny_llama(64, seed=1, init_std=0.5)
    check_warm_up_gives_back(target, llama, PROMPTS, dict(gamma=3))
    monkeypatch.setattr(StaticCausalLM, "held_states", property(lambda self: []))
    with pytest.raises(AssertionError):
        check_warm_up_gives_back(target, llama, PROMPTS, dict(gamma=3))


def test_a_runner_asks_for_the_state_after_the_prefill_made_the_recurrent_buffers():
    target = CausalLM(tiny_recurrent_model("mamba"))
    ids, mask = encode_prompts(PROMPTS)
    run = build_run(target, None, plan=StaticPlan("autoregressive"), sampling=GREEDY, batch=2, capacity=(32, 0))
    early = run.small_state()  # the control: asked before the prefill, no recurrent state among them
    runner = StepRunner(run.step, "eager", run.small_state, "cpu")
    run.start(ids, mask, 8)
    kept = {t.data_ptr() for t in run.target.held_states}
    assert kept and kept <= {t.data_ptr() for t in runner.state}
    assert not kept & {t.data_ptr() for t in early}


@pytest.mark.parametrize("family", ["qwen3_5_text", "mamba", "zamba"])
def test_the_toolkits_feature_head_drafts_for_a_recurrent_target_in_both_loops(family):
    target = CausalLM(tiny_recurrent_model(family))
    sizes = head_layer_config(target.model.config)
    head = feature_head(target.model)
    if family == "mamba":  # no attention heads: one head as wide as the model (64 wide heads, at least one)
        assert (sizes.num_attention_heads, sizes.head_dim, sizes.rms_norm_eps) == (1, 32, target.model.config.layer_norm_epsilon)
    if family == "qwen3_5_text":  # its last layer's MLP copied (before the noise feature_head adds), not its attention
        last = target.model.model.layers[-1]
        copied = type(head)(target.model, head.config, seed=1).layers[0]
        assert torch.equal(copied.mlp.down_proj.weight, last.mlp.down_proj.weight.float())
        assert copied.self_attn.q_proj.weight.shape != last.self_attn.q_proj.weight.shape  # gated: twice as wide
    draft = FeatureDraft(head)
    want = autoregressive_generate(target, PROMPTS, max_new_tokens=12, sampling=GREEDY).tokens
    for compile in ("off", "static"):
        assert speculative_generate(target, draft, PROMPTS, max_new_tokens=12, sampling=GREEDY, gamma=3,
                                    compile=compile).tokens == want, compile


def test_captured_chains_on_recurrent_models_keep_the_targets_law_and_repeat_with_a_seed():
    qwen = CausalLM(tiny_recurrent_model("qwen3_5_text"))
    llama = tiny_llama(64, seed=1, init_std=0.5)
    for target, draft in ((qwen, llama), (llama, qwen)):
        result = lossless_test(target, draft, "block", [5, 9, 3, 17], sampling=SamplingConfig(), gamma=3, k=3,
                               max_new_tokens=4, num_samples=4_000, seed=0, batch_size=2_000, compile="static")
        assert result.impossible == 0 and result.bonferroni_p_value > 1e-6, (type(target.model).__name__, result.p_value)
    runs = [speculative_generate(qwen, llama, PROMPTS, max_new_tokens=10, gamma=3, seed=7, compile="static").tokens
            for _ in range(2)]
    assert runs[0] == runs[1]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("family", ["qwen3_5_text", "mamba", "falcon_h1"])
def test_cuda_captured_recurrent_steps_replay_what_eager_steps_compute(family):
    """On CUDA, captured chains of a recurrent target as CUDA graphs: greedy ones give its autoregressive tokens; at
    T = 1 their tokens equal the eager static run's from the same seed, twice."""
    target = CausalLM(tiny_recurrent_model(family), device="cuda")
    llama = CausalLM(tiny_llama(64, seed=1, init_std=0.5).model, device="cuda")
    want = autoregressive_generate(target, PROMPTS, max_new_tokens=12, sampling=GREEDY).tokens
    assert speculative_generate(target, llama, PROMPTS, max_new_tokens=12, sampling=GREEDY, gamma=3,
                                compile="cudagraph").tokens == want
    runs = [speculative_generate(target, llama, PROMPTS, max_new_tokens=12, seed=7, gamma=3, compile=mode).tokens
            for mode in ("static", "cudagraph", "cudagraph")]
    assert runs[0] == runs[1] == runs[2]
