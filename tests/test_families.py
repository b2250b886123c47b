"""Every family researchers load, on every attention kernel: chains and trees give transformers' own tokens.

* The matrix (``experiments.families``): 16 families x 6 kernels x the 14 step kinds (the two kernels the wrapper
  switches on 5 of them), greedy, three left-padded prompts with a row that ends early at an EOS: the engine's tokens
  equal ``generate(do_sample=False)``'s, or the wrapper switched the kernel (and then they are equal too), or it
  refused the model with one line.
* Cached tree scoring equals an uncached forward of each path, for every family, over several trees (the windowed
  families' contexts grow past their window; dead slots pile up and the cache is packed on the way).
* Losslessness at T = 1 through the engine, one tree rule per family (statistical; false-positive rate below).
* A negative control: the same matrix case with the window left out differs, so the window is what it checks.
* A second matrix: 20 more families on every kernel but flex attention and one step kind of each loop, Bloom, Falcon-RW
  and GPT-Neo among them, whose attention places keys by cache slot (ALiBi, local windows) until the wrapper makes
  them read positions off the masks; MPT (ALiBi over slots) and a model without a cache are refused in one line. Let
  through, or left unmended, they give wrong tree logits or fail (the negative control).
"""

import json
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch
import transformers
from helpers import explain_static_calls, tree_path, visible_from_parents

from specresearch.config import SamplingConfig
from specresearch.experiments.families import NEW_TOKENS, PROMPTS, all_cases, more_cases, reference_tokens, run_case
from specresearch.experiments.stats import lossless_test
from specresearch.models.attention import AttentionLayout, attention_layout
from specresearch.models.causal_lm import CausalLM
from specresearch.models.families import (
    FAMILIES,
    MORE_FAMILIES,
    WINDOW,
    perturbed_copy,
    tiny_family_config,
    tiny_family_model,
)
from specresearch.models.kernels import experts_in_float64
from specresearch.models.positions import positions_from_masks

ROOT = Path(__file__).resolve().parents[1]
RECORD = json.loads((ROOT / "benchmarks" / "records" / "family_matrix.json").read_text())
RECORDED = {(row["family"], row["kernel"], row["step"]): row["status"] for row in RECORD["rows"]}
RECORD_MORE = json.loads((ROOT / "benchmarks" / "records" / "family_matrix_more.json").read_text())
RECORDED_MORE = {(row["family"], row["kernel"], row["step"]): row["status"] for row in RECORD_MORE["rows"]}

WINDOWED = [f for f in FAMILIES if getattr(tiny_family_config(f), "sliding_window", None)
            and (f != "qwen2" or tiny_family_config(f).use_sliding_window)]


# The kernels the wrapper switches (to sdpa) run the switched kernel's computation for every step kind: here each is
# checked on one step kind of each kind of loop, the record (benchmarks/family_matrix.py) holds all of them.
SWITCHED, SWITCHED_STEPS = ("flex_attention", "flash_attention_2"), ("chain", "sampled tree", "dynamic tree",
                                                                     "captured chain", "captured sampled tree")
CASES = [case for case in all_cases() if case[1] not in SWITCHED or case[2] in SWITCHED_STEPS]


@pytest.mark.parametrize("family, kernel, step", CASES)
def test_the_engine_gives_generates_tokens(family, kernel, step):
    result = run_case(family, kernel, step)
    assert result.ok, result.detail
    assert result.status == RECORDED[family, kernel, step], (
        f"rerun benchmarks/family_matrix.py --docs (record made with transformers {RECORD['transformers']}, this is "
        f"{transformers.__version__})")
    if kernel in ("eager", "sdpa (as loaded)"):  # transformers' own kernels, applied as they are
        assert result.status in ("exact", "not offered"), result
    if result.status == "refused":  # one line naming the model, the kernel and what to load instead
        assert "\n" not in result.detail and family in result.detail.lower() and "attn_implementation=" in result.detail


