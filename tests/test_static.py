"""Captured steps over static caches (``engine.static``, ``models.static_cache``): a static cache scores as an uncached
forward does, the static forms of the drafts draft what their growing forms draft, the captured loop gives the
target's greedy tokens and keeps its law at T = 1, reads the host once a step, compiles as one graph without a break
and computes compiled what it computes eagerly. The family x kernel matrix holds the captured steps against
transformers' ``generate`` too (``tests/test_families.py``)."""

import functools
import math

import pytest
import torch
from helpers import close_draft, feature_head, reads_per_step, visible_from_parents

from specresearch.config import SamplingConfig
from specresearch.drafts.eagle import Eagle3Head, EagleDraft
from specresearch.drafts.feature import FeatureDraft, FeatureHeadConfig
from specresearch.drafts.ngram import NGramDraft
from specresearch.engine import static
from specresearch.engine.captured import StepRunner, warm_up
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.engine.prompts import encode_prompts
from specresearch.engine.static import StaticPlan, start_run
from specresearch.experiments.stats import lossless_test
from specresearch.models.causal_lm import CausalLM
from specresearch.models.families import tiny_family_model
from specresearch.models.probe import static_form_calls
from specresearch.models.toy import ToyLM, tiny_llama

VOCAB = 48
GREEDY, SAMPLED = SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0)
PROMPTS = [[5, 9, 2, 33, 7, 5, 9], [4, 8], [16, 23, 42, 3], [7]]
EOS = 21  # ends some rows early (token 21 is frequent in the target's greedy continuations)
PLANS = {
    "chain block g3": StaticPlan("chain", "block", 3),
    "chain token g2": StaticPlan("chain", "token", 2),
    "chain greedy g1": StaticPlan("chain", "greedy", 1),
    "dynamic K3 g3 n7": StaticPlan("tree", "onehot", 3, 3, 7),
    "static K2 g4 n6": StaticPlan("tree", "onehot", 4, 2, 6, law="static"),
    "traversal K3 g2": StaticPlan("tree", "traversal", 2, 3, 6, law="iid"),
    "rrs w/o repl. K2 g3": StaticPlan("tree", "rrs_without_replacement", 3, 2, 6, law="without_replacement"),
}
OPTIONS = {  # the same runs through speculative_generate
    "chain block g3": dict(verifier="block", gamma=3),
    "chain token g2": dict(verifier="token", gamma=2),
    "chain greedy g1": dict(verifier="greedy", gamma=1),
    "dynamic K3 g3 n7": dict(verifier="onehot", gamma=3, num_drafts=3, tree_nodes=7, draft_law="dynamic"),
    "static K2 g4 n6": dict(verifier="onehot", gamma=4, num_drafts=2, tree_nodes=6, draft_law="static"),
    "traversal K3 g2": dict(verifier="traversal", gamma=2, num_drafts=3),
    "rrs w/o repl. K2 g3": dict(verifier="rrs_without_replacement", gamma=3, num_drafts=2,
                                draft_law="without_replacement"),
}


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB, seed=0, init_std=0.6)  # close_draft() is this model with 10 % noise


@pytest.fixture(scope="module")
def drafts(target):
    config = FeatureHeadConfig("e3", feature_layers=(0, 1, 2), init_layer=None, head_tokens=16, train_head=True,
                               architecture="eagle3")
    eagle = EagleDraft(Eagle3Head.from_feature_config(target.model, config, torch.arange(16) * 3, seed=3))
    return {"model": close_draft(), "feature": FeatureDraft(feature_head(target.model)), "eagle3": eagle}


# -- the static cache -------------------------------------------------------------------------------------------------


def _uncached(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0, -1].float()


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gpt2"])
@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_a_static_cache_scores_chains_and_trees_as_an_uncached_forward(family, kernel):
    """Two left-padded rows of 9 and 4 tokens (past Mistral's and Gemma-2's 6-slot windows), a chain call whose last
    token is dropped, a tree call of five nodes (two branches) and the tree's path kept: each logit row equals an
    uncached forward of its own sequence (atol 1e-4, float32)."""
    try:
        model = tiny_family_model(family, kernel)
    except (ValueError, ImportError):
        pytest.skip(f"transformers has no {kernel} {family}")
    for logits, sequence in static_form_calls(CausalLM(model, device="cpu", skinny_linear=False).static_form()):
        torch.testing.assert_close(logits, _uncached(model, sequence), atol=1e-4, rtol=0)


