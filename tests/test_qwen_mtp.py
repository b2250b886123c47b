"""Qwen3.5's and Qwen3-Next's MTP layer in the model's own checkpoint (``mtp.*``), as a draft (``drafts.qwen_mtp``).

* Random-weight checkpoints (``models.families.tiny_qwen_mtp_checkpoint``: a dense Qwen3.5, a Qwen3-Next with
  experts saved one per tensor) load through ``--draft mtp``'s path; the dense draft's logits equal the layout's
  definition written out uncached (``fc`` over the normed embedding and the target's last state, the model's own
  decoder layer, ``mtp.norm``, the target's head; a drafted slot reading the layer's normed output) at the prompt's
  last slot and at two drafted slots.
* Both targets (recurrent: chains) give their greedy tokens with the draft, in the growing loop and in captured steps
  (``compile="static"``: the target's static recurrent states, ``models.static_states``; the draft's static form, its
  captured step one graph, compiled = eager); at T = 1 the dense pair keeps the target's law (exact Bonferroni test,
  false-positive rate <= 1e-6).
* Refused in one line: a checkpoint missing an ``mtp.*`` tensor (named), one of another shape, a config announcing no
  MTP layer.

speculators' own MTP layer (its converter's names and expert fusion) against this loader:
``benchmarks/speculators_heads.py``.
"""

import copy
import json

import pytest
import torch
from helpers import check_captured_step
from safetensors.torch import load_file, save_file

from specresearch.config import SamplingConfig
from specresearch.drafts.mtp import MtpDraft
from specresearch.drafts.qwen_mtp import layer_state
from specresearch.drafts.registry import draft_from_name
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.experiments.stats import lossless_test
from specresearch.models.causal_lm import CausalLM
from specresearch.models.families import tiny_qwen_mtp_checkpoint

GREEDY = SamplingConfig(temperature=0.0)


def _rms(x, weight, eps):
    """Qwen3.5's RMS norm: scaled by ``1 + weight``."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight)


def _definition(model, t, prompt, drafted):
    """Log-probabilities at the prompt's last slot and after each of ``drafted`` by the layout's definition, uncached:
    slot j >= 1 holds token j and reads the target's last state of slot j - 1 (a drafted slot: the output before it)."""
    config = copy.copy(model.config)
    config._attn_implementation = "sdpa"
    block = type(model.model.layers[3])(config, 3).eval()
    block.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in t.items() if k.startswith("mtp.layers.0.")})
    eps, table = config.rms_norm_eps, model.get_input_embeddings().weight
    with torch.no_grad():
        states = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
        tokens, reads, out = list(prompt[1:]), list(states[:-1]), []
        for step in range(len(drafted) + 1):
            n = len(tokens)
            x = torch.cat([_rms(table[tokens], t["mtp.pre_fc_norm_embedding.weight"], eps),
                           _rms(torch.stack(reads), t["mtp.pre_fc_norm_hidden.weight"], eps)], -1) @ t["mtp.fc.weight"].T
            positions = torch.arange(1, n + 1)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            h = block(x[None], position_embeddings=model.model.rotary_emb(x[None], positions), attention_mask=mask,
                      position_ids=positions)
            h = _rms(h[0] if isinstance(h, tuple) else h, t["mtp.norm.weight"], eps)[0]
            out.append(model.lm_head(h[-1]).log_softmax(-1))
            if step < len(drafted):
                tokens.append(drafted[step])
                reads.append(h[-1])
    return torch.stack(out)