@pytest.mark.parametrize("family, kernel, step", more_cases())
def test_more_families_give_generates_tokens_or_are_refused(family, kernel, step):
    """The second matrix: more families on every kernel but flex attention give ``generate``'s tokens (or
    transformers offers no such kernel; a kernel that takes no 4-D mask is switched, and then they do); the families whose attention places keys by cache slot, or that keep no cache, are
    refused before the first step in one line naming the model and why."""
    result = run_case(family, kernel, step)
    assert result.status == RECORDED_MORE[family, kernel, step], (
        f"rerun benchmarks/family_matrix.py --more --docs ({result})")
    if family in MORE_FAMILIES:  # XGLM's attention predates transformers' interface: flash cannot be switched
        allowed = ("switched", "refused") if kernel == "flash_attention_2" else ("exact", "not offered")
        assert result.status in allowed, result
    else:
        assert result.status in ("refused", "not offered"), result
    if result.status == "refused":
        # a flash kernel it cannot switch is refused as such first, else the family is, as on the other kernels
        whys = ("attn_implementation='eager'", "use a model of another family")
        why = whys[:1] if family in MORE_FAMILIES else whys if kernel == "flash_attention_2" else whys[1:]
        assert "\n" not in result.detail and any(w in result.detail for w in why), result.detail
        assert result.detail.startswith(type(tiny_family_model(family, "eager")).__name__), result.detail


@pytest.mark.parametrize("family", ["mpt", "bloom", "falcon-rw", "gpt-neo"])
def test_without_the_refusal_a_slot_placed_family_goes_wrong(family, monkeypatch):
    """Negative control: let MPT, Bloom, Falcon-RW and GPT-Neo through without ``positions_from_masks`` (the check
    names no problem, and no probe), and its cached tree logits differ from an uncached forward of each path (MPT,
    GPT-Neo: wrong without an error), or its tree call fails (Bloom, Falcon-RW, whose ALiBi takes a 2-D mask only)."""
    import specresearch.models.causal_lm as causal_lm
    import specresearch.models.positions as positions

    monkeypatch.setattr(positions, "slot_placement", lambda model, config: None)
    monkeypatch.setattr(causal_lm, "positions_from_masks", lambda model: False)
    reference = tiny_family_model(family, "eager")
    lm = CausalLM(tiny_family_model(family, "eager"), device="cpu", probe=False)
    lm.prefill(torch.tensor([[5, 9, 2, 33, 7, 8, 3, 4]]), torch.ones(1, 8, dtype=torch.long))
    parents = [-1, 0, 0, 2]  # a, b, c (child of b), d (child of c): b and c sit one slot past their positions
    lm.begin_tree()
    try:
        logits = lm.score_tree(torch.tensor([[10, 20, 30, 40]]), torch.tensor([[0, 0, 1, 2]]),
                               visible_from_parents(parents))
    except ValueError:
        assert family in ("bloom", "falcon-rw")
        return
    history = [5, 9, 2, 33, 7, 8, 3, 4]
    worst = max((logits[0, i] - _uncached(reference, history + tree_path(torch.tensor([10, 20, 30, 40]), parents, i)))
                .abs().max().item() for i in range(4))
    assert worst > 1e-3, (family, worst)