def test_a_kept_path_is_copied_in_the_same_kernels_for_every_layer_count():
    """A target's layers share one ``KVStack``, so keeping a tree's path copies all of them in one gather and one
    scatter a buffer: the same kernels for 2 and 6 layers (``engine.timing.Kernels``; a buffer a layer took 4 more a
    layer). And a stack's copy is the layers' own: a stack and per-layer buffers holding the same keys and values
    agree after the same copy (overlapping source and destination slots)."""
    from specresearch.engine.timing import Kernels
    from specresearch.models.static_cache import KVStack, StaticKV

    counts = []
    for layers in (2, 6):
        lm = tiny_llama(48, seed=0, num_layers=layers).static_form()
        lm.allocate(2, 32)
        ids, mask = encode_prompts([[5, 9, 3, 7], [12, 13]])
        lm.prefill(ids, mask)
        lm.forward(torch.tensor([[30, 31, 32], [35, 36, 37]]), depth=torch.tensor([[0, 1, 1]] * 2),
                   visible=visible_from_parents([-1, 0, 0]).expand(2, -1, -1))
        assert len({id(kv.stack) for kv in lm._kvs}) == 1 and len(lm._kvs) == layers
        with Kernels() as kernels:
            lm.keep_path(torch.tensor([[0, 2], [0, 1]]), torch.tensor([2, 1]))
        counts.append(kernels.count)
    assert counts[0] == counts[1], counts
    generator = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 2, 3, 6, 4, generator=generator), torch.randn(2, 2, 3, 6, 4, generator=generator)
    stack = KVStack(2, 2, 6, keys[0, :, :, :1], values[0, :, :, :1])
    stack.keys.copy_(keys), stack.values.copy_(values)
    own = [StaticKV(keys[i].clone(), values[i].clone()) for i in range(2)]
    source, destination = torch.tensor([[2, 4], [1, 3]]), torch.tensor([[1, 2], [1, 2]])
    stack.copy_slots(source, destination)
    for i, kv in enumerate(own):
        kv.copy_slots(source, destination)
        assert torch.equal(stack.take().keys, kv.keys) and torch.equal(stack.values[i], kv.values)


@pytest.mark.parametrize("kind", ["feature", "eagle3"])
def test_a_static_feature_head_drafts_what_its_growing_form_drafts(target, drafts, kind):
    """A prompt with true features, then two drafted slots read with the head's own predictions: the static form's
    logits equal the growing form's (``FeatureDraft``; EAGLE's first prompt slot left out in both), to 1e-5 and 1e-5
    of each logit (float32's rounding between the two forms' kernels: 1.2e-5 on a logit of 4 on an AVX-512 CPU)."""
    draft = drafts[kind]
    ids, mask = encode_prompts([[3, 4, 5, 6, 7], [1, 1, 8, 9, 10]])
    mask[1, :2] = 0
    features = torch.randn(2, 5, draft.feature_size, generator=torch.Generator().manual_seed(0))
    draft.observe(features)
    grown = [draft.prefill(ids, mask)]
    for token in (11, 12):
        grown.append(draft.score(torch.tensor([[token], [token]]))[:, 0])
    still = draft.static_form()
    still.allocate(2, 32)
    logits, hidden = still.prefill(ids, mask, inputs=still.fuse(features))
    static = [logits]
    carry = hidden[:, -1:]
    for i, token in enumerate((11, 12)):
        logits, carry = still.forward(torch.tensor([[token], [token]]), inputs=carry, offset=i)
        static.append(logits[:, 0])
    for mine, theirs in zip(static, grown):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


