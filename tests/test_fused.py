"""Fused projections (``models.fused``): each layer's q / k / v projections and its MLP's gate / up pair as one product.

* On every family and both of transformers' kernels: cached, chain and tree scoring compute what the unfused layers
  compute (float tolerance), with the matrix products a call launches fewer by exactly the fused members; families
  that fuse their own projections (Phi-3, GPT-2, GPT-NeoX, Falcon) are left as they are.
* The engine's chains and trees, growing and captured, give transformers' ``generate`` tokens with fused models.
* A captured step of fused models still traces as one graph (no break).
* The weights are held once (views of the group's tensor) and the state dict is unchanged; a model moved or converted
  after fusing is fused again as a batch starts; gradients reach every member's weight; unfusing gives the classes back.
"""

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from helpers import explain_static_calls

from specresearch.engine.prompts import encode_prompts
from specresearch.engine.timing import Kernels
from specresearch.experiments.families import KERNELS, run_case
from specresearch.models.causal_lm import CausalLM
from specresearch.models.families import FAMILIES, tiny_family_model
from specresearch.models.fused import FusedLinear, fuse_projections, fused_intact, unfuse_projections

PRODUCTS = ("mm", "addmm", "kernel_linear")  # the operators a linear layer's product dispatches to
MATRIX = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "records" / "family_matrix.json").read_text())
OWN_FUSION = {"phi3", "gpt2", "gpt-neox", "falcon"}  # families whose checkpoints lay q / k / v end to end already


def _model(family, kernel):
    try:
        return tiny_family_model(family, kernel)
    except (ValueError, ImportError):
        pytest.skip(f"transformers has no {kernel} {family}")


def _calls(lm, ids, mask):
    """Prefill, a 2-token chain and a 3-node tree; -> (the three calls' logits, matrix products launched)."""
    with Kernels() as kernels, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = lm.prefill(ids, mask)
        chain = lm.score(torch.tensor([[3, 4], [5, 6]]))
        lm.begin_tree()
        visible = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)[None].expand(2, -1, -1)
        tree = lm.score_tree(torch.tensor([[7, 8, 9], [9, 8, 7]]), torch.tensor([[0, 1, 1]]).expand(2, -1), visible)
    return (first, chain, tree), sum(kernels.by_op[name] for name in PRODUCTS)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_fused_layers_compute_what_the_layers_compute_with_fewer_products(family, kernel):
    ids, mask = encode_prompts([[5, 9, 3, 7], [4, 8]])
    plain = CausalLM(_model(family, kernel), device="cpu", fuse_projections=False)
    fused = CausalLM(_model(family, kernel), device="cpu", fuse_projections=True)
    members = [m for m in fused.model.modules() if isinstance(m, FusedLinear)]
    expected, plain_products = _calls(plain, ids, mask)
    got, fused_products = _calls(fused, ids, mask)
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    groups = {id(m.group): len(m.group.sizes) for m in members}
    saved = sum(size - 1 for size in groups.values())  # a group of n members: n products become one
    assert plain_products - fused_products == 3 * saved  # three calls
    if family in OWN_FUSION:
        assert not members
    else:
        layers = fused.model.config.get_text_config().num_hidden_layers
        assert len(groups) >= layers and saved >= 2 * layers  # q / k / v in every layer, gate / up where gated


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in OWN_FUSION])
def test_the_engine_gives_generates_tokens_with_fused_models(family):
    """The matrix's cases (experiments.families: greedy, three left-padded prompts, an EOS ending a row early) with the
    target and the draft fused, on every kernel the matrix runs on the CPU (the ones the wrapper switches included):
    growing and captured chains and trees equal ``generate``'s tokens, or the case is refused as unfused."""
    steps = ("chain", "dynamic tree", "captured chain", "captured dynamic tree", "captured sampled tree")
    results = [run_case(family, kernel, step, fuse_projections=True) for kernel in KERNELS for step in steps]
    recorded = {(row["kernel"], row["step"]): row["status"] for row in MATRIX["rows"] if row["family"] == family}
    differ = {(r.kernel, r.step): r.status for r in results if recorded[r.kernel, r.step] != r.status}
    assert not differ, differ  # fused, each case ends as the matrix's record says it does unfused
    wrong = [r for r in results if r.status not in ("exact", "switched", "refused", "not offered")]
    assert not wrong, wrong
    assert any(r.status == "exact" for r in results)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "mistral"])