def test_slot_placed_families_are_refused_until_they_take_positions_from_the_masks():
    """``attention_layout`` refuses Bloom, Falcon-RW, MPT and a GPT-Neo with local layers as transformers builds them
    (``CausalLM`` mends them first, ``positions_from_masks``); mending twice hooks each layer once and keeps Bloom's
    own ALiBi for a 2-D mask, MPT's attention gives transformers' own outputs where slots are positions (its slopes,
    its bias relative to the last key, a padded row), and a GPT-Neo whose layers are all global needs nothing."""
    model = tiny_family_model("gpt-neo", "eager")
    with pytest.raises(ValueError, match="windows its local layers over cache slots"):
        attention_layout(model)
    assert positions_from_masks(model) and positions_from_masks(model)
    assert attention_layout(model).kernel == "eager"
    local = [m for m in model.modules() if getattr(m, "attention_type", None) == "local" and hasattr(m, "bias")]
    assert len(local) == 1 and len(local[0]._forward_pre_hooks) == 1
    bloom = tiny_family_model("bloom", "eager")
    with pytest.raises(ValueError, match="ALiBi from a 2-D padding mask"):
        attention_layout(bloom)
    own = type(bloom.transformer).build_alibi_tensor.__get__(bloom.transformer)
    assert positions_from_masks(bloom) and positions_from_masks(bloom)
    padding = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert torch.equal(bloom.transformer.build_alibi_tensor(padding, 4, torch.float32), own(padding, 4, torch.float32))
    falcon = tiny_family_model("falcon-rw", "eager")
    with pytest.raises(ValueError, match="ALiBi from a 2-D padding mask"):
        attention_layout(falcon)
    assert positions_from_masks(falcon) and positions_from_masks(falcon) and not falcon.transformer.use_alibi
    assert all(len(layer._forward_pre_hooks) == 1 for layer in falcon.transformer.h)
    mpt = tiny_family_model("mpt", "eager")
    with pytest.raises(ValueError, match="computes ALiBi from each key's slot"):
        attention_layout(mpt)
    ids, padded = torch.tensor([[5, 9, 2, 33, 7], [0, 0, 4, 8, 11]]), torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    own = mpt(ids, attention_mask=padded).logits
    assert positions_from_masks(mpt) and positions_from_masks(mpt)
    assert attention_layout(mpt).kernel == "eager"
    assert all(isinstance(block.attn.forward, partial) for block in mpt.transformer.blocks)
    assert torch.equal(mpt(ids, attention_mask=padded).logits[padded.bool()], own[padded.bool()])
    assert not positions_from_masks(tiny_family_model("llama", "eager"))
    from transformers import AutoModelForCausalLM

    config = tiny_family_config("gpt-neo", attention_types=[[["global"], 2]])
    assert not positions_from_masks(AutoModelForCausalLM.from_config(config, attn_implementation="eager"))


def test_gpt_neo_without_local_layers_is_taken():
    """A GPT-Neo whose layers are all global gives generate's tokens through chains and trees."""
    from transformers import AutoModelForCausalLM

    config = tiny_family_config("gpt-neo", attention_types=[[["global"], 2]], initializer_range=0.5)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    reference = reference_tokens(model)
    from specresearch.engine.generate import speculative_generate

    target, draft = CausalLM(model, device="cpu"), CausalLM(perturbed_copy(model), device="cpu")
    for options in (dict(verifier="block", gamma=3), dict(verifier="traversal", num_drafts=3, gamma=3)):
        out = speculative_generate(target, draft, PROMPTS, max_new_tokens=NEW_TOKENS,
                                   sampling=SamplingConfig(temperature=0.0), **options)
        assert [list(row) for row in out.tokens] == reference, options


def test_the_matrix_covers_windows_alternating_layers_and_softcapping():
    """The families' settings are what the matrix claims to test: windows shorter than the contexts, mixed layers."""
    assert {"mistral", "mixtral", "gemma2", "gemma3", "phi3", "starcoder2", "qwen2-window"} <= set(WINDOWED)
    longest = max(len(p) for p in PROMPTS) + NEW_TOKENS
    assert WINDOW < longest
    for family in ("gemma2", "gemma3", "qwen2-window"):
        layout = attention_layout(tiny_family_model(family))
        assert dict(layout.windows) == {"full_attention": None, "sliding_attention": WINDOW}, (family, layout)
    assert dict(attention_layout(tiny_family_model("mistral")).windows) == {"sliding_attention": WINDOW}
    assert tiny_family_config("gemma2").attn_logit_softcapping == 50.0