# -- the captured loop ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("kind", ["model", "feature", "eagle3"])
def test_captured_steps_give_the_targets_greedy_tokens(target, drafts, kind, plan):
    """Four left-padded prompts (one a single token), an EOS ending rows early: the captured steps' tokens are
    greedy autoregressive decoding's, and their accepted counts the growing loop's (the same drafts)."""
    want = autoregressive_generate(target, PROMPTS, max_new_tokens=14, sampling=GREEDY, eos_token_id=EOS)
    out = speculative_generate(target, drafts[kind], PROMPTS, max_new_tokens=14, sampling=GREEDY, eos_token_id=EOS,
                               compile="static", **OPTIONS[plan])
    grown = speculative_generate(target, drafts[kind], PROMPTS, max_new_tokens=14, sampling=GREEDY, eos_token_id=EOS,
                                 **OPTIONS[plan])
    assert out.tokens == want.tokens
    assert out.block_efficiency == pytest.approx(grown.block_efficiency, abs=0.35)  # the last steps' blocks are cut
    assert all(math.isnan(s.target_seconds) for s in out.steps) and out.seconds > 0


def test_captured_autoregressive_decoding_is_the_growing_loops(target):
    want = autoregressive_generate(target, PROMPTS, max_new_tokens=10, sampling=GREEDY, eos_token_id=EOS)
    assert autoregressive_generate(target, PROMPTS, max_new_tokens=10, sampling=GREEDY, eos_token_id=EOS,
                                   compile="static").tokens == want.tokens


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["T0", "T1"])
def test_reading_every_few_steps_changes_nothing(target, drafts, sampling):
    """``steps_per_read=3`` (the host reads three steps' tokens at once; rows stop on the device) gives the tokens
    and accepted counts of one read a step, from the same seed."""
    runs = [static.static_generate(target, drafts["model"], PROMPTS, plan=PLANS["chain block g3"], max_new_tokens=12,
                                   sampling=sampling, seed=5, eos_token_id=EOS, steps_per_read=n) for n in (1, 3)]
    assert runs[0].tokens == runs[1].tokens
    counts = [[s.num_accepted for s in r.steps if any(s.active)] for r in runs]
    assert counts[1][: len(counts[0])] == counts[0]


@pytest.mark.parametrize("plan", ["chain block g3", "dynamic K3 g3 n7"])
def test_seeded_captured_runs_repeat(target, drafts, plan):
    """T = 1: the same seed gives the same tokens (uniforms drawn from the caller's generator before each step),
    another seed others; one generator per row works as well."""
    def run(seed):
        return speculative_generate(target, drafts["feature"], PROMPTS, max_new_tokens=12, sampling=SAMPLED, seed=seed,
                                    compile="static", **OPTIONS[plan]).tokens
    assert run(3) == run(3) and run(3) != run(4)
    assert run([1, 2, 3, 4]) == run([1, 2, 3, 4])


@pytest.mark.slow
@pytest.mark.parametrize("kind, plan", [("model", "chain block g3"), ("feature", "chain token g2"),
                                        ("model", "dynamic K3 g3 n7"), ("feature", "static K2 g4 n6"),
                                        ("model", "traversal K3 g2"), ("feature", "rrs w/o repl. K2 g3")])
def test_captured_steps_keep_the_target_law(target, drafts, kind, plan):
    """T = 1, the first 3 tokens of 6,000 runs against the exact target law (``experiments.stats.lossless_test``):
    no impossible sequence and the Bonferroni p-value above 1e-6 (the false-positive rate, ``FPR_NOTE``)."""
    options = dict(OPTIONS[plan])
    result = lossless_test(target, drafts[kind], options.pop("verifier"), [5, 9, 3, 17], sampling=SAMPLED,
                           gamma=options.pop("gamma"), k=3, max_new_tokens=4, num_samples=6_000, seed=11,
                           batch_size=3_000, compile="static", **options)
    assert result.impossible == 0 and result.bonferroni_p_value > 1e-6, result


# -- one read a step, one graph a step ----------------------------------------------------------------------------------


@pytest.mark.parametrize("plan", ["autoregressive", "chain block g3", "dynamic K3 g3 n7", "static K2 g4 n6",
                                  "traversal K3 g2", "rrs w/o repl. K2 g3"])
@pytest.mark.parametrize("rows", [1, 4])
def test_a_captured_step_reads_the_host_once(target, drafts, plan, rows):
    """Every read a step makes, counted as the growing loop's are (``engine.timing.HostReads``, long minus short run):
    one, at B = 1 and at B = 4 with rows ending at different steps (they stop on the device)."""
    def run(n):
        if plan == "autoregressive":
            return autoregressive_generate(target, PROMPTS[:rows], max_new_tokens=n, sampling=SAMPLED, compile="static")
        return speculative_generate(target, drafts["feature"], PROMPTS[:rows], max_new_tokens=n, sampling=SAMPLED,
                                    compile="static", **OPTIONS[plan])
    assert reads_per_step(run, (8, 24))["all"] == 1.0