def test_a_fused_captured_step_traces_as_one_graph(family):
    model = tiny_family_model(family, "eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = CausalLM(model, device="cpu", fuse_projections=True).static_form()
    explained = explain_static_calls(lm)  # a chain and a tree call (tests/helpers.py)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    layers = model.config.num_hidden_layers
    products = [str(node.target) for graph in explained.graphs for node in graph.graph.nodes
                if node.op == "call_function" and re.search(r"linear|\bmm\b|addmm", str(node.target))]
    assert len(products) == 2 * (4 * layers + 1), products  # two calls: q/k/v, o, gate/up and down a layer, the head
    assert all(m.group.input is None for m in model.modules() if isinstance(m, FusedLinear))  # nothing left held


def test_weights_are_held_once_and_the_state_dict_is_unchanged():
    model = tiny_family_model("qwen2")  # q / k / v with biases
    before = {name: value.clone() for name, value in model.state_dict().items()}
    count = fuse_projections(model)
    assert count == 2 * model.config.num_hidden_layers
    assert fuse_projections(model) == count  # idempotent: laid out again
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], before[name]) for name in before)
    attention = model.model.layers[0].self_attn
    group = attention.q_proj.group
    assert attention.k_proj.group is group and attention.v_proj.group is group
    for member in (attention.q_proj, attention.k_proj, attention.v_proj):
        assert member.weight.untyped_storage().data_ptr() == group.weight.untyped_storage().data_ptr()
        assert member.bias.untyped_storage().data_ptr() == group.bias.untyped_storage().data_ptr()
    assert unfuse_projections(model) == 5 * model.config.num_hidden_layers
    assert not any(isinstance(m, FusedLinear) for m in model.modules())
    assert type(attention.q_proj) is torch.nn.Linear and not hasattr(attention.q_proj, "group")


def test_the_kernel_calibrations_time_each_group_once_by_its_whole_weight():
    """``kernels.choose_skinny_rows`` / ``choose_kernel_rows`` time the products a forward computes: fused, a group's
    weight where its first member stands, its other members not at all (their columns come from that product)."""
    from specresearch.models import kernels

    model = tiny_family_model("qwen2")  # q / k / v with biases
    plain = [m.weight for m in kernels._products(model, "kernel_rows")]
    fuse_projections(model)
    products = kernels._products(model, "kernel_rows")
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    expected = []
    for layer in model.model.layers:
        expected += [layer.self_attn.q_proj.group.weight, layer.self_attn.o_proj.weight,
                     layer.mlp.gate_proj.group.weight, layer.mlp.down_proj.weight]
    expected.append(model.lm_head.weight)
    assert [p.weight for p in products] == expected and len(plain) == len(expected) + 3 * len(model.model.layers)
    assert sum(p.weight.numel() for p in products) == sum(w.numel() for w in plain)  # the same bytes streamed
    assert products[0].bias is attention.q_proj.group.bias and products[2].bias is None
    assert products[0].skinny_rows == attention.q_proj.skinny_rows and mlp.gate_proj.computes == (
        mlp.gate_proj.group.weight, None) and mlp.up_proj.computes == (None, None)


def test_a_group_computes_with_the_row_options_given_after_fusing(monkeypatch):
    """The calibrations run on the fused model and ``use_kernel_rows`` gives its answer to every member afterwards: the
    group's product takes them (it does not keep the options its members had when fused)."""
    from specresearch.models import kernels

    calls = []
    monkeypatch.setattr(kernels, "kernel_linear", lambda x, weight, bias=None, scale=None: calls.append(weight.shape))
    lm = CausalLM(tiny_family_model("llama", "sdpa"), device="cpu", fuse_projections=True, skinny_linear=False)
    ids, mask = encode_prompts([[5, 9, 3, 7]])
    lm.prefill(ids, mask)
    lm.score(torch.tensor([[3]]))
    assert calls == []  # no kernel rows: none offered to the kernel
    kernels.use_kernel_rows(lm.model, (1,))
    lm.score(torch.tensor([[4]]))
    config = lm.model.config
    head = config.hidden_size // config.num_attention_heads
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head
    per_layer = [(qkv, config.hidden_size), (config.hidden_size, config.hidden_size),
                 (2 * config.intermediate_size, config.hidden_size), (config.hidden_size, config.intermediate_size)]
    assert calls == per_layer * config.num_hidden_layers + [tuple(lm.model.lm_head.weight.shape)]


