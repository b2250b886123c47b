"""Drafts in their published layouts: EAGLE-1/2 and EAGLE-3 heads as SafeAILab/EAGLE saves them, transformers
assistant models.

* A random-weight EAGLE-3 checkpoint (config.json + model.safetensors or pytorch_model.bin, a draft vocabulary of 40
  of the target's 64 tokens through d2t) loads, and its draft logits equal a reference forward the test computes from
  the format's definition (``drafts.eagle``'s docstring: fc over the target's hidden states 2, L // 2, L - 3, a
  midlayer over [input_layernorm(embedding), hidden_norm(g)], lm_head(norm(h)) mapped by d2t), at the prompt and at
  a drafted slot that reads the head's own output.
* It runs chains and trees through the engine (greedy = the target's greedy) and is lossless at T = 1; on targets
  with recurrent layers (Qwen3.5, Mamba, Falcon-H1: the same hidden size and vocabulary) its greedy chains give the
  target's tokens in the growing loop and in captured steps (``models.static_states``).
* The same for an EAGLE-1/2 head (two layers, fc with a bias, the target's head on the output).
* A wrong tensor name or shape is refused with the name; an unknown directory layout in one line.
* Saved again in the layout, it loads to the same logits.
"""

import json
import math

import pytest
import torch

from specresearch.config import SamplingConfig
from specresearch.drafts.eagle import EagleDraft, load_eagle3, save_eagle3
from specresearch.drafts.registry import (
    EAGLE1_FORMAT,
    EAGLE3_FORMAT,
    EAGLE3_SPECULATORS_FORMAT,
    draft_format,
    draft_from_name,
)
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.experiments.stats import lossless_test
from specresearch.models.causal_lm import CausalLM
from specresearch.models.families import tiny_recurrent_model
from specresearch.models.toy import tiny_llama

H, HEADS, KV, INTER, VOCAB, DRAFT_VOCAB, LAYERS = 32, 4, 2, 48, 64, 40, 8


def _target():
    return tiny_llama(VOCAB, seed=0, init_std=0.5, num_layers=LAYERS)


def _checkpoint(directory, *, seed=0, safetensors=True, embed=False, rename=None, reshape=None):
    """A random EAGLE-3 head in the repository's layout; returns its tensors and draft token ids."""
    g = torch.Generator().manual_seed(seed)
    token_ids = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
    d = H // HEADS
    shapes = {"fc.weight": (H, 3 * H), "midlayer.self_attn.q_proj.weight": (HEADS * d, 2 * H),
              "midlayer.self_attn.k_proj.weight": (KV * d, 2 * H), "midlayer.self_attn.v_proj.weight": (KV * d, 2 * H),
              "midlayer.self_attn.o_proj.weight": (H, HEADS * d), "midlayer.mlp.gate_proj.weight": (INTER, H),
              "midlayer.mlp.up_proj.weight": (INTER, H), "midlayer.mlp.down_proj.weight": (H, INTER),
              "lm_head.weight": (DRAFT_VOCAB, H)}
    tensors = {name: torch.randn(shape, generator=g) / math.sqrt(shape[-1]) for name, shape in shapes.items()}
    for name in ("midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
                 "midlayer.post_attention_layernorm.weight", "norm.weight"):
        tensors[name] = 1 + 0.1 * torch.randn(H, generator=g)
    tensors["d2t"] = token_ids - torch.arange(DRAFT_VOCAB)
    tensors["t2d"] = torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, token_ids, True)
    if embed:
        tensors["embed_tokens.weight"] = torch.randn(VOCAB, H, generator=g)
    if rename:
        tensors[rename[1]] = tensors.pop(rename[0])
    if reshape:
        tensors[reshape] = tensors[reshape][:, :-1].contiguous()
    config = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": H, "intermediate_size": INTER,
              "num_attention_heads": HEADS, "num_key_value_heads": KV, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB, "max_position_embeddings": 256}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if safetensors:
        from safetensors.torch import save_file

        save_file(tensors, directory / "model.safetensors")
    else:
        torch.save(tensors, directory / "pytorch_model.bin")
    return tensors, token_ids


def _rms(x, w, eps=1e-6):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x, positions):
    d = x.shape[-1]
    inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2).float() / d)
    angles = positions.float()[:, None] * inv
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def _attention(x, t, at, n):
    """Causal multi-head attention of the layer ``at`` over rows ``x [n, in]`` (RoPE, grouped KV heads)."""
    d = H // HEADS
    positions = torch.arange(n)
    q, k = (x @ t[at + "self_attn.q_proj.weight"].T).view(n, HEADS, d), (x @ t[at + "self_attn.k_proj.weight"].T).view(n, KV, d)
    if at + "self_attn.q_norm.weight" in t:  # a qwen3 layer: q and k normed per head before RoPE
        q, k = _rms(q, t[at + "self_attn.q_norm.weight"]), _rms(k, t[at + "self_attn.k_norm.weight"])
    q, k = _rope(q.transpose(0, 1), positions), _rope(k.transpose(0, 1), positions)
    v = (x @ t[at + "self_attn.v_proj.weight"].T).view(n, KV, d).transpose(0, 1)
    k, v = k.repeat_interleave(HEADS // KV, 0), v.repeat_interleave(HEADS // KV, 0)
    scores = (q @ k.transpose(1, 2)) / math.sqrt(d) + torch.full((n, n), float("-inf")).triu(1)
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, -1) @ t[at + "self_attn.o_proj.weight"].T