STEP_KINDS = [("autoregressive", None, StaticPlan("autoregressive")), ("chain model", "model", PLANS["chain block g3"]),
              ("chain feature", "feature", PLANS["chain token g2"]), ("chain eagle3", "eagle3", PLANS["chain greedy g1"]),
              ("tree model", "model", PLANS["dynamic K3 g3 n7"]), ("tree feature", "feature", PLANS["static K2 g4 n6"]),
              ("paths model", "model", PLANS["rrs w/o repl. K2 g3"]), ("paths feature", "feature", PLANS["traversal K3 g2"])]


def _run(target, drafts, kind, plan, sampling, steps_per_read=1):
    ids, mask = encode_prompts(PROMPTS[:2])
    return start_run(target, None if kind is None else drafts[kind], ids, mask, plan=plan, sampling=sampling,
                     max_new_tokens=10, eos={EOS}, steps_per_read=steps_per_read)


@pytest.mark.parametrize("name, kind, plan", STEP_KINDS, ids=[k[0] for k in STEP_KINDS])
def test_every_step_compiles_as_one_graph(target, drafts, name, kind, plan):
    """``torch.compile(fullgraph=True, dynamic=False)``'s tracer on each step kind at T = 0: one graph, no break
    (``torch._dynamo.explain``). At T = 1 the next test compiles every kind with ``fullgraph=True``, which fails on
    any break."""
    explained = torch._dynamo.explain(_run(target, drafts, kind, plan, GREEDY).step)()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def _logs(run, step, steps: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        run.state.uniforms.copy_(torch.rand(run.state.uniforms.shape, generator=generator, dtype=torch.float64))
        step()
    return run.state.log.clone()


@pytest.mark.parametrize("name, kind, plan", STEP_KINDS, ids=[k[0] for k in STEP_KINDS])
def test_compiled_steps_compute_what_eager_steps_compute(target, drafts, name, kind, plan):
    """Five steps at T = 1 from the same uniforms, eager and compiled (``fullgraph=True``; the ``aot_eager`` backend:
    dynamo's graph and its functionalised in-place updates, without inductor's code generation): the same log."""
    run = _run(target, drafts, kind, plan, SAMPLED, 5)
    eager = _logs(run, run.step, 5)
    run = _run(target, drafts, kind, plan, SAMPLED, 5)
    compiled = _logs(run, torch.compile(run.step, fullgraph=True, dynamic=False, backend="aot_eager"), 5)
    assert torch.equal(eager, compiled)


@pytest.mark.slow
def test_an_inductor_compiled_tree_step_computes_what_the_eager_step_computes(target, drafts):
    """The same with inductor's CPU code (``StepRunner`` mode ``"inductor"``: about a minute to compile here) on a
    feature head's static tree, the step with the most kinds of operation."""
    name, kind, plan = STEP_KINDS[5]
    run = _run(target, drafts, kind, plan, SAMPLED, 4)
    eager = _logs(run, run.step, 4)
    run = _run(target, drafts, kind, plan, SAMPLED, 4)
    runner = StepRunner(run.step, "inductor", run.small_state(), "cpu")
    before = [t.clone() for t in run.small_state()]
    runner.prepare()  # compiles: the state given back
    assert runner.prepared and all(torch.equal(a, b) for a, b in zip(before, run.small_state()))
    assert torch.equal(eager, _logs(run, runner, 4))


def test_a_runner_compiles_before_its_first_call_and_gives_the_state_back(capsys):
    """``StepRunner.prepare`` (what ``static_generate`` times apart as ``compile_seconds``): inductor's compile and
    warm-up leave the step's state as they found it (a line on stderr says it compiles), the next call runs one step,
    a second ``prepare`` does nothing; an eager runner has nothing to prepare."""
    counter = torch.zeros(3)

    def step():
        counter.add_(1)

    runner = StepRunner(step, "inductor", [counter], "cpu")
    assert not runner.prepared
    runner.prepare()
    assert runner.prepared and torch.equal(counter, torch.zeros(3))
    assert "[specresearch] compiling a captured step (inductor, cpu)" in capsys.readouterr().err
    runner()
    runner.prepare()
    assert capsys.readouterr().err == ""
    assert torch.equal(counter, torch.ones(3))
    assert StepRunner(step, "eager", [counter], "cpu").prepared
    lazy = StepRunner(step, "inductor", [counter], "cpu")  # called first: it prepares there, once
    lazy()
    assert lazy.prepared and torch.equal(counter, torch.full((3,), 2.0))
    lazy.prepare()
    assert torch.equal(counter, torch.full((3,), 2.0)) and capsys.readouterr().err.count("compiling") == 1


@pytest.mark.parametrize("name, kind, plan", STEP_KINDS, ids=[k[0] for k in STEP_KINDS])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["T0", "T1"])
def test_a_step_neither_reads_nor_writes_the_host(target, drafts, name, kind, plan, sampling):
    """Inside a step (what a CUDA graph captures) no host read and no tensor made from host data (a copy a graph
    cannot capture: the dynamic tree's depths were one): ``engine.timing.HostReads`` over three steps."""
    from specresearch.engine.timing import HostReads

    run = _run(target, drafts, kind, plan, sampling, 3)
    with HostReads() as reads:
        for _ in range(3):
            run.step()
    assert (reads.count, reads.writes) == (0, 0)