def test_a_model_moved_after_fusing_is_fused_again_as_a_batch_starts():
    ids, mask = encode_prompts([[5, 9, 3, 7], [4, 8]])
    lm = CausalLM(tiny_family_model("llama", "sdpa"), device="cpu", fuse_projections=True, skinny_linear=False)
    reference = CausalLM(tiny_family_model("llama", "sdpa").double(), device="cpu", fuse_projections=False,
                         skinny_linear=False)  # (transformers' eager attention gives float64's padded rows NaN)
    lm.model.double()  # every parameter converted: the members' weights leave their groups' tensors
    assert not fused_intact(lm.model)
    torch.testing.assert_close(lm.prefill(ids.clone(), mask), reference.prefill(ids.clone(), mask))
    assert fused_intact(lm.model)
    with torch.no_grad():  # a weight changed in place after fusing: the group reads it (a view)
        lm.model.model.layers[0].self_attn.k_proj.weight.mul_(2)
        reference.model.model.layers[0].self_attn.k_proj.weight.mul_(2)
    assert fused_intact(lm.model)
    torch.testing.assert_close(lm.prefill(ids.clone(), mask), reference.prefill(ids.clone(), mask))
    for model in (lm.model, reference.model):  # a weight replaced: that group no longer holds
        gate = model.model.layers[1].mlp.gate_proj
        gate.weight = torch.nn.Parameter(gate.weight.detach() * 3)
    assert not fused_intact(lm.model)
    torch.testing.assert_close(lm.prefill(ids.clone(), mask), reference.prefill(ids.clone(), mask))


def test_gradients_reach_every_member():
    ids = torch.tensor([[5, 9, 3, 7, 2]])
    plain, fused = tiny_family_model("llama"), tiny_family_model("llama")
    fuse_projections(fused)
    for model in (plain, fused):
        model.train()
        model(ids, labels=ids).loss.backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), fused.named_parameters()):
        assert b.grad is not None, name
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)


def test_fusing_is_on_by_default_and_refused_for_a_split_model():
    lm = CausalLM(tiny_family_model("llama"), device="cpu")
    assert lm.fuses and sum(isinstance(m, FusedLinear) for m in lm.model.modules()) == 5 * 2  # 2 layers
    assert not CausalLM(tiny_family_model("llama"), device="cpu", fuse_projections=False).fuses
    model = tiny_family_model("llama")
    model.hf_device_map = {"model.embed_tokens": "cpu", "model.layers": "meta", "lm_head": "cpu"}
    with pytest.raises(ValueError, match="fuse_projections=True lays weights end to end"):
        CausalLM(model, device="cpu", fuse_projections=True)


def test_half_weights_after_fusing_unfuse_the_layers_they_convert():
    """``drafts.registry.half_weight_draft`` on a draft fused where it loaded (CUDA's default): every layer gets its
    float16 weight, none is left computing from the group's float32 copy."""
    from specresearch.models.kernels import use_half_weights

    ids, mask = encode_prompts([[5, 9, 3, 7], [4, 8]])
    fused = CausalLM(tiny_family_model("llama", "sdpa"), device="cpu", fuse_projections=True, skinny_linear=False)
    plain = CausalLM(tiny_family_model("llama", "sdpa"), device="cpu", fuse_projections=False, skinny_linear=False)
    for lm in (fused, plain):
        use_half_weights(lm.model)
    assert not any(isinstance(m, FusedLinear) for m in fused.model.modules())
    assert fused.model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float16
    torch.testing.assert_close(fused.prefill(ids.clone(), mask), plain.prefill(ids.clone(), mask), rtol=0, atol=0)


