"""MTP layers in a target's own checkpoint, as a draft (``drafts.mtp``).

* Random-weight checkpoints in four published layouts (DeepSeek-V3's ``model.layers.61.*``, GLM-4.5's
  ``model.layers.46.*``, ERNIE 4.5's ``mtp_*.0``, Mellum's ``mtp.*`` with a sliding-window layer) load through
  ``--draft mtp``'s path, and the draft's logits equal transformers' own ``MtpModel`` (the code behind
  ``generate(use_mtp=True)``) at every prompt slot and at a drafted slot reading the layer's own output.
* The draft runs greedy chains, sampled trees and dynamic trees, on dynamic and static caches, giving the target's
  greedy tokens, and is lossless at T = 1.
* A target without MTP layers, or one not loaded from a directory, and a checkpoint missing the layer are refused.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specresearch.config import SamplingConfig
from specresearch.drafts.mtp import MtpDraft, load_mtp
from specresearch.drafts.registry import draft_from_name
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.experiments.stats import lossless_test
from specresearch.models.causal_lm import CausalLM
from specresearch.models.families import tiny_family_config

H = 32
_SIZES = dict(vocab_size=64, hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, bos_token_id=0, eos_token_id=1, pad_token_id=1, initializer_range=0.5)
_EXPERTS = dict(moe_intermediate_size=16, num_experts_per_tok=2)
# layout -> (config class, settings, the model's layers: the MTP layer is the checkpoint's layer of that index)
LAYOUTS = {
    "deepseek-v3": (None, {}, 61),
    "glm4-moe": ("Glm4MoeConfig", dict(head_dim=8, n_routed_experts=4, n_group=1, topk_group=1,
                                       first_k_dense_replace=1, **_EXPERTS), 46),
    "ernie4.5-moe": ("Ernie4_5_MoeConfig", dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=16,
                                                 moe_layer_start_index=0), 2),
    "mellum": ("MellumConfig", dict(head_dim=8, num_experts=4, sliding_window=4, **_EXPERTS), 2),
}


def _config(layout: str, layers: int):
    import transformers

    name, settings, _ = LAYOUTS[layout]
    if name is None:
        return tiny_family_config("deepseek-v3", num_hidden_layers=layers, initializer_range=0.5)
    if layout == "mellum":  # windowed and global layers, as Mellum ships (the rotary embedding serves both kinds)
        settings = {**settings, "layer_types": (["sliding_attention", "full_attention"] * layers)[:layers]}
    return getattr(transformers, name)(**{**_SIZES, **settings, "num_hidden_layers": layers})


def write_mtp_checkpoint(directory, layout: str, *, seed: int = 0) -> None:
    """A random-weight checkpoint of ``layout`` with one MTP layer: a model of L + 1 layers saved by transformers,
    its last layer's tensors moved under the layout's MTP names beside random ``enorm``, ``hnorm``, ``eh_proj`` and
    post-norm tensors, and the config set to L layers and one MTP layer."""
    from transformers import AutoModelForCausalLM

    L = LAYOUTS[layout][2]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(layout, L + 1), dtype=torch.float32)
    model.save_pretrained(directory)
    tensors = load_file(directory / "model.safetensors")
    block = {k[len(f"model.layers.{L}."):]: tensors.pop(k) for k in list(tensors) if k.startswith(f"model.layers.{L}.")}
    g = torch.Generator().manual_seed(seed + 1)
    norm = lambda: 1 + 0.2 * torch.randn(H, generator=g)  # noqa: E731
    proj = 0.3 * torch.randn(H, 2 * H, generator=g)
    if layout in ("deepseek-v3", "glm4-moe"):
        prefix = f"model.layers.{L}."
        extras = {"enorm.weight": norm(), "hnorm.weight": norm(), "eh_proj.weight": proj,
                  "shared_head.norm.weight": norm(), "shared_head.head.weight": tensors["lm_head.weight"].clone(),
                  "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()}
        tensors.update({prefix + k: v for k, v in {**block, **extras}.items()})
    elif layout == "ernie4.5-moe":  # its post-norm is the model's final norm
        tensors.update({f"mtp_block.0.{k}": v for k, v in block.items()})
        tensors.update({"mtp_emb_norm.0.weight": norm(), "mtp_hidden_norm.0.weight": norm(),
                        "mtp_linear_proj.0.weight": proj})
    else:
        tensors.update({f"mtp.layers.0.{k}": v for k, v in block.items()})
        tensors.update({"mtp.pre_fc_norm_embedding.weight": norm(), "mtp.pre_fc_norm_hidden.weight": norm(),
                        "mtp.fc.weight": proj, "mtp.norm.weight": norm()})
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config.update(num_hidden_layers=L, num_nextn_predict_layers=1)
    for key in ("layer_types", "mlp_layer_types"):
        if key in config:
            config[key] = config[key][:L]
    (directory / "config.json").write_text(json.dumps(config))


def _target(directory) -> CausalLM:
    return CausalLM(str(directory), device="cpu", dtype=torch.float32)


def _theirs(target, ids, draft):
    """transformers' MtpModel over the prompt ``ids [1, L]`` and one drafted token after it: logits ``[L, V]``."""
    from transformers.cache_utils import MtpCache
    from transformers.modeling_layers import MtpModel

    model = target.model
    mtp = MtpModel.from_pretrained(model, device_map={"": "cpu"})
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states[-1]
        cache = MtpCache(config=model.config.get_mtp_config())
        L = ids.shape[1]
        h = mtp.forward_layer(0, states[:, :-1], torch.arange(1, L)[None], cache, input_ids=ids[:, 1:])
        nxt = torch.tensor([[30]])
        h_next = mtp.forward_layer(0, h[:, -1:], torch.tensor([[L]]), cache, input_ids=nxt)
        return mtp._project_to_logits(torch.cat([h, h_next], 1))[0], states


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mtp_logits_equal_transformers_own_mtp_model(tmp_path, layout):
    write_mtp_checkpoint(tmp_path / "m", layout)
    target = _target(tmp_path / "m")
    draft = draft_from_name("mtp", target)
    assert isinstance(draft, MtpDraft) and draft.feature_layers == (LAYOUTS[layout][2],)
    assert draft.head.window == (4 if layout == "mellum" else None)
    ids = torch.tensor([[5, 9, 3, 17, 22, 8, 41]])  # longer than Mellum's window
    want, states = _theirs(target, ids, draft)
    _, features = target.prefill(ids, torch.ones_like(ids), hidden_layers=draft.feature_layers)
    assert torch.allclose(features, states, atol=1e-5)  # the state the layer reads: the last, after the final norm
    draft.observe(torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], 1))
    got = draft.prefill(ids, torch.ones_like(ids))
    got_next = draft.score(torch.tensor([[30]]))[:, 0]
    assert torch.allclose(got[0], want[-2], atol=1e-4) and torch.allclose(got_next[0], want[-1], atol=1e-4)