@pytest.mark.parametrize("name, kind, plan", [STEP_KINDS[0], STEP_KINDS[4]], ids=["autoregressive", "tree model"])
def test_a_graphs_warm_up_leaves_the_run_as_it_found_it(target, drafts, name, kind, plan):
    """What ``cudagraph`` runs before it captures (``captured.warm_up``), on the CPU: two steps, each from the state
    it found, on a run that reads the host after every step (a log of one row: two steps in a row would write past
    it, the device-side assert of the first GPU run); the state after is the state before, and the steps after it
    log what a run without the warm-up logs."""
    run = _run(target, drafts, kind, plan, SAMPLED, 1)
    before = [t.clone() for t in run.small_state()]
    warm_up(run.step, run.small_state())
    assert all(torch.equal(a, b) for a, b in zip(before, run.small_state()))
    plain = _run(target, drafts, kind, plan, SAMPLED, 1)
    assert torch.equal(_logs(run, run.step, 1), _logs(plain, plain.step, 1))
    with pytest.raises(IndexError):  # the old warm-up: two steps in a row from one read
        for _ in range(2):
            run.step()


def test_a_session_is_kept_and_replayed(target, drafts):
    """A second call with the same shapes reuses the first's run (its buffers and its step): same tokens as the
    first, a session per shape, at most ``SESSIONS_KEPT`` of them."""
    static._SESSIONS.pop(target, None)
    first = speculative_generate(target, drafts["model"], PROMPTS, max_new_tokens=8, sampling=SAMPLED, seed=2,
                                 compile="static", **OPTIONS["chain block g3"])
    again = speculative_generate(target, drafts["model"], PROMPTS, max_new_tokens=8, sampling=SAMPLED, seed=2,
                                 compile="static", **OPTIONS["chain block g3"])
    assert first.tokens == again.tokens and len(static._SESSIONS[target]) == 1
    assert first.compile_seconds == again.compile_seconds == 0.0  # eager: nothing compiled or captured
    for gamma in range(1, static.SESSIONS_KEPT + 2):
        speculative_generate(target, drafts["model"], PROMPTS, max_new_tokens=4, compile="static", gamma=gamma)
    assert len(static._SESSIONS[target]) == static.SESSIONS_KEPT


# -- what has no captured form ------------------------------------------------------------------------------------------