def _mlp(h, t, at):
    y = _rms(h, t[at + "post_attention_layernorm.weight"])
    return (torch.nn.functional.silu(y @ t[at + "mlp.gate_proj.weight"].T) * (y @ t[at + "mlp.up_proj.weight"].T)
            ) @ t[at + "mlp.down_proj.weight"].T


def _reference(t, tokens, inputs, embedding, token_ids, norm_before_residual=False):
    """EAGLE-3's step over a whole sequence from the format's definition, uncached: tokens [n], inputs g [n, H]
    (already through fc, or a previous output) -> outputs h [n, H] and target-vocabulary log-probabilities [n, V].
    ``norm_before_residual`` (speculators' option): the residual is hidden_norm(g), not g."""
    normed = _rms(inputs, t["midlayer.hidden_norm.weight"])
    x = torch.cat([_rms(embedding[tokens], t["midlayer.input_layernorm.weight"]), normed], -1)
    h = (normed if norm_before_residual else inputs) + _attention(x, t, "midlayer.", len(tokens))
    h = h + _mlp(h, t, "midlayer.")
    draft_logits = _rms(h, t["norm.weight"]) @ t["lm_head.weight"].T
    full = torch.full((len(tokens), VOCAB), float("-inf")).index_copy(1, token_ids, draft_logits)
    return h, full.log_softmax(-1)


def _exact_and_lossless(target, draft, *, chain_gamma: int, tree_gamma: int, k: int, seed: int) -> None:
    """Greedy chains, sampled trees and dynamic trees give the target's greedy tokens (three left-padded prompts);
    at T = 1, 6,000 samples of the first k tokens pass the exact Bonferroni test, whose false-positive rate is
    <= 1e-6."""
    prompts, greedy = [[5, 9, 3], [7, 2, 11, 4, 8, 6, 12], [20, 21]], SamplingConfig(temperature=0.0)
    want = autoregressive_generate(target, prompts, max_new_tokens=10, sampling=greedy).tokens
    for options in (dict(verifier="block", gamma=chain_gamma), dict(verifier="traversal", num_drafts=2, gamma=tree_gamma),
                    dict(verifier="onehot", num_drafts=2, gamma=tree_gamma, draft_law="dynamic")):
        assert speculative_generate(target, draft, prompts, max_new_tokens=10, sampling=greedy, **options).tokens == want
    result = lossless_test(target, draft, "block", [5, 9, 3, 17], sampling=SamplingConfig(), gamma=k, k=k,
                           max_new_tokens=k + 1, num_samples=6_000, seed=seed, batch_size=3_000)
    assert result.impossible == 0 and result.bonferroni_p_value > 1e-6, result.p_value


@pytest.mark.parametrize("safetensors, embed", [(True, False), (False, True)])
def test_eagle3_logits_follow_the_formats_definition(tmp_path, safetensors, embed):
    target = _target()
    tensors, token_ids = _checkpoint(tmp_path / "head", safetensors=safetensors, embed=embed)
    draft = load_eagle3(target, tmp_path / "head")
    assert isinstance(draft, EagleDraft) and draft.feature_layers == (2, LAYERS // 2, LAYERS - 3)
    prompt = [5, 9, 3, 17, 22, 8, 41]
    ids = torch.tensor([prompt])
    _, features = target.prefill(ids, torch.ones_like(ids), hidden_layers=draft.feature_layers)  # [1, n, 3H]
    before = torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], 1)
    draft.observe(before)
    got = draft.prefill(ids, torch.ones_like(ids)).log_softmax(-1)[0]  # slot of x_6, feature of slot 5
    embedding = tensors["embed_tokens.weight"] if embed else target.model.get_input_embeddings().weight.detach()
    g = features[0, :-1] @ tensors["fc.weight"].T  # EAGLE's slots: token x_{j+1} with the feature of slot j
    h, want = _reference(tensors, torch.tensor(prompt[1:]), g, embedding, token_ids)
    finite = want[-1].isfinite()
    assert torch.equal(got.exp() > 0, finite) and torch.allclose(got[finite], want[-1][finite], atol=1e-4)
    # a drafted slot: token y with the head's own previous output (no fc), attending to the prompt's slots
    y = 30
    got_next = draft.score(torch.tensor([[y]])).log_softmax(-1)[0, 0]
    _, want_next = _reference(tensors, torch.tensor(prompt[1:] + [y]), torch.cat([g, h[-1:]]), embedding, token_ids)
    assert torch.allclose(got_next[finite], want_next[-1][finite], atol=1e-4)