def test_the_layout_reads_transformers_older_form_of_the_layers_kwargs(monkeypatch):
    """transformers 5.17 (the GPU machine's) gives one kwargs mapping for all layers where newer ones give a list of
    them: the layout is the same either way (zipping the mapping gave no layer and an empty layout, whose mask was a
    dict transformers could not read), and a model naming no layer type is refused."""
    import transformers.cache_utils as cache_utils

    newer = cache_utils.get_layer_types_and_kwargs
    expected = {family: attention_layout(tiny_family_model(family)) for family in ("gemma2", "mistral", "llama")}

    def older(config):
        kinds, options = newer(config)
        return kinds, options if isinstance(options, dict) else next((o for o in options if o), {})

    monkeypatch.setattr(cache_utils, "get_layer_types_and_kwargs", older)
    for family, layout in expected.items():
        assert attention_layout(tiny_family_model(family)) == layout, family
    monkeypatch.setattr(cache_utils, "get_layer_types_and_kwargs", lambda config: ([], {}))
    with pytest.raises(ValueError, match="names no attention layer types"):
        attention_layout(tiny_family_model("llama"))


def test_without_the_window_the_matrix_sees_a_difference():
    """Negative control: Mistral with its window dropped from the masks gives other tokens than generate."""
    model = tiny_family_model("mistral", "eager")
    reference = reference_tokens(model)
    draft = CausalLM(perturbed_copy(model), device="cpu")
    target = CausalLM(model, device="cpu")
    from specresearch.engine.generate import speculative_generate

    def run():
        out = speculative_generate(target, draft, PROMPTS, max_new_tokens=12, verifier="block",
                                   gamma=3, sampling=SamplingConfig(temperature=0.0))
        return [list(row) for row in out.tokens]

    assert run() == reference
    target._attention = AttentionLayout("eager", (("sliding_attention", None),))
    assert run() != reference


def _uncached(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


NO_SDPA = ("gemma2", "gpt-oss", "xglm", "gpt-neo", "bloom", "mpt")  # families transformers offers no sdpa


@pytest.mark.parametrize("family", [*FAMILIES, *MORE_FAMILIES])
@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_cached_tree_scoring_equals_each_path_uncached(family, kernel):
    try:
        model = tiny_family_model(family, kernel)
    except ValueError:
        assert kernel == "sdpa" and family in NO_SDPA
        return
    reference = tiny_family_model(family, "eager")  # an uncached forward of transformers' own, untouched model
    lm = CausalLM(model, device="cpu")
    prompts = [[5, 9, 2, 33, 7], [4, 8, 11]]
    lm.prefill(torch.tensor([[5, 9, 2, 33], [0, 0, 4, 8]]), torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]))
    histories = [list(p[:-1]) for p in prompts]
    pending = [p[-1] for p in prompts]
    parents = [-1, 0, 1, 0, 3, 2]  # pending; a, b (child of a); c; d (child of c); e (child of b)
    for step in range(5):  # 5 trees: contexts grow past the window, dead slots are packed on the way
        tokens = torch.tensor([[pending[b], 10 + step, 20, 30 - step, 40, 12] for b in range(2)])
        lm.begin_tree()
        logits = lm.score_tree(tokens, torch.tensor([[0, 1, 2, 1, 2, 3]] * 2),
                               visible_from_parents(parents).expand(2, -1, -1))
        for b in range(2):
            for i in range(6):
                want = _uncached(reference, histories[b] + tree_path(tokens[b], parents, i))
                assert torch.allclose(logits[b, i], want, atol=1e-4), (family, step, b, i)
        lm.end_tree(torch.tensor([[True, True, True, False, False, True], [True, False, False, True, True, False]]))
        histories[0] += [pending[0], 10 + step, 20, 12]
        histories[1] += [pending[1], 30 - step, 40]
        pending = [7, 9]
    assert max(len(h) for h in histories) > 3 * WINDOW
    out = lm.score(torch.tensor([[pending[0]], [pending[1]]]))
    for b in range(2):
        assert torch.allclose(out[b, -1], _uncached(reference, histories[b] + [pending[b]]), atol=1e-4)


