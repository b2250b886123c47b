"""Qwen3.5's and Qwen3-Next's multi-token-prediction layer, shipped in the model's own checkpoint (``mtp.*``), as a
draft: ``--draft mtp`` on such a target (``drafts.mtp.load_mtp`` hands it here).

transformers 5.25 skips these tensors on load (``_keys_to_ignore_on_load_unexpected = ["^mtp.*"]``) and has no MTP
model for these families; vLLM and SGLang draft with them. The facts are read from vLLM 0.34's
``model_executor/models/qwen3_5_mtp.py`` (``Qwen3_5MultiTokenPredictor``) and speculators 0.9.0's MTP converter and
layer (``convert/mtp/converter.py``, ``models/mtp/model_definitions.py``), our code, their facts:

* layout: the config's ``mtp_num_hidden_layers`` (vLLM's default 1) and, in the checkpoint beside the model's
  tensors, ``mtp.fc.weight [H, 2H]`` (no bias), ``mtp.pre_fc_norm_embedding.weight``, ``mtp.pre_fc_norm_hidden.weight``,
  ``mtp.norm.weight`` ``[H]`` (the model's own RMS norm, which scales by ``1 + weight``) and ``mtp.layers.{k}.*``: a
  decoder layer of the model's own class of type ``full_attention`` (Qwen3.5's gated attention with per-head q / k
  norms and partial multi-section RoPE; its MLP, or Qwen3-Next's and Qwen3.5-MoE's experts, saved one per expert as
  ``mlp.experts.{e}.{gate,up,down}_proj``, which transformers' layer holds fused: ``gate_up_proj [E, 2I, H]``, gate
  first, and ``down_proj [E, H, I]``);
* one step: ``h = norm(layer(fc(cat(pre_fc_norm_embedding(embed(x_{j+1})), pre_fc_norm_hidden(f_j)))))``, ``f_j`` the
  target's last hidden state after its final norm at slot j (what its forward hands vLLM's proposer; transformers'
  ``hidden_states[L]``), the logits the target's head on ``h``. vLLM's predictor returns ``h`` after ``mtp.norm``, and
  its proposer feeds that back: a drafted slot reads the ``h`` of the slot before;
* slots as ``drafts.mtp``'s: the layer at the slot of ``x_{j+1}`` reads the target's state of slot j at ``x_{j+1}``'s
  position, so a row's first prompt slot is masked out. With more than one layer the first drafts (as vLLM's
  ``spec_step_idx % mtp_num_hidden_layers`` does for the first drafted token).

speculators trains these layers (``models/mtp``, its ``stitch-mtp`` command writes them back into the checkpoint) on
``verifier_last_hidden_states``: vLLM's hidden-state extraction at layer id L, which is the last layer's output plus
its residual before the final norm (``interfaces._maybe_add_hidden_state``), while vLLM serves the layer with the
normed state. This loader feeds what vLLM serves.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import torch

__all__ = ["QWEN_MTP_TYPES", "QwenMtpLayer", "qwen_mtp_layer_count", "load_qwen_mtp", "read_mtp_tensors", "layer_state"]

QWEN_MTP_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")  # text configs whose checkpoints carry mtp.*


def qwen_mtp_layer_count(model) -> int:
    """The MTP layers a Qwen3.5 / Qwen3-Next config announces (``mtp_num_hidden_layers``), 0 for another family."""
    text = model.config.get_text_config()
    return int(getattr(text, "mtp_num_hidden_layers", 0) or 0) if text.model_type in QWEN_MTP_TYPES else 0


class QwenMtpLayer(torch.nn.Module):
    """One ``mtp.layers.{k}`` with the checkpoint's ``fc`` and norms (module docstring), called as transformers'
    ``MtpLayer`` is (``drafts.mtp.MtpHead``): ``(embedding, hidden, position_embeddings=, attention_mask=,
    position_ids=, cache=)`` -> ``h``."""

    def __init__(self, target, config) -> None:
        super().__init__()
        text = target.config.get_text_config()
        H, norm = int(text.hidden_size), type(target.model.norm)
        kinds = list(text.layer_types)
        if "full_attention" not in kinds:
            raise ValueError(f"{type(target).__name__} has no full-attention layer to build its MTP layer from")
        at = len(kinds) - 1 - kinds[::-1].index("full_attention")  # the layer class builds by this index's type
        self.fc = torch.nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = norm(H, eps=text.rms_norm_eps)
        self.pre_fc_norm_hidden = norm(H, eps=text.rms_norm_eps)
        self.norm = norm(H, eps=text.rms_norm_eps)
        self.block = type(target.model.layers[at])(config, at)

    def forward(self, embedding, hidden, *, position_embeddings, attention_mask, position_ids, cache):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embedding), self.pre_fc_norm_hidden(hidden)], -1))
        out = self.block(x, position_embeddings=position_embeddings, attention_mask=attention_mask,
                         position_ids=position_ids, cache=cache)
        return self.norm(out[0] if isinstance(out, tuple) else out)


def read_mtp_tensors(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every ``mtp.*`` tensor of the safetensors checkpoint in ``directory`` (sharded or not), names kept."""
    from safetensors import safe_open

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({directory / f for name, f in json.loads(index.read_text())["weight_map"].items()
                        if name.startswith("mtp.")})
    else:
        files = sorted(directory.glob("*.safetensors"))
    tensors = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys() if name.startswith("mtp.")}
    return tensors