@pytest.mark.parametrize("layout", ["deepseek-v3", "mellum"])
def test_mtp_drafts_chains_and_trees_exactly_and_losslessly(tmp_path, layout):
    """Greedy chains, sampled trees and dynamic trees (dynamic caches, and a static-cache chain) give the target's
    greedy tokens for three left-padded prompts; at T = 1, 6,000 samples of the first three tokens pass the exact
    Bonferroni test, whose false-positive rate is <= 1e-6."""
    write_mtp_checkpoint(tmp_path / "m", layout)
    target = _target(tmp_path / "m")
    draft = draft_from_name("mtp", target)
    prompts, greedy = [[5, 9, 3], [7, 2, 11, 4, 8, 6, 12], [20, 21]], SamplingConfig(temperature=0.0)
    want = autoregressive_generate(target, prompts, max_new_tokens=10, sampling=greedy).tokens
    for options in (dict(verifier="block", gamma=3), dict(verifier="traversal", num_drafts=2, gamma=2),
                    dict(verifier="onehot", num_drafts=2, gamma=2, draft_law="dynamic"),
                    dict(verifier="block", gamma=3, compile="static"),
                    dict(verifier="onehot", num_drafts=2, gamma=2, draft_law="dynamic", compile="static")):
        assert speculative_generate(target, draft, prompts, max_new_tokens=10, sampling=greedy, **options).tokens == want
    result = lossless_test(target, draft, "block", [5, 9, 3, 17], sampling=SamplingConfig(), gamma=3, k=3,
                           max_new_tokens=4, num_samples=6_000, seed=11, batch_size=3_000)
    assert result.impossible == 0 and result.bonferroni_p_value > 1e-6, result.p_value


def test_mtp_is_refused_in_one_line_without_layers_directory_or_tensors(tmp_path):
    from specresearch.models.toy import tiny_llama

    with pytest.raises(ValueError, match="has no MTP layers"):
        load_mtp(tiny_llama())
    write_mtp_checkpoint(tmp_path / "m", "mellum")
    target = _target(tmp_path / "m")
    with pytest.raises(ValueError, match="checkpoint directory"):
        load_mtp(target, tmp_path / "nowhere")
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "mtp.fc.weight"}, tmp_path / "m" / "model.safetensors")
    with pytest.raises(RuntimeError, match="eh_proj"):
        load_mtp(_target(tmp_path / "m"))