def test_eagle3_with_its_layer_saved_as_layers_0_loads_the_same(tmp_path):
    """The layer under ``layers.0.*`` (the name serving engines' loaders map ``midlayer`` to) is the same head."""
    from safetensors.torch import load_file, save_file

    target = _target()
    _checkpoint(tmp_path / "midlayer")
    (tmp_path / "layers0").mkdir()
    (tmp_path / "layers0" / "config.json").write_text((tmp_path / "midlayer" / "config.json").read_text())
    tensors = load_file(tmp_path / "midlayer" / "model.safetensors")
    save_file({k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}, tmp_path / "layers0" / "model.safetensors")
    assert draft_format(tmp_path / "layers0") == EAGLE3_FORMAT
    features, ids, outs = torch.randn(1, 4, 3 * H), torch.tensor([[3, 4, 5, 6]]), []
    for name in ("midlayer", "layers0"):
        draft = load_eagle3(target, tmp_path / name)
        draft.observe(features)
        outs.append(draft.prefill(ids, torch.ones_like(ids)))
    assert torch.equal(outs[0], outs[1])


def _speculators_checkpoint(directory, *, seed=0, norm_before_residual=True, layer=None, qk_norm=False,
                            norm_before_fc=False, fc_norm=False, norm_output=False, extra=None):
    """A random EAGLE-3 head as vllm-project/speculators saves it: ``layers.0.*`` beside ``fc`` (with a bias, as its
    first releases), the layer's Llama config under ``transformer_layer_config``; returns its tensors (under the
    repository's names) and draft token ids."""
    from safetensors.torch import save_file

    tensors, token_ids = _checkpoint(directory.parent / f"{directory.name}-plain", seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    tensors["fc.bias"] = 0.1 * torch.randn(H, generator=g)
    if qk_norm:
        tensors |= {f"midlayer.self_attn.{n}_norm.weight": 1 + 0.3 * torch.randn(H // HEADS, generator=g) for n in "qk"}
    if norm_before_fc:
        tensors["input_norm.weight"] = 1 + 0.3 * torch.randn(3 * H, generator=g)
    if fc_norm:  # one norm per feature read
        tensors |= {f"fc_norm.{i}.weight": 1 + 0.3 * torch.randn(H, generator=g) for i in range(3)}
    for i in range(1, int((layer or {}).get("num_hidden_layers", 1)) if not qk_norm else 1):  # further Llama layers
        d, at = H // HEADS, f"layers.{i}."
        for name, shape in (("self_attn.q_proj.weight", (HEADS * d, H)), ("self_attn.k_proj.weight", (KV * d, H)),
                            ("self_attn.v_proj.weight", (KV * d, H)), ("self_attn.o_proj.weight", (H, HEADS * d)),
                            ("mlp.gate_proj.weight", (INTER, H)), ("mlp.up_proj.weight", (INTER, H)),
                            ("mlp.down_proj.weight", (H, INTER))):
            tensors[at + name] = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            tensors[at + name] = 1 + 0.1 * torch.randn(H, generator=g)
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": DRAFT_VOCAB,
              "norm_before_residual": norm_before_residual, "norm_before_fc": norm_before_fc, "fc_norm": fc_norm,
              "norm_output": norm_output, "target_hidden_size": None, **(extra or {}),
              "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "a tiny Llama"}},
              "transformer_layer_config": {"model_type": "llama", "hidden_size": H, "intermediate_size": INTER,
                                           "num_attention_heads": HEADS, "num_key_value_heads": KV,
                                           "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                                           "vocab_size": VOCAB, "max_position_embeddings": 256, **(layer or {})}}
    if norm_before_residual is None:  # a config written by hand without the key
        del config["norm_before_residual"]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}, directory / "model.safetensors")
    return tensors, token_ids


@pytest.mark.parametrize("kind", ["llama", "qwen3 with norm_before_fc"])
def test_a_speculators_eagle3_head_follows_its_definition_and_runs_in_the_engine(tmp_path, kind):
    """speculators' layout: its config flattened (``drafts.eagle.speculators_eagle3_config``), ``fc``'s bias read,
    ``norm_before_residual`` honoured (the residual is hidden_norm(g)), a qwen3 layer's q/k norms, ``norm_before_fc``'s
    norm over the features: logits as the definition at the prompt and at a drafted slot; read with
    ``norm_before_residual`` off, they differ; greedy chains and dynamic trees give the target's tokens."""
    target = _target()
    qwen3 = kind != "llama"
    layer = {"model_type": "qwen3", "head_dim": H // HEADS} if qwen3 else None
    tensors, token_ids = _speculators_checkpoint(tmp_path / "head", layer=layer, qk_norm=qwen3, norm_before_fc=qwen3)
    assert draft_format(tmp_path / "head") == EAGLE3_SPECULATORS_FORMAT
    draft = draft_from_name(str(tmp_path / "head"), target)
    assert isinstance(draft, EagleDraft) and draft.feature_layers == (2, LAYERS // 2, LAYERS - 3)
    prompt = [5, 9, 3, 17, 22, 8, 41]
    ids = torch.tensor([prompt])
    _, features = target.prefill(ids, torch.ones_like(ids), hidden_layers=draft.feature_layers)
    before = torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], 1)
    draft.observe(before)
    got = draft.prefill(ids, torch.ones_like(ids)).log_softmax(-1)[0]
    embedding = target.model.get_input_embeddings().weight.detach()
    read = _rms(features[0, :-1], tensors["input_norm.weight"]) if qwen3 else features[0, :-1]
    g = read @ tensors["fc.weight"].T + tensors["fc.bias"]
    h, want = _reference(tensors, torch.tensor(prompt[1:]), g, embedding, token_ids, norm_before_residual=True)
    finite = want[-1].isfinite()
    assert torch.equal(got.exp() > 0, finite) and torch.allclose(got[finite], want[-1][finite], atol=1e-4)
    got_next = draft.score(torch.tensor([[30]])).log_softmax(-1)[0, 0]
    _, want_next = _reference(tensors, torch.tensor(prompt[1:] + [30]), torch.cat([g, h[-1:]]), embedding, token_ids,
                              norm_before_residual=True)
    assert torch.allclose(got_next[finite], want_next[-1][finite], atol=1e-4)
    _speculators_checkpoint(tmp_path / "off", norm_before_residual=False, layer=layer, qk_norm=qwen3, norm_before_fc=qwen3)
    off = draft_from_name(str(tmp_path / "off"), target)
    off.observe(before)
    assert not torch.allclose(off.prefill(ids, torch.ones_like(ids)).log_softmax(-1)[0][finite], want[-1][finite],
                              atol=1e-2)
    prompts, greedy = [[5, 9, 3], [7, 2, 11, 4, 8, 6, 12]], SamplingConfig(temperature=0.0)
    want_tokens = autoregressive_generate(target, prompts, max_new_tokens=8, sampling=greedy).tokens
    for options in (dict(verifier="block", gamma=3), dict(verifier="onehot", num_drafts=2, gamma=2, draft_law="dynamic")):
        assert speculative_generate(target, draft, prompts, max_new_tokens=8, sampling=greedy, **options).tokens == want_tokens


def _further_layer(t, h, at):
    """A plain Llama decoder layer ``at`` over rows ``h [n, H]`` (speculators' layers after the first)."""
    h = h + _attention(_rms(h, t[at + "input_layernorm.weight"]), t, at, len(h))
    return h + _mlp(h, t, at)


def test_a_speculators_head_of_two_layers_runs_the_second_over_the_first(tmp_path):
    """A llama head of two layers: the EAGLE-3 layer, then a plain Llama layer over its output, whose output is the
    logits' input and what the drafted slot reads (the definition, at the prompt and at a drafted slot)."""
    target = _target()
    tensors, token_ids = _speculators_checkpoint(tmp_path / "head", layer={"num_hidden_layers": 2})
    draft = draft_from_name(str(tmp_path / "head"), target)
    assert len(draft.head.layers) == 2
    prompt = [5, 9, 3, 17, 22, 8, 41]
    ids = torch.tensor([prompt])
    _, features = target.prefill(ids, torch.ones_like(ids), hidden_layers=draft.feature_layers)
    draft.observe(torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], 1))
    got = draft.prefill(ids, torch.ones_like(ids)).log_softmax(-1)[0]
    embedding = target.model.get_input_embeddings().weight.detach()

    def reference(tokens, inputs):
        first, _ = _reference(tensors, tokens, inputs, embedding, token_ids, norm_before_residual=True)
        h = _further_layer(tensors, first, "layers.1.")
        logits = _rms(h, tensors["norm.weight"]) @ tensors["lm_head.weight"].T
        return h, torch.full((len(tokens), VOCAB), float("-inf")).index_copy(1, token_ids, logits).log_softmax(-1)

    g = features[0, :-1] @ tensors["fc.weight"].T + tensors["fc.bias"]
    h, want = reference(torch.tensor(prompt[1:]), g)
    finite = want[-1].isfinite()
    assert torch.allclose(got[finite], want[-1][finite], atol=1e-4)
    got_next = draft.score(torch.tensor([[30]])).log_softmax(-1)[0, 0]
    _, want_next = reference(torch.tensor(prompt[1:] + [30]), torch.cat([g, h[-1:]]))
    assert torch.allclose(got_next[finite], want_next[-1][finite], atol=1e-4)
    with pytest.raises(ValueError, match="no form in the repository's layout"):
        save_eagle3(draft.head, tmp_path / "out")