@pytest.mark.parametrize("family", [*FAMILIES, *MORE_FAMILIES])
@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_float64_models_score_a_left_padded_row_as_they_score_it_alone(family, kernel):
    """In float64 (exact comparisons), a left-padded row's prefill, chain and tree logits equal those of the same row
    alone, unpadded. transformers fills a padding mask with float64's lowest value, which ``eager`` attention's
    float32 softmax reads as -inf: a pad slot's query, which sees nothing, gave NaN, and the NaN spread to its row
    (``CausalLM`` hands a float64 model its own masks, ``models.attention.additive_mask``). Mixtral's experts run
    torch's ``grouped_mm`` by default, which takes no float64 (``CausalLM`` switches them, ``experts_in_float64``).
    XGLM takes no float64 in transformers itself: its attention clamps the scores with a float32 tensor of float64's
    lowest value (asserted on its own forward, so the test notices when transformers mends it). DeepSeek-V3's router
    runs in float32 in transformers whatever the model's dtype (``DeepseekV3TopkRouter``), and a float32 product rounds
    differently for a batch of two rows on some CPUs (AVX2 without AVX-512: 5e-7): float32's tolerance there."""
    try:
        models = [tiny_family_model(family, kernel) for _ in range(2)]
    except ValueError:
        assert kernel == "sdpa" and family in NO_SDPA
        return
    if family == "xglm":
        with pytest.raises(RuntimeError, match="cannot be converted to type float without overflow"):
            models[0].to(torch.float64)(input_ids=torch.tensor([[5, 9, 2]]), attention_mask=torch.ones(1, 3).long())
        return
    padded, alone = (CausalLM(model, device="cpu", dtype=torch.float64) for model in models)
    got = [padded.prefill(torch.tensor([[0, 0, 5, 9, 2], [4, 8, 11, 6, 3]]), torch.tensor([[0, 0, 1, 1, 1], [1] * 5]))]
    want = [alone.prefill(torch.tensor([[5, 9, 2]]), torch.ones(1, 3, dtype=torch.long))]
    got.append(padded.score(torch.tensor([[7, 12], [7, 12]])))
    want.append(alone.score(torch.tensor([[7, 12]])))
    parents, depth = [-1, 0, 0], torch.tensor([[0, 1, 1]])
    padded.begin_tree()
    alone.begin_tree()
    got.append(padded.score_tree(torch.tensor([[13, 14, 15]] * 2), depth.expand(2, -1),
                                 visible_from_parents(parents).expand(2, -1, -1)))
    want.append(alone.score_tree(torch.tensor([[13, 14, 15]]), depth, visible_from_parents(parents)))
    for g, w in zip(got, want):
        assert torch.isfinite(g).all(), family
        tolerance = 1e-5 if family == "deepseek-v3" else 1e-9
        torch.testing.assert_close(g[:1], w, rtol=tolerance, atol=tolerance)



def test_only_a_float64_model_has_its_experts_switched():
    """torch's ``grouped_mm`` (Mixtral's default experts) takes float32 and half types, not float64: a float32 model
    keeps it, a float64 one runs transformers' eager loop (the same function), or is refused where the caller's
    model must stay as it is, and a dense model is left alone."""
    kept = CausalLM(tiny_family_model("mixtral", "sdpa"), device="cpu")
    assert kept.model.get_experts_implementation() == {"": "grouped_mm"}
    wide = tiny_family_model("mixtral", "sdpa").to(torch.float64)
    assert experts_in_float64(wide) == {"": "grouped_mm"} and wide.get_experts_implementation() == {"": "eager"}
    assert experts_in_float64(wide) == {}
    kept = tiny_family_model("mixtral", "sdpa").to(torch.float64)  # the hf adapter's call: the model stays as it is
    with pytest.raises(ValueError, match="experts_implementation='eager'"):
        CausalLM(kept, device="cpu", switch_attention=False)
    assert kept.get_experts_implementation() == {"": "grouped_mm"}
    assert experts_in_float64(tiny_family_model("llama", "sdpa").to(torch.float64)) == {}