@pytest.mark.parametrize("skinny_linear", [False, None], ids=["as on CUDA", "the CPU's kernels"])
def test_the_embedded_target_fused_scores_what_it_scores_unfused(skinny_linear):
    """SmolLM2-135M fused and not, on the path CUDA runs (plain linear layers) and on the CPU's own (the skinny and
    compiled products its calibration chose): prefill, a 1-token and a 4-token call agree to float tolerance; as on
    CUDA, with 90 fewer products a call (2 of every layer's q / k / v, 1 of its gate / up; the compiled kernel, which
    this machine's calibration may choose for some row counts, runs outside torch's dispatcher, uncounted)."""
    from specresearch.models import embedded

    plain, tokenizer = embedded.load_embedded("smollm2-135m-instruct", device="cpu", skinny_linear=skinny_linear,
                                              fuse_projections=False)
    fused, _ = embedded.load_embedded("smollm2-135m-instruct", device="cpu", skinny_linear=skinny_linear,
                                      fuse_projections=True)
    ids, mask = encode_prompts(["The capital of France is", "Hi"], tokenizer)
    chain = torch.tensor([[264, 3575, 282, 1345], [28, 1073, 314, 1345]])
    logits, products = {}, {}
    for name, lm in (("plain", plain), ("fused", fused)):
        with Kernels() as kernels:
            logits[name] = (lm.prefill(ids, mask), lm.score(chain[:, :1]), lm.score(chain))
        products[name] = sum(kernels.by_op[op] for op in PRODUCTS)
    for a, b in zip(logits["plain"], logits["fused"]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    if skinny_linear is False:
        assert products["plain"] - products["fused"] == 3 * 90


def test_bench_step_ops_counts_both_models_fused_only_when_asked():
    """``bench_step_ops.as_on_cuda`` (the calls a CUDA step issues, counted on the CPU): with ``fuse`` both the target
    and the draft are fused; without, neither is, although ``CausalLM`` fuses by default (its records without
    ``--fuse`` are the unfused path the H200 ran). The target computes the same logits either way."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("bench_step_ops", root / "benchmarks" / "bench_step_ops.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    ids, mask = encode_prompts([[5, 9, 3, 7], [4, 8]])
    logits = {}
    for fuse in (False, True):
        target, draft = (CausalLM(tiny_family_model("llama", "sdpa"), device="cpu", skinny_linear=False)
                         for _ in range(2))
        assert target.fuses and fused_intact(target.model)  # the default
        script.as_on_cuda(target, draft, fuse=fuse)
        for model in (target.model, draft.model):
            members = [m for m in model.modules() if isinstance(m, FusedLinear)]
            assert len(members) == (5 * model.config.num_hidden_layers if fuse else 0)
        logits[fuse] = target.prefill(ids, mask)
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fuse", [False, True])
def test_drafts_by_name_are_fused_as_their_target_is(fuse):
    """A draft ``draft_from_name`` wraps in ``CausalLM`` (a truncated target, DIAL's base over the target's own
    model) fuses as its target does: a target left unfused (``load_pair(fuse_projections=False)``, what the audits
    hand to other code) keeps its draft, and its own model, as transformers built them."""
    from specresearch.drafts.registry import draft_from_name

    target = CausalLM(tiny_family_model("llama", "sdpa"), device="cpu", fuse_projections=fuse)
    truncated = draft_from_name("truncated:1", target)
    dial = draft_from_name("dial-temp:1.5", target)
    assert truncated.fuses is fuse and dial.base.fuses is fuse
    for model in (target.model, truncated.model):
        assert any(isinstance(m, FusedLinear) for m in model.modules()) is fuse


def test_the_matrixs_hf_adapter_row_runs_unfused():
    """The family matrix's ``"sdpa (as loaded)"`` row is ``engine.hf``'s path, unfused; its other rows fuse."""
    from specresearch.experiments.families import family_wrapper

    for how, fuses in (("plain", False), ("default", True)):
        lm = family_wrapper(tiny_family_model("llama", "sdpa"), how)
        assert lm.fuses is fuses and any(isinstance(m, FusedLinear) for m in lm.model.modules()) is fuses


def test_the_audits_plain_pair_is_unfused():
    """``audit.execute.default_pair``: the models other engines' code runs, as transformers built them."""
    from specresearch.audit.execute import default_pair

    target, draft, _ = default_pair()
    assert not any(isinstance(m, FusedLinear) for model in (target, draft) for m in model.modules())


def test_a_fused_feature_head_drafts_what_it_drafts_unfused():
    """A feature head (q / k / v and gate / up in its layers) fused as CUDA's FeatureDraft fuses it: its cached
    drafting equals the unfused head's, and greedy chains and trees with it, growing and captured, give the target's
    greedy tokens."""
    import copy

    from helpers import feature_head

    from specresearch.config import SamplingConfig
    from specresearch.drafts.feature import FeatureDraft
    from specresearch.engine.generate import autoregressive_generate, speculative_generate
    from specresearch.models.toy import tiny_llama

    target = tiny_llama(48, seed=0, init_std=0.6, num_layers=3)
    head = feature_head(target.model)
    plain = FeatureDraft(head)
    fused = FeatureDraft(copy.deepcopy(head), fuse_projections=True)
    assert not plain.fuses and fused.fuses
    assert sum(isinstance(m, FusedLinear) for m in fused.head.modules()) >= 5
    seq = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        out = target.model(input_ids=seq, output_hidden_states=True)
    features = torch.cat([out.hidden_states[i] for i in head.feature_layers], -1)
    before = torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], 1)  # slot j reads the feature of j - 1
    logits = []
    for draft in (plain, fused):
        draft.observe(before[:, :4])
        prefilled = draft.prefill(seq[:, :4], torch.ones(1, 4, dtype=torch.long))
        draft.observe(before[:, 4:6])
        logits.append((prefilled, draft.score(seq[:, 4:6]), draft.score(seq[:, 5:6])))  # the last: its own prediction
    for a, b in zip(*logits):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    prompts, greedy = [[5, 9, 2, 33, 7], [4, 8]], SamplingConfig(temperature=0.0)
    expected = autoregressive_generate(target, prompts, max_new_tokens=10, sampling=greedy).tokens
    for compile in ("off", "static"):
        for options in (dict(gamma=3), dict(verifier="onehot", num_drafts=3, gamma=3, draft_law="dynamic")):
            got = speculative_generate(target, fused, prompts, max_new_tokens=10, sampling=greedy, compile=compile,
                                       **options).tokens
            assert got == expected, (compile, options)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh runs it)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_fusing_is_the_default_and_computes_what_the_layers_compute(dtype):
    ids, mask = encode_prompts([[5, 9, 3, 7], [4, 8]])
    fused = CausalLM(tiny_family_model("qwen2", "sdpa").to(dtype), device="cuda")
    plain = CausalLM(tiny_family_model("qwen2", "sdpa").to(dtype), device="cuda", fuse_projections=False)
    assert fused.fuses and any(isinstance(m, FusedLinear) for m in fused.model.modules())
    tolerance = dict(rtol=0.05, atol=0.1) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused.prefill(ids, mask), plain.prefill(ids, mask), **tolerance)
    chain = torch.tensor([[3, 4], [5, 6]], device="cuda")
    torch.testing.assert_close(fused.score(chain), plain.score(chain), **tolerance)