def test_a_speculators_eagle3_1_head_norms_each_feature_and_drafts_from_its_normed_output(tmp_path):
    """speculators' ``fc_norm`` (an RMS norm per feature read, before ``fc``) and ``norm_output`` (EAGLE 3.1: the output
    is norm(h), which the logits read without a second norm and the next drafted slot reads): the definition at the
    prompt and at two drafted slots; read with ``norm_output`` off (what a loader that drops the key computes), the
    drafted slots differ and the prompt's does not."""
    target = _target()
    tensors, token_ids = _speculators_checkpoint(tmp_path / "head", fc_norm=True, norm_output=True)
    draft = draft_from_name(str(tmp_path / "head"), target)
    prompt = [5, 9, 3, 17, 22, 8, 41]
    ids = torch.tensor([prompt])
    _, features = target.prefill(ids, torch.ones_like(ids), hidden_layers=draft.feature_layers)
    before = torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], 1)
    draft.observe(before)
    got = [draft.prefill(ids, torch.ones_like(ids)).log_softmax(-1)[0]]
    got += [draft.score(torch.tensor([[y]])).log_softmax(-1)[0, 0] for y in (30, 12)]
    embedding = target.model.get_input_embeddings().weight.detach()
    read = torch.cat([_rms(part, tensors[f"fc_norm.{i}.weight"]) for i, part in enumerate(features[0, :-1].chunk(3, -1))], -1)
    inputs, tokens, want = read @ tensors["fc.weight"].T + tensors["fc.bias"], prompt[1:], []
    for y in (None, 30, 12):
        tokens = tokens + ([y] if y is not None else [])
        h, _ = _reference(tensors, torch.tensor(tokens), inputs, embedding, token_ids, norm_before_residual=True)
        out = _rms(h, tensors["norm.weight"])  # the output is normed once; logits and the next slot read it
        logits = torch.full((len(tokens), VOCAB), float("-inf")).index_copy(1, token_ids, out @ tensors["lm_head.weight"].T)
        want.append(logits.log_softmax(-1)[-1])
        inputs = torch.cat([inputs, out[-1:]])
    finite = want[0].isfinite()
    for a, b in zip(got, want):
        assert torch.allclose(a[finite], b[finite], atol=1e-4)
    _speculators_checkpoint(tmp_path / "dropped", fc_norm=True, norm_output=False)
    off = draft_from_name(str(tmp_path / "dropped"), target)
    off.observe(before)
    assert torch.allclose(off.prefill(ids, torch.ones_like(ids)).log_softmax(-1)[0][finite], want[0][finite], atol=1e-4)
    assert not torch.allclose(off.score(torch.tensor([[30]])).log_softmax(-1)[0, 0][finite], want[1][finite], atol=1e-2)
    save_eagle3(draft.head, tmp_path / "saved")  # saved again: the options and fc_norm's tensors travel
    again = draft_from_name(str(tmp_path / "saved"), target)
    again.observe(before)
    assert torch.equal(again.prefill(ids, torch.ones_like(ids)).log_softmax(-1)[0], got[0])