def test_compile_choices_are_checked_and_explained(target, drafts):
    with pytest.raises(ValueError, match="compile must be one of"):
        speculative_generate(target, drafts["model"], PROMPTS, max_new_tokens=4, compile="fast")
    with pytest.raises(ValueError, match="ToyLM has no static form.*compile='off'"):  # a draft of one's own
        speculative_generate(target, ToyLM.random(VOCAB, generator=torch.Generator().manual_seed(0)), PROMPTS,
                             max_new_tokens=4, compile="on")
    with pytest.raises(ValueError, match="GBV's verifier reads the host"):
        speculative_generate(target, drafts["model"], PROMPTS, max_new_tokens=4, compile="static", verifier="gbv",
                             num_drafts=2, gamma=2)
    with pytest.raises(ValueError, match="expectations"):
        speculative_generate(target, drafts["model"], PROMPTS, max_new_tokens=4, compile="static",
                             expectations=("token",))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        StepRunner(lambda: None, "cudagraph", [], "cpu")
    for mode in ("cudagraph", "reduce-overhead"):  # refused in the caller's words before the run is built
        with pytest.raises(ValueError, match=f"compile='{mode}' captures CUDA graphs, and the target is on cpu: "
                                             "compile='on'"):
            speculative_generate(target, drafts["model"], PROMPTS, max_new_tokens=4, compile=mode)
    # auto on the CPU: the growing loop (whose steps are timed on the CPU), and no error for a host-side draft
    auto = speculative_generate(target, NGramDraft(VOCAB), PROMPTS, max_new_tokens=4, compile="auto")
    assert all(not math.isnan(s.target_seconds) for s in auto.steps)


def _host_reading_pair():
    """A tiny DBRX (its experts' loop asks the host which experts the tokens chose) and a tiny CTRL (its forward
    re-registers a buffer), each wrapped."""
    from transformers import AutoModelForCausalLM, CTRLConfig, DbrxConfig

    configs = (DbrxConfig(d_model=32, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=VOCAB,
                          attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                          ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2)),
               CTRLConfig(n_embd=32, n_layer=2, n_head=4, dff=64, n_positions=256, vocab_size=VOCAB))
    torch.manual_seed(0)
    return [CausalLM(AutoModelForCausalLM.from_config(config).eval(), device="cpu", probe=False) for config in configs]


def test_a_family_whose_forward_reads_the_host_is_not_captured():
    """DBRX's forward reads the host inside a step (nonzero over its experts), so no captured mode holds it: on CUDA
    ``auto`` takes the growing loop, ``on`` and the named modes refuse it naming the model, and ``static`` runs its
    static steps eagerly, with the growing loop's greedy tokens. CTRL's re-registers a buffer at every call: a CUDA
    graph takes it (``auto`` on CUDA captures it), torch.compile's modes refuse it. Controls: a refusal left out of
    ``runner_mode`` hands DBRX to ``cudagraph``; that the tracer breaks both steps and holds every other taken type's
    in one graph is ``benchmarks/family_sweep.py``'s record (``tests/test_probe.py`` checks the tables against it)."""
    dbrx, ctrl = _host_reading_pair()
    refusal = functools.partial(static.capture_refusal, dbrx, dbrx)
    assert static.runner_mode("auto", "cuda", None) == "cudagraph"  # the control: no refusal, captured
    assert static.runner_mode("auto", "cuda", None, refusal) is None
    assert static.runner_mode("static", "cuda", None, refusal) == "eager"
    for choice in ("on", "cudagraph", "inductor"):
        with pytest.raises(ValueError, match="DbrxForCausalLM: its experts' loop asks the host"):
            static.runner_mode(choice, "cuda", None, refusal)
    with pytest.raises(ValueError, match="compile='on' runs the captured steps as 'inductor'.*DbrxForCausalLM"):
        speculative_generate(dbrx, dbrx, PROMPTS, max_new_tokens=4, compile="on")
    refusal = functools.partial(static.capture_refusal, ctrl, ctrl)
    assert static.runner_mode("auto", "cuda", None, refusal) == "cudagraph"
    with pytest.raises(ValueError, match="CTRLLMHeadModel: its forward re-registers"):
        static.runner_mode("reduce-overhead", "cuda", None, refusal)
    for lm in (dbrx, ctrl):
        want = autoregressive_generate(lm, PROMPTS, max_new_tokens=8, sampling=GREEDY).tokens
        assert speculative_generate(lm, lm, PROMPTS, max_new_tokens=8, sampling=GREEDY, compile="static",
                                    **OPTIONS["chain block g3"]).tokens == want


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh runs it)")


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("mode", ["cudagraph", "reduce-overhead"])
@pytest.mark.parametrize("plan", ["chain block g3", "dynamic K3 g3 n7"])
def test_cuda_captured_steps_replay_what_eager_steps_compute(mode, plan):
    """On CUDA: greedy tokens of captured graphs = greedy autoregressive decoding; at T = 1 the captured run's tokens
    equal the eager run's from the same seed (same uniforms), and repeat."""
    cuda_target = CausalLM(tiny_llama(VOCAB, seed=0, init_std=0.6, num_layers=3).model, device="cuda")
    draft = FeatureDraft(feature_head(cuda_target.model), device="cuda")
    want = autoregressive_generate(cuda_target, PROMPTS, max_new_tokens=12, sampling=GREEDY)
    got = speculative_generate(cuda_target, draft, PROMPTS, max_new_tokens=12, sampling=GREEDY, compile=mode,
                               **OPTIONS[plan])
    assert got.tokens == want.tokens
    runs = [speculative_generate(cuda_target, draft, PROMPTS, max_new_tokens=12, sampling=SAMPLED, seed=7, compile=m,
                                 **OPTIONS[plan]) for m in ("static", mode, mode)]
    assert runs[0].tokens == runs[1].tokens == runs[2].tokens
    # the first run of a session compiles or captures before its first step, timed apart; the next replays
    assert got.compile_seconds > 0 and runs[1].compile_seconds > 0 and runs[2].compile_seconds == 0


