"""MTP layers in a target's own checkpoint, as a draft (``drafts.mtp``).

* Random-weight checkpoints in four published layouts (DeepSeek-V3's ``model.layers.61.*``, GLM-4.5's
  ``model.layers.46.*``, ERNIE 4.5's ``mtp_*.0``, Mellum's ``mtp.*`` with a sliding-window layer) load through
  ``--draft mtp``'s path, and the draft's logits equal transformers' own ``MtpModel`` (the code behind
  ``generate(use_mtp=True)``) at the prompt's last slot and at a drafted slot reading the layer's own output.
* The draft runs greedy chains, sampled trees and dynamic trees, on dynamic and static caches, giving the target's
  greedy tokens, and is lossless at T = 1.
* A target without MTP layers, or one not loaded from a directory, and a checkpoint missing the layer are refused.
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from specresearch.config import SamplingConfig
from specresearch.drafts.mtp import MtpDraft, load_mtp
from specresearch.drafts.registry import draft_from_name
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.experiments.stats import lossless_test
from specresearch.models.causal_lm import CausalLM
from specresearch.models.families import MTP_LAYOUTS, tiny_mtp_checkpoint


def _target(directory) -> CausalLM:
    return CausalLM(str(directory), device="cpu", dtype=torch.float32)


def _theirs(target, ids):
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


@pytest.mark.parametrize("layout", list(MTP_LAYOUTS))
def test_mtp_logits_equal_transformers_own_mtp_model(tmp_path, layout):
    tiny_mtp_checkpoint(tmp_path / "m", layout)
    target = _target(tmp_path / "m")
    draft = draft_from_name("mtp", target)
    assert isinstance(draft, MtpDraft) and draft.feature_layers == (MTP_LAYOUTS[layout][2],)
    assert draft.head.window == (4 if layout == "mellum" else None)
    ids = torch.tensor([[5, 9, 3, 17, 22, 8, 41]])  # longer than Mellum's window
    want, states = _theirs(target, ids)
    _, features = target.prefill(ids, torch.ones_like(ids), hidden_layers=draft.feature_layers)
    assert torch.allclose(features, states, atol=1e-5)  # the state the layer reads: the last, after the final norm
    draft.observe(torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], 1))
    got = draft.prefill(ids, torch.ones_like(ids))
    got_next = draft.score(torch.tensor([[30]]))[:, 0]
    assert torch.allclose(got[0], want[-2], atol=1e-4) and torch.allclose(got_next[0], want[-1], atol=1e-4)


@pytest.mark.parametrize("layout", ["deepseek-v3", "mellum"])
def test_mtp_drafts_chains_and_trees_exactly_and_losslessly(tmp_path, layout):
    """Greedy chains, sampled trees and dynamic trees (dynamic caches, and static-cache chains and trees; the layer's
    weights also in float16 and int8) give the target's greedy tokens for three left-padded prompts; at T = 1, 6,000
    samples of the first three tokens pass the exact Bonferroni test, whose false-positive rate is <= 1e-6."""
    tiny_mtp_checkpoint(tmp_path / "m", layout)
    target = _target(tmp_path / "m")
    draft = draft_from_name("mtp", target)
    prompts, greedy = [[5, 9, 3], [7, 2, 11, 4, 8, 6, 12], [20, 21]], SamplingConfig(temperature=0.0)
    want = autoregressive_generate(target, prompts, max_new_tokens=10, sampling=greedy).tokens
    for options in (dict(verifier="block", gamma=3), dict(verifier="traversal", num_drafts=2, gamma=2),
                    dict(verifier="onehot", num_drafts=2, gamma=2, draft_law="dynamic"),
                    dict(verifier="block", gamma=3, compile="static"),
                    dict(verifier="onehot", num_drafts=2, gamma=2, draft_law="dynamic", compile="static")):
        assert speculative_generate(target, draft, prompts, max_new_tokens=10, sampling=greedy, **options).tokens == want
    for stored in ("fp16:mtp", "int8:mtp"):  # the layer's weights stored in float16 / int8 (drafts.registry)
        half = draft_from_name(stored, target)
        assert speculative_generate(target, half, prompts, max_new_tokens=10, sampling=greedy, gamma=3).tokens == want
    result = lossless_test(target, draft, "block", [5, 9, 3, 17], sampling=SamplingConfig(), gamma=3, k=3,
                           max_new_tokens=4, num_samples=6_000, seed=11, batch_size=3_000)
    assert result.impossible == 0 and result.bonferroni_p_value > 1e-6, result.p_value


def test_mtp_is_refused_in_one_line_without_layers_directory_or_tensors(tmp_path):
    from specresearch.models.toy import tiny_llama

    with pytest.raises(ValueError, match="has no MTP layers"):
        load_mtp(tiny_llama())
    tiny_mtp_checkpoint(tmp_path / "m", "mellum")
    target = _target(tmp_path / "m")
    with pytest.raises(ValueError, match="no checkpoint directory"):
        load_mtp(target, tmp_path / "nowhere")
    config = copy.deepcopy(target.model.config)
    config.name_or_path = ""
    with pytest.raises(ValueError, match="no checkpoint directory"):  # a model built from its config has none
        load_mtp(CausalLM(AutoModelForCausalLM.from_config(config), device="cpu"))
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "mtp.fc.weight"}, tmp_path / "m" / "model.safetensors")
    with pytest.raises(RuntimeError, match="eh_proj"):
        load_mtp(_target(tmp_path / "m"))