@pytest.mark.parametrize("kind, options", [
    ("feature", dict(verifier="block", gamma=3)),
    ("feature", dict(verifier="onehot", num_drafts=3, gamma=3, draft_law="dynamic")),
    ("eagle3", dict(verifier="greedy", gamma=1))])
def test_fused_captured_steps_compile_to_what_they_compute_eagerly(kind, options):
    """Fused target and head: five captured steps at T = 1 from the same uniforms log the same accepted counts and
    tokens eagerly, compiled (``fullgraph=True``, ``aot_eager``: dynamo's graph of the groups' held products) and
    unfused."""
    from helpers import feature_head

    from specresearch.config import SamplingConfig
    from specresearch.drafts.eagle import Eagle3Head, EagleDraft
    from specresearch.drafts.feature import FeatureDraft, FeatureHeadConfig
    from specresearch.engine.static import plan_for, start_run
    from specresearch.models.toy import tiny_llama

    def pair(fuse: bool):
        target = tiny_llama(48, seed=0, init_std=0.6)
        if kind == "feature":
            head = FeatureDraft(feature_head(target.model), fuse_projections=fuse)
        else:
            config = FeatureHeadConfig("e3", feature_layers=(0, 1, 2), init_layer=None, head_tokens=16,
                                       train_head=True, architecture="eagle3")
            head = EagleDraft(Eagle3Head.from_feature_config(target.model, config, torch.arange(16) * 3, seed=3),
                              fuse_projections=fuse)
        if fuse:
            target.fuses = fuse_projections(target.model) > 0
        return target, head

    def logs(fuse: bool, compiled: bool) -> torch.Tensor:
        target, head = pair(fuse)
        ids, mask = encode_prompts([[5, 9, 2, 33, 7, 5, 9], [4, 8]])
        plan = plan_for(options["verifier"], options["gamma"], options.get("num_drafts", 1),
                        options.get("draft_law", "iid"), None)
        run = start_run(target, head, ids, mask, plan=plan, sampling=SamplingConfig(temperature=1.0),
                        max_new_tokens=10, eos={21}, steps_per_read=5)  # the log holds the five steps
        step = torch.compile(run.step, fullgraph=True, dynamic=False, backend="aot_eager") if compiled else run.step
        generator = torch.Generator().manual_seed(0)
        for _ in range(5):
            run.state.uniforms.copy_(torch.rand(run.state.uniforms.shape, generator=generator, dtype=torch.float64))
            step()
        assert not fuse or any(isinstance(m, FusedLinear) for m in head.head.modules())
        return run.state.log.clone()

    torch._dynamo.reset()
    eager = logs(True, False)
    assert torch.equal(logs(True, True), eager)
    assert torch.equal(logs(False, False), eager)