# One tree rule per family, in turn; "onehot" runs EAGLE-2's dynamic tree.
RULES = ["traversal", "rrs", "rrs_without_replacement", "kseq", "gbv", "onehot"]
LEVEL, SAMPLES = 1e-6, 10_000


@pytest.mark.parametrize("family", [*FAMILIES, *MORE_FAMILIES])
def test_tree_rules_are_lossless_at_t1_for_every_family(family):
    """The first 3 tokens after an 8-token prompt (past the window of 6), 10,000 samples: the exact Bonferroni test
    rejects a lossless engine with probability <= 1e-6 (``stats.FPR_NOTE``); at this N the chi-square test detects a
    TV of 0.076-0.079 between the cell laws (``detectable_tv``, asserted below so the power is stated, not hoped)."""
    rule = RULES[[*FAMILIES, *MORE_FAMILIES].index(family) % len(RULES)]
    model = tiny_family_model(family, "eager", init_std=0.3)
    target, draft = CausalLM(model, device="cpu"), CausalLM(perturbed_copy(model, noise=0.3), device="cpu")
    options = dict(draft_law="dynamic") if rule == "onehot" else {}
    gamma = 1 if rule == "kseq" else 2  # SpecTr's K-SEQ is single-step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = lossless_test(target, draft, rule, [5, 9, 3, 7, 2, 11, 4, 8], sampling=SamplingConfig(), gamma=gamma, k=3,
                               max_new_tokens=4, num_samples=SAMPLES, seed=11, batch_size=SAMPLES // 2, num_drafts=2,
                               **options)
    assert result.detectable_tv(LEVEL) < 0.08, result.detectable_tv(LEVEL)
    assert result.impossible == 0 and result.bonferroni_p_value > LEVEL, (rule, result.p_value)


def test_a_layer_type_it_cannot_mask_is_refused_in_one_line():
    from transformers import AutoModelForCausalLM

    from specresearch.models.toy import tiny_llama_config

    model = AutoModelForCausalLM.from_config(tiny_llama_config(attention_chunk_size=4))
    with pytest.raises(ValueError, match=r"LlamaForCausalLM has 'chunked_attention' layers; CausalLM masks full and"):
        CausalLM(model, device="cpu")


def test_a_kernel_without_masks_is_switched_or_refused():
    model = tiny_family_model("qwen2", "sdpa")
    model.config._attn_implementation = "flash_attention_2"  # what a CUDA-loaded model reports
    with pytest.raises(ValueError, match=r"Qwen2ForCausalLM uses attention 'flash_attention_2', which takes no 4-D "
                                         r"mask .*: load it with attn_implementation='sdpa'"):
        CausalLM(model, device="cpu", switch_attention=False)
    assert model.config._attn_implementation == "flash_attention_2"  # refused: the caller's model is left alone
    with pytest.warns(UserWarning, match="switched to 'sdpa'"):
        lm = CausalLM(model, device="cpu", skinny_linear=False)
    assert lm.switched_from == "flash_attention_2" and lm.model.config._attn_implementation == "sdpa"


def test_the_transformers_adapter_refuses_a_flash_model_instead_of_changing_it():
    import specresearch.engine.hf as hf

    model = tiny_family_model("llama", "sdpa")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="uses attention 'flash_attention_2'"):
        model.generate(torch.tensor([[5, 9, 3]]), max_new_tokens=4, do_sample=False,
                       custom_generate=hf.speculative(tiny_family_model("llama", "sdpa"), gamma=2))
    assert model.config._attn_implementation == "flash_attention_2"