def layer_state(tensors: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    """``mtp.layers.{k}.*`` under the names of transformers' layer, per-expert weights fused as it holds them."""
    at = f"mtp.layers.{k}."
    state = {name[len(at):]: value for name, value in tensors.items() if name.startswith(at)}
    experts = sorted({int(name.split(".")[2]) for name in state if name.startswith("mlp.experts.")
                      and name.split(".")[2].isdigit()})
    if experts:
        if experts != list(range(len(experts))):
            raise ValueError(f"the MTP layer's experts are numbered {experts[:4]}..., not 0..{len(experts) - 1}")
        take = lambda e, part: state.pop(f"mlp.experts.{e}.{part}_proj.weight")  # noqa: E731
        pairs = [(take(e, "gate"), take(e, "up"), take(e, "down")) for e in experts]
        state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u, _ in pairs])
        state["mlp.experts.down_proj"] = torch.stack([d for _, _, d in pairs])
    return state


def load_qwen_mtp(target_lm, directory: str | os.PathLike) -> SimpleNamespace:
    """The first MTP layer of the Qwen3.5 / Qwen3-Next checkpoint in ``directory`` for ``target_lm``, shaped as
    transformers' ``MtpModel`` is for ``drafts.mtp.MtpHead`` (``layers``, ``config``, ``embed_tokens``,
    ``rotary_emb``, ...; ``count``: the layers announced); ``ValueError`` in one line naming a missing, unknown or
    misshapen tensor."""
    import copy

    model = target_lm.model
    count = qwen_mtp_layer_count(model)
    if count == 0:
        raise ValueError(f"{type(model).__name__}'s config announces no MTP layer (mtp_num_hidden_layers)")
    if not Path(directory).is_dir():
        raise ValueError(f"Qwen's MTP layer is read from the target's checkpoint directory, and {str(directory)!r} is "
                         "none: load the target from its directory or pass directory=")
    tensors = read_mtp_tensors(directory)
    config = copy.copy(model.config.get_text_config())
    config._attn_implementation = "sdpa"  # the head hands its layer a 4-D additive mask
    layer = QwenMtpLayer(model, config)
    state = {f"block.{k}": v for k, v in layer_state(tensors, 0).items()}
    state |= {name: tensors.get(f"mtp.{name}") for name in ("fc.weight", "pre_fc_norm_embedding.weight",
                                                           "pre_fc_norm_hidden.weight", "norm.weight")}
    expected = layer.state_dict()
    missing = sorted(name for name in expected if state.get(name) is None)
    unknown = sorted(set(state) - set(expected))
    if missing or unknown:
        raise ValueError(f"{directory}: not Qwen's MTP layout: missing {missing[:6]}, unknown {unknown[:6]} (the "
                         f"checkpoint's mtp.* tensors, of {count} layer(s))")
    for name, value in state.items():
        if tuple(value.shape) != tuple(expected[name].shape):
            raise ValueError(f"{directory}: tensor {name} has shape {tuple(value.shape)}, expected "
                             f"{tuple(expected[name].shape)} for this config")
    layer.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})
    return SimpleNamespace(layers=[layer.to(dtype=model.dtype).eval()], use_shared_post_norm=False,
                           shared_post_norm=None, config=SimpleNamespace(layer_types=["full_attention"]),
                           has_per_layer_rope=False, embed_tokens=model.get_input_embeddings(),
                           rotary_emb=model.model.rotary_emb, count=count)