def test_the_dense_draft_follows_the_layouts_definition(tmp_path):
    tensors = tiny_qwen_mtp_checkpoint(tmp_path / "m", "qwen3_5_text")
    target = CausalLM(str(tmp_path / "m"), device="cpu", dtype=torch.float32)
    draft = draft_from_name("mtp", target)
    assert isinstance(draft, MtpDraft) and draft.head.format == "Qwen MTP" and draft.feature_layers == (4,)
    prompt, drafted = [5, 9, 3, 17, 22, 8], [30, 31]
    want = _definition(target.model, tensors, prompt, drafted)
    ids = torch.tensor([prompt])
    _, features = target.prefill(ids, torch.ones_like(ids), hidden_layers=draft.feature_layers)
    draft.observe(torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], 1))
    got = [draft.prefill(ids, torch.ones_like(ids))[0]] + [draft.score(torch.tensor([[d]]))[0, 0] for d in drafted]
    assert torch.allclose(torch.stack(got).log_softmax(-1), want, atol=1e-4)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_the_draft_decodes_its_targets_greedy_tokens_and_keeps_the_law(tmp_path, model_type):
    tiny_qwen_mtp_checkpoint(tmp_path / "m", model_type)
    target = CausalLM(str(tmp_path / "m"), device="cpu", dtype=torch.float32)
    draft = draft_from_name("mtp", target)
    prompts = [[5, 9, 3], [7, 2, 11, 4, 8, 6, 12]]
    want = autoregressive_generate(target, prompts, max_new_tokens=10, sampling=GREEDY).tokens
    for gamma in (1, 3):
        for compile in ("off", "static"):  # the growing loop, and captured steps (models.static_states) run eagerly
            assert speculative_generate(target, draft, prompts, max_new_tokens=10, sampling=GREEDY, gamma=gamma,
                                        compile=compile).tokens == want, (gamma, compile)
    if model_type == "qwen3_5_text":
        check_captured_step(target, draft, prompts, dict(gamma=3))
        result = lossless_test(target, draft, "block", [5, 9, 3, 17], sampling=SamplingConfig(), gamma=3, k=3,
                               max_new_tokens=4, num_samples=4_000, seed=3, batch_size=2_000)
        assert result.impossible == 0 and result.bonferroni_p_value > 1e-6, result.p_value


def test_experts_saved_one_per_tensor_are_fused_as_transformers_fuses_them(tmp_path):
    """The target's own layer 3, saved by transformers one expert per tensor, read as an MTP layer's tensors, gives
    the parameters transformers' loader built for that layer (its conversion mapping fuses gate and up)."""
    tiny_qwen_mtp_checkpoint(tmp_path / "m", "qwen3_next")
    saved = load_file(tmp_path / "m" / "model.safetensors")
    as_mtp = {"mtp.layers.0." + k[len("model.layers.3."):]: v for k, v in saved.items() if k.startswith("model.layers.3.")}
    assert any(".experts.0.gate_proj" in k for k in as_mtp)
    loaded = CausalLM(str(tmp_path / "m"), device="cpu", dtype=torch.float32).model.model.layers[3].state_dict()
    ours = layer_state(as_mtp, 0)
    assert set(ours) == set(loaded) and all(torch.equal(ours[k], loaded[k]) for k in loaded)


def test_checkpoints_and_configs_it_cannot_read_are_refused_in_one_line(tmp_path):
    for name, change, message in (("missing", lambda t: t.pop("mtp.norm.weight"), r"missing \['norm.weight'\]"),
                                  ("shape", lambda t: t.update({"mtp.fc.weight": t["mtp.fc.weight"][:, :-1].contiguous()}),
                                   r"fc.weight has shape \(32, 63\)")):
        tiny_qwen_mtp_checkpoint(tmp_path / name, "qwen3_5_text")
        tensors = load_file(tmp_path / name / "model.safetensors")
        change(tensors)
        save_file(tensors, tmp_path / name / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError, match=message):
            draft_from_name("mtp", CausalLM(str(tmp_path / name), device="cpu", dtype=torch.float32))
    tiny_qwen_mtp_checkpoint(tmp_path / "none", "qwen3_5_text")
    config = json.loads((tmp_path / "none" / "config.json").read_text())
    (tmp_path / "none" / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 0}))
    with pytest.raises(ValueError, match="mtp_num_hidden_layers"):
        draft_from_name("mtp", CausalLM(str(tmp_path / "none"), device="cpu", dtype=torch.float32))