def test_the_docs_table_is_the_records():
    """docs/engine_and_models.md's matrix is ``matrix_table`` of the committed record, and the record covers every
    case (``benchmarks/family_matrix.py --docs`` writes both)."""
    from specresearch.experiments.families import matrix_table

    docs = (ROOT / "docs" / "engine_and_models.md").read_text()
    block = docs.split("<!-- family-matrix: generated by benchmarks/family_matrix.py -->\n", 1)[1]
    assert block.split("<!-- family-matrix: end -->", 1)[0] == matrix_table(RECORD["rows"])
    assert set(RECORDED) == set(all_cases())
    block = docs.split("<!-- family-matrix-more: generated by benchmarks/family_matrix.py --more -->\n", 1)[1]
    assert block.split("<!-- family-matrix-more: end -->", 1)[0] == matrix_table(RECORD_MORE["rows"])
    assert set(RECORDED_MORE) == set(more_cases())


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh runs it)")


@pytest.mark.cuda
@CUDA
def test_the_engine_gives_generates_tokens_on_cuda():
    """The matrix on CUDA (chains, sampled and dynamic trees), with the kernels only CUDA loads (flash-attn's, where
    installed): exact, switched or refused, never a wrong token (sdpa there is the wrapper's packed_sdpa_attention).
    One test over every case, so that the report lists every failing case at once."""
    kernels = ["eager", "sdpa", "sdpa (as loaded)", "flex_attention", "flash_attention_2 (loaded)"]
    results = [run_case(f, k, s, device="cuda") for f in FAMILIES for k in kernels
               for s in ("chain", "sampled tree", "dynamic tree")]
    wrong = [r for r in results if not r.ok or (r.kernel in ("eager", "sdpa (as loaded)")
                                                 and r.status not in ("exact", "not offered"))]
    assert not wrong, wrong


@pytest.mark.parametrize("family", [*FAMILIES, *MORE_FAMILIES])
@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_every_familys_captured_steps_trace_as_one_graph(family, kernel):
    """What a captured step asks of each family's own code: the static target's calls of a chain step and of a tree
    step (a chain of 3 tokens, commit, a 4-node tree with its visibility, keep its path; two left-padded rows) trace
    as one graph with no break (``torch._dynamo.explain``: what ``torch.compile(fullgraph=True)`` and a CUDA graph
    need), so no host read or Python branch on a value in transformers' code of any family. The rest of a step
    (drafting, verifiers, bookkeeping) is family-free and traced whole in tests/test_static.py; the matrix above runs
    every family's captured steps against ``generate``."""
    try:
        model = tiny_family_model(family, kernel)
    except (ValueError, ImportError):
        pytest.skip(f"transformers has no {kernel} {family}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = CausalLM(model, device="cpu").static_form()
    explained = explain_static_calls(lm)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_a_row_may_part_from_generates_only_at_a_float_tie():
    """The matrix's comparison (``experiments.families._within_ties``): a row equal to ``generate``'s passes; one that
    parts where two tokens' logits are equal (a tiny Llama whose output rows for both are one row) and then goes on
    as ``generate`` does from its own choice passes; one that parts anywhere else, or that goes on otherwise after a
    tie, does not."""
    from specresearch.experiments.families import NEW_TOKENS, _within_ties, reference_tokens

    model = tiny_family_model("llama", "eager")
    prompt = [5, 9, 3]
    expected = reference_tokens(model, [prompt])[0]
    other = max(t for t in range(model.config.vocab_size) if t not in expected)
    with torch.no_grad():
        model.lm_head.weight[other] = model.lm_head.weight[expected[3]]  # an exact tie at the 4th token
    expected = reference_tokens(model, [prompt])[0]
    assert expected[3] < other  # generate's argmax takes the first of tied logits
    branch = expected[:3] + [other]
    got = branch + reference_tokens(model, [prompt + branch], NEW_TOKENS - 4)[0]
    eos = model.config.vocab_size  # no token ends a row here
    assert _within_ties(model, prompt, expected, expected, eos)
    assert _within_ties(model, prompt, got, expected, eos)
    assert not _within_ties(model, prompt, got[:-1] + [(got[-1] + 1) % other], expected, eos)
    assert not _within_ties(model, prompt, [expected[0] ^ 1] + expected[1:], expected, eos)