def test_speculators_heads_this_loader_does_not_build_are_refused_and_llama3_rope_is_applied(tmp_path):
    target = _target()
    for name, layer in (("mistral", {"model_type": "mistral"}), ("two", {"model_type": "qwen3", "num_hidden_layers": 2})):
        _speculators_checkpoint(tmp_path / name, layer=layer)
        with pytest.raises(ValueError, match="this loader builds llama layers or one qwen3 layer"):
            draft_from_name(str(tmp_path / name), target)
    refused = {  # a key this loader does not read, and layers it does not build: one line each, never dropped
        "new_option": (dict(extra={"norm_every_layer": True}), r"keys \['norm_every_layer'\] are not read"),
        "sliding": (dict(layer={"layer_types": ["sliding_attention"], "sliding_window": 4}), "sliding-window"),
        "partial": (dict(layer={"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                    "partial_rotary_factor": 0.5}}), "partial rotary"),
        "gelu": (dict(layer={"hidden_act": "gelu"}), "activation 'gelu'"),
        "both_norms": (dict(fc_norm=True, norm_before_fc=True), "both fc_norm and norm_before_fc"),
        "no_residual_key": (dict(norm_before_residual=None), "without norm_before_residual: speculators 0.9.0 reads "
                                                             "it as False, vLLM 0.34 as True"),
    }
    for name, (options, message) in refused.items():
        _speculators_checkpoint(tmp_path / name, **options)
        with pytest.raises(ValueError, match=message):
            draft_from_name(str(tmp_path / name), target)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    _speculators_checkpoint(tmp_path / "llama3", layer={"rope_scaling": scaling})
    _speculators_checkpoint(tmp_path / "plain")
    positions = torch.arange(40)[None]
    scaled, plain = (draft_from_name(str(tmp_path / n), target).head.rope(positions)[0] for n in ("llama3", "plain"))
    assert not torch.allclose(scaled, plain)  # the layer's RoPE is transformers' Llama one, scaling included


def test_eagle3_runs_chains_and_trees_exactly_and_losslessly(tmp_path):
    target = _target()
    _checkpoint(tmp_path / "head")
    draft = draft_from_name(str(tmp_path / "head"), target)
    assert isinstance(draft, EagleDraft) and draft_format(tmp_path / "head") == EAGLE3_FORMAT
    _exact_and_lossless(target, draft, chain_gamma=3, tree_gamma=2, k=2, seed=3)


def test_eagle3_saved_again_loads_to_the_same_logits(tmp_path):
    target = _target()
    _checkpoint(tmp_path / "head")
    first = load_eagle3(target, tmp_path / "head", device="cpu")
    save_eagle3(first.head, tmp_path / "again", safetensors=False)
    second = load_eagle3(target, tmp_path / "again")
    features = torch.randn(1, 4, first.feature_size)
    ids = torch.tensor([[3, 4, 5, 6]])
    outs = []
    for draft in (first, second):
        draft.observe(features)
        outs.append(draft.prefill(ids, torch.ones_like(ids)))
    assert torch.equal(outs[0], outs[1])


def test_a_wrong_tensor_is_refused_by_name(tmp_path):
    target = _target()
    _checkpoint(tmp_path / "renamed", rename=("fc.weight", "fc1.weight"))
    with pytest.raises(ValueError, match=r"missing \['fc.weight'\], unknown \['fc1.weight'\]"):
        load_eagle3(target, tmp_path / "renamed")
    _checkpoint(tmp_path / "reshaped", reshape="midlayer.self_attn.q_proj.weight")
    with pytest.raises(ValueError, match=r"tensor midlayer.self_attn.q_proj.weight has shape \(32, 63\), expected "
                                         r"\(32, 64\)"):
        load_eagle3(target, tmp_path / "reshaped")


def test_an_unknown_directory_layout_is_named_in_one_line(tmp_path):
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "weights.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="holds no draft layout this toolkit reads: expected") as caught:
        draft_format(tmp_path / "odd")
    assert "\n" not in str(caught.value) and "EAGLE-3" in str(caught.value)


def test_a_transformers_assistant_directory_is_recognised(tmp_path):
    target = _target()
    target.model.save_pretrained(tmp_path / "assistant")
    assert draft_format(tmp_path / "assistant") == "transformers causal LM"
    draft = draft_from_name(str(tmp_path / "assistant"), target)
    prompts = [[5, 9, 3]]
    greedy = SamplingConfig(temperature=0.0)
    assert (speculative_generate(target, draft, prompts, max_new_tokens=6, sampling=greedy, gamma=3).tokens
            == autoregressive_generate(target, prompts, max_new_tokens=6, sampling=greedy).tokens)


EAGLE1_LAYERS = 2


def _eagle1_checkpoint(directory, *, seed=0, drop=None):
    """A random EAGLE-1/2 head (two layers, fc with a bias) in the repository's layout; returns its tensors."""
    g = torch.Generator().manual_seed(seed)
    d = H // HEADS
    shapes = {"fc.weight": (H, 2 * H)}
    for i in range(EAGLE1_LAYERS):
        at = f"layers.{i}."
        shapes |= {at + "self_attn.q_proj.weight": (HEADS * d, H), at + "self_attn.k_proj.weight": (KV * d, H),
                   at + "self_attn.v_proj.weight": (KV * d, H), at + "self_attn.o_proj.weight": (H, HEADS * d),
                   at + "mlp.gate_proj.weight": (INTER, H), at + "mlp.up_proj.weight": (INTER, H),
                   at + "mlp.down_proj.weight": (H, INTER)}
    tensors = {name: torch.randn(shape, generator=g) / math.sqrt(shape[-1]) for name, shape in shapes.items()}
    tensors["fc.bias"] = 0.1 * torch.randn(H, generator=g)
    for i in range(EAGLE1_LAYERS):
        tensors[f"layers.{i}.post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
        if i:
            tensors[f"layers.{i}.input_layernorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    if drop:
        tensors.pop(drop)
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": H, "intermediate_size": INTER,
              "num_attention_heads": HEADS, "num_key_value_heads": KV, "num_hidden_layers": EAGLE1_LAYERS,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": VOCAB, "bias": True}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    torch.save(tensors, directory / "pytorch_model.bin")
    return tensors


def _eagle1_reference(t, tokens, inputs, embedding, head):
    """EAGLE-1's step from the format's definition, uncached: -> outputs [n, H], log-probabilities [n, V]."""
    x = torch.cat([embedding[tokens], inputs], -1) @ t["fc.weight"].T + t["fc.bias"]
    for i in range(EAGLE1_LAYERS):
        at = f"layers.{i}."
        x = x + _attention(_rms(x, t[at + "input_layernorm.weight"]) if i else x, t, at, len(tokens))
        x = x + _mlp(x, t, at)
    return x, (x @ head.T).log_softmax(-1)


def test_eagle1_logits_follow_the_formats_definition_and_run_in_the_engine(tmp_path):
    target = _target()
    tensors = _eagle1_checkpoint(tmp_path / "head")
    assert draft_format(tmp_path / "head") == EAGLE1_FORMAT
    draft = draft_from_name(str(tmp_path / "head"), target)
    assert isinstance(draft, EagleDraft) and draft.format == "EAGLE-1/2" and draft.feature_layers == (LAYERS,)
    prompt = [5, 9, 3, 17, 22, 8, 41]
    ids = torch.tensor([prompt])
    _, features = target.prefill(ids, torch.ones_like(ids), hidden_layers=draft.feature_layers)  # post-norm last
    draft.observe(torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], 1))
    got = draft.prefill(ids, torch.ones_like(ids)).log_softmax(-1)[0]
    embedding = target.model.get_input_embeddings().weight.detach()
    head = target.model.get_output_embeddings().weight.detach()
    out, want = _eagle1_reference(tensors, torch.tensor(prompt[1:]), features[0, :-1], embedding, head)
    assert torch.allclose(got, want[-1], atol=1e-4)
    got_next = draft.score(torch.tensor([[30]])).log_softmax(-1)[0, 0]
    _, want_next = _eagle1_reference(tensors, torch.tensor(prompt[1:] + [30]), torch.cat([features[0, :-1], out[-1:]]),
                                     embedding, head)
    assert torch.allclose(got_next, want_next[-1], atol=1e-4)
    prompts, greedy = [[5, 9, 3], [7, 2, 11, 4, 8, 6, 12]], SamplingConfig(temperature=0.0)
    want_tokens = autoregressive_generate(target, prompts, max_new_tokens=8, sampling=greedy).tokens
    for options in (dict(verifier="block", gamma=3), dict(verifier="onehot", num_drafts=2, gamma=2, draft_law="dynamic")):
        assert speculative_generate(target, draft, prompts, max_new_tokens=8, sampling=greedy, **options).tokens == want_tokens


def test_an_eagle1_head_missing_a_layer_norm_is_refused_by_name(tmp_path):
    _eagle1_checkpoint(tmp_path / "head", drop="layers.1.input_layernorm.weight")
    with pytest.raises(ValueError, match=r"not the EAGLE-1/2 layout: missing \['layers.1.input_layernorm.weight'\]"):
        draft_from_name(str(tmp_path / "head"), _target())


MEDUSA_HEADS, MEDUSA_LAYERS = 3, 2


def _medusa_checkpoint(directory, *, seed=0, safetensors=False, break_repeat=False):
    """Random Medusa heads in the repository's layout (one ResBlock repeated MEDUSA_LAYERS times per head)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for k in range(MEDUSA_HEADS):
        weight, bias = torch.randn(H, H, generator=g) / math.sqrt(H), 0.1 * torch.randn(H, generator=g)
        for j in range(MEDUSA_LAYERS):
            tensors[f"{k}.{j}.linear.weight"], tensors[f"{k}.{j}.linear.bias"] = weight.clone(), bias.clone()
        tensors[f"{k}.{MEDUSA_LAYERS}.weight"] = torch.randn(VOCAB, H, generator=g) / math.sqrt(H)
    if break_repeat:
        tensors["1.1.linear.bias"] += 1
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"medusa_num_heads": MEDUSA_HEADS, "medusa_num_layers": MEDUSA_LAYERS,
                                                       "base_model_name_or_path": "tiny-llama"}))
    if safetensors:
        from safetensors.torch import save_file

        save_file(tensors, directory / "medusa_lm_head.safetensors")
    else:
        torch.save(tensors, directory / "medusa_lm_head.pt")
    return tensors


def _medusa_reference(t, k, hidden):
    """Head k from the format's definition: the head's ResBlock MEDUSA_LAYERS times, then its output layer."""
    x = hidden
    for j in range(MEDUSA_LAYERS):
        x = x + torch.nn.functional.silu(x @ t[f"{k}.{j}.linear.weight"].T + t[f"{k}.{j}.linear.bias"])
    return (x @ t[f"{k}.{MEDUSA_LAYERS}.weight"].T).log_softmax(-1)


@pytest.mark.parametrize("safetensors", [False, True])
def test_medusa_heads_follow_the_formats_definition(tmp_path, safetensors):
    from specresearch.drafts.medusa import MedusaDraft

    target = _target()
    tensors = _medusa_checkpoint(tmp_path / "medusa", safetensors=safetensors)
    assert draft_format(tmp_path / "medusa").startswith("Medusa heads")
    draft = draft_from_name(str(tmp_path / "medusa"), target)
    assert isinstance(draft, MedusaDraft) and draft.feature_layers == (LAYERS,) and draft.plan_length(8) == MEDUSA_HEADS
    prompt = [5, 9, 3, 17, 22, 8, 41]
    ids = torch.tensor([prompt])
    _, features = target.prefill(ids, torch.ones_like(ids), hidden_layers=draft.feature_layers)  # [1, 7, H]
    draft.observe(torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], 1))
    got = draft.prefill(ids, torch.ones_like(ids)).log_softmax(-1)[0]
    # the slot of x_6 reads the feature of slot 5: head 0 guesses x_7 (the target's own head gives x_6 there)
    assert torch.allclose(got, _medusa_reference(tensors, 0, features[0, -2]), atol=1e-5)
    for depth in (1, 2):  # drafted slots: head `depth` on the same feature
        got = draft.score(torch.tensor([[30 + depth]])).log_softmax(-1)[0, 0]
        assert torch.allclose(got, _medusa_reference(tensors, depth, features[0, -2]), atol=1e-5)
    with pytest.raises(ValueError, match="Medusa has 3 heads: it drafts at most 3 tokens"):
        draft.score(torch.tensor([[40]]))


def test_medusa_runs_chains_and_trees_exactly_and_losslessly(tmp_path):
    target = _target()
    _medusa_checkpoint(tmp_path / "medusa")
    draft = draft_from_name(str(tmp_path / "medusa"), target)
    _exact_and_lossless(target, draft, chain_gamma=5, tree_gamma=3, k=3, seed=4)  # gamma 5 > 3 heads: planned to 3


def test_medusa_heads_that_do_not_repeat_their_block_are_refused(tmp_path):
    _medusa_checkpoint(tmp_path / "medusa", break_repeat=True)
    with pytest.raises(ValueError, match=r"tensor 1.1.linear.bias differs from 1.0.linear.bias: Medusa repeats one"):
        draft_from_name(str(tmp_path / "medusa"), _target())


def test_the_toolkit_trains_an_eagle3_head_and_saves_it_in_the_repositorys_layout(tmp_path, monkeypatch):
    """``feature-distill`` with ``architecture="eagle3"``: corpus -> training (the loss falls) -> the toolkit's manifest;
    ``save_eagle3`` writes it in the EAGLE layout, and ``load_eagle3`` reads back a draft with the same logits."""
    from helpers import ToyChatTokenizer

    import specresearch.training.feature_distill as fd
    from specresearch.drafts.eagle import Eagle3Head
    from specresearch.drafts.feature import FeatureHeadConfig, load_feature_draft, load_feature_head
    from specresearch.training.feature_corpus import FeatureCorpusConfig

    monkeypatch.setenv("SPECRESEARCH_CACHE", str(tmp_path / "cache"))
    target = tiny_llama(32, seed=4, init_std=0.8, num_layers=2)
    g = torch.Generator().manual_seed(5)
    for name, count in (("corpus.jsonl", 8), ("heldout.jsonl", 2)):
        rows = [{"id": f"{name}-{i}", "category": "c",
                 "turns": ["".join(chr(97 + int(c)) for c in torch.randint(0, 26, (5,), generator=g))]}
                for i in range(count)]
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = FeatureHeadConfig("e3", feature_layers=(0, 1, 2), init_layer=None, head_tokens=16, train_head=True,
                               architecture="eagle3")
    manifest = fd.run_feature_distillation(
        target, ToyChatTokenizer(), config,
        fd.FeatureTrainConfig(steps=20, batch_size=4, lr=3e-3, warmup_steps=2, rollout=2, feature_loss_weight=0.0),
        FeatureCorpusConfig(store_layers=(0, 1, -1), chunk_prompts=4, max_new_tokens=8, batch_size=4, teacher_top_k=8),
        prompts_path=tmp_path / "corpus.jsonl", heldout_path=tmp_path / "heldout.jsonl", chunks=2,
        out_dir=tmp_path / "trained", heldout_prompts=2, measure_tokens=6, depths=2, progress=False)
    curve = manifest["training"]["loss_curve"]
    assert manifest["finished"] and sum(curve[-5:]) < sum(curve[:5])
    head = load_feature_head(target.model, tmp_path / "trained")
    assert isinstance(head, Eagle3Head) and head.feature_layers == (0, 1, 2)
    save_eagle3(head, tmp_path / "exported")
    ours, theirs = load_feature_draft(target, tmp_path / "trained"), load_eagle3(target, tmp_path / "exported")
    assert isinstance(ours, EagleDraft)
    features, ids = torch.randn(1, 5, ours.feature_size), torch.tensor([[3, 4, 5, 6, 7]])
    outs = []
    for draft in (ours, theirs):
        draft.observe(features)
        outs.append(torch.cat([draft.prefill(ids, torch.ones_like(ids))[:, None], draft.score(torch.tensor([[9]]))], 1))
    assert torch.allclose(outs[0], outs[1], atol=1e-5)


def test_published_drafts_refuse_a_prompt_that_is_not_left_padded(tmp_path):
    target = _target()
    _checkpoint(tmp_path / "eagle3")
    _medusa_checkpoint(tmp_path / "medusa")
    ids, right_padded = torch.tensor([[3, 4, 0]]), torch.tensor([[1, 1, 0]])
    for name in ("eagle3", "medusa"):
        draft = draft_from_name(str(tmp_path / name), target)
        draft.observe(torch.zeros(1, 3, draft.feature_size))
        with pytest.raises(ValueError, match="attention_mask must be left-padded"):
            draft.prefill(ids, right_padded)


@pytest.mark.parametrize("family", ["qwen3_5_text", "mamba", "falcon_h1"])
def test_an_eagle3_head_drafts_for_a_recurrent_target_in_both_loops(tmp_path, family):
    _checkpoint(tmp_path / "head")
    target = CausalLM(tiny_recurrent_model(family))
    draft = load_eagle3(target, tmp_path / "head")
    prompts = [[5, 9, 3, 17, 22, 8], [7, 2, 11]]
    want = autoregressive_generate(target, prompts, max_new_tokens=12, sampling=SamplingConfig(temperature=0.0)).tokens
    for compile in ("off", "static"):
        assert speculative_generate(target, draft, prompts, max_new_tokens=12, sampling=SamplingConfig(temperature=0.0),
                                    gamma=3, compile=compile).tokens == want, compile