def _cuda_draft(kind: str, target, directory):
    """A draft of ``kind`` on ``target``'s CUDA device: prompt lookup with a head, prompt lookup alone, a dial draft,
    a DFlash block (tests/test_dflash.py's drafter, saved to ``directory``), Medusa heads."""
    from specresearch.drafts.combined import LookupOrDraft
    from specresearch.drafts.dial import DialDraft
    from specresearch.drafts.registry import draft_from_name

    if kind == "lookup or head":
        return LookupOrDraft(FeatureDraft(feature_head(target.model), device="cuda"), draft_gamma=None)
    if kind == "lookup":
        return NGramDraft(VOCAB, device="cuda")
    if kind == "dial":
        return DialDraft(CausalLM(target.model, device="cuda"), "uniform", 0.8)
    import math

    g = torch.Generator().manual_seed(0)
    hidden = target.model.config.hidden_size
    tensors = {}
    for k in range(3):  # Medusa heads in their repository's layout: one ResBlock a head, repeated once
        weight, bias = torch.randn(hidden, hidden, generator=g) / math.sqrt(hidden), 0.1 * torch.randn(hidden, generator=g)
        tensors |= {f"{k}.0.linear.weight": weight, f"{k}.0.linear.bias": bias,
                    f"{k}.1.weight": torch.randn(VOCAB, hidden, generator=g) / math.sqrt(hidden)}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text('{"medusa_num_heads": 3, "medusa_num_layers": 1}')
    torch.save(tensors, directory / "medusa_lm_head.pt")
    return draft_from_name(str(directory), target)


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("kind", ["lookup or head", "lookup", "dial", "medusa"])
def test_cuda_captured_steps_of_other_drafts_replay_what_eager_steps_compute(kind, tmp_path):
    """On CUDA, the static forms of prompt lookup (with a head, alone), a dial draft and Medusa heads as CUDA graphs:
    greedy chains and a traversal tree give greedy autoregressive decoding's tokens; at T = 1 a captured chain's tokens
    equal the eager static run's from the same seed, twice."""
    cuda_target = CausalLM(tiny_llama(VOCAB, seed=0, init_std=0.6, num_layers=3).model, device="cuda")
    draft = _cuda_draft(kind, cuda_target, tmp_path / "medusa")
    want = autoregressive_generate(cuda_target, PROMPTS, max_new_tokens=12, sampling=GREEDY)
    for options in (dict(gamma=3), dict(gamma=2, num_drafts=2, verifier="traversal")):
        got = speculative_generate(cuda_target, draft, PROMPTS, max_new_tokens=12, sampling=GREEDY,
                                   compile="cudagraph", **options)
        assert got.tokens == want.tokens, options
    runs = [speculative_generate(cuda_target, draft, PROMPTS, max_new_tokens=12, sampling=SAMPLED, seed=7, compile=m,
                                 gamma=3) for m in ("static", "cudagraph", "cudagraph")]
    assert runs[0].tokens == runs[1].tokens == runs[2].tokens
