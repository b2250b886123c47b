"""Multi-token prediction (MTP) layers shipped in a target's own checkpoint, as a draft.

DeepSeek-V3 (DeepSeek-AI 2024, arXiv 2412.19437, section 2.2) trains, beside the model, a module that predicts the
token after next from the model's representation; DeepSeek-V3/R1, GLM-4.5, ERNIE 4.5, Mellum and others publish it
in the model's checkpoint, where transformers' model skips it on load, and serving engines draft with it. The facts
here are read from transformers 5.25, which loads and runs these layers itself (``generate(..., use_mtp=True)``;
our code, their facts), and checked against it (``tests/test_mtp.py``):

* layout: the tensors of the model's checkpoint that its class lists as MTP (``_keys_to_ignore_on_load_unexpected``
  past its last layer: DeepSeek-V3 ``model.layers.61.*``, GLM-4.5 ``model.layers.92.*`` or ``46.*``; ERNIE 4.5
  ``mtp_*.{k}``, Mellum ``mtp.*``); the config's ``num_nextn_predict_layers`` (``num_mtp_layers``) counts the layers.
  transformers' ``modeling_layers.MtpModel.from_pretrained`` reads them with its conversion mapping and refuses a
  checkpoint missing any of them; so does :func:`load_mtp`, which calls it;
* one layer (``modeling_layers.MtpLayer``): ``h = post_norm(block(eh_proj(cat(enorm(embed(x_{j+1})), hnorm(f_j)))))``,
  ``block`` a decoder layer of the model's own class (DeepSeek-V3's: latent attention and experts), ``post_norm`` the
  checkpoint's ``shared_head.norm``, ``f_j`` the model's last hidden state after its final norm at slot j
  (transformers' ``hidden_states[L]``; vLLM's ``deepseek_mtp.py`` and SGLang's ``deepseek_nextn.py`` read the same);
  the logits are the model's own head on ``h`` (``MtpModel._project_to_logits``). The concatenation is
  ``[hidden, embedding]`` where the config says ``mtp_hidden_states_first`` (Inkling);
* a layer of type ``sliding_attention`` (``mtp_layer_types``; Mellum's default) sees the keys less than
  ``sliding_window`` positions before it, as transformers' mask for it does; a layer of another type is refused;
* slots: the layer at the slot of token ``x_{j+1}`` reads the model's state of slot j, at ``x_{j+1}``'s position, so
  the prompt's first token has no slot (``MTPCandidateGenerator``'s inputs start one token later), as in
  :class:`~specresearch.drafts.eagle.EagleDraft`, whose masking :class:`MtpDraft` keeps;
* drafting past the first token: the layer reads its own output ``h`` at the slot before, as the EAGLE heads do and as
  SGLang feeds its NextN layer (vLLM feeds the output before ``shared_head.norm``). transformers instead drafts one
  token per layer, layer k at depth k; with one layer, as DeepSeek-V3, GLM-4.5 and ERNIE 4.5 ship, its first drafted
  token is this draft's, exactly. A checkpoint with more layers drafts here with its first.

:class:`MtpHead` has the feature heads' drafting interface (``block``, ``logits``, ``fuse_features``, ``layers``), so
the engine drafts chains, sampled trees and dynamic trees with it and runs it over static caches.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from specresearch.drafts.eagle import EagleDraft
from specresearch.drafts.feature_draft import extend_past, frozen_logits
from specresearch.models.attention import additive_mask
from specresearch.models.kernels import experts_in_float64

__all__ = ["MtpHead", "MtpDraft", "load_mtp", "mtp_layer_count"]


def mtp_layer_count(model) -> int:
    """How many MTP layers a transformers model's config announces (0: none)."""
    return int(getattr(model.config.get_text_config(), "num_mtp_layers", None) or 0)


class _LayerPast:
    """The one cache a transformers layer is handed: ``update`` puts the call's keys and values after ``past`` (the
    feature heads' form, ``drafts.feature_draft.extend_past``) and keeps the result as ``kv``."""

    def __init__(self, past):
        self.past, self.kv = past, None

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int | None = None, *args, **kwargs):
        self.kv = extend_past(self.past, keys, values)
        return self.kv


class MtpHead(torch.nn.Module):
    """A checkpoint's first MTP layer over its transformers target (module docstring), with ``FeatureHead``'s
    drafting interface.

    Args:
        target: the transformers causal LM (its embedding, head and rotary embedding are used, not copied).
        mtp_model: transformers' ``MtpModel`` loaded from the target's checkpoint.
    """

    format = "MTP"

    def __init__(self, target, mtp_model, *, layer_count: int | None = None, format: str = "MTP") -> None:
        super().__init__()
        self.format = format
        text = target.config.get_text_config()
        self.layers = torch.nn.ModuleList([mtp_model.layers[0]])
        self.shared_post_norm = mtp_model.shared_post_norm if mtp_model.use_shared_post_norm else None
        self.config = mtp_model.config
        self.hidden_size = self.feature_size = int(text.hidden_size)
        self.feature_layers = (int(text.num_hidden_layers),)
        self.vocab_size = int(target.get_output_embeddings().weight.shape[0])
        self.layer_count = layer_count or len(mtp_model.layers)
        kind = (getattr(self.config, "layer_types", None) or ["full_attention"])[0]
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(f"{type(target).__name__}'s MTP layer is of type {kind!r}: only attention layers "
                             "(full or sliding) draft here")
        self.window = int(self.config.sliding_window) if kind == "sliding_attention" else None  # feature_draft.windowed
        rope = {}
        if mtp_model.has_per_layer_rope:
            rope["layer_type"] = self.config.layer_types[0]
        self._rope_kwargs = rope
        # the target's modules, outside this module's tree: kernels chosen for the head leave them alone
        self._frozen = {"embedding": mtp_model.embed_tokens, "head": target.get_output_embeddings(),
                        "rotary": mtp_model.rotary_emb}

    @property
    def dtype(self) -> torch.dtype:
        return next(self.layers.parameters()).dtype

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        return features

    def raw_input_layers(self) -> list[torch.nn.Module]:
        layer = self.layers[0]
        return [layer.eh_proj if hasattr(layer, "eh_proj") else layer.fc]  # transformers' MtpLayer, QwenMtpLayer

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's outputs ``[..., H]`` -> the target's head on them ``[..., V]`` float32 (``MtpModel``'s scaling
        and vocabulary slice where the config has them)."""
        multiplier = getattr(self.config, "logits_mup_width_multiplier", None)
        if multiplier is not None:
            hidden = hidden / multiplier
        logits = frozen_logits(self._frozen["head"], hidden)
        unpadded = getattr(self.config, "unpadded_vocab_size", None)
        return logits[..., :unpadded] if unpadded is not None and unpadded < logits.shape[-1] else logits

    def support_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.logits(hidden), None

    def block(self, inputs, tokens, positions, past, allowed):
        """``FeatureHead.block``: ``inputs [B, k, H]`` (the target's states, or the layer's own outputs) and ``tokens
        [B, k]`` at ``positions [B, k]``, attending where ``allowed [B, k, S + k]`` -> (``h [B, k, H]``, cache)."""
        dtype = self.dtype
        with torch.no_grad():
            embedding = self._frozen["embedding"](tokens).to(dtype)
        rotary = self._frozen["rotary"]
        position_embeddings = None
        if rotary is not None:
            position_embeddings = rotary(embedding, position_ids=positions, **self._rope_kwargs)
        cache = _LayerPast(past[0])
        hidden = self.layers[0](embedding, inputs.to(dtype), position_embeddings=position_embeddings,
                                attention_mask=additive_mask(allowed, dtype), position_ids=positions, cache=cache)
        if self.shared_post_norm is not None:
            hidden = self.shared_post_norm(hidden)
        return hidden, [cache.kv]


class MtpDraft(EagleDraft):
    """A checkpoint's MTP layer (:class:`MtpHead`) behind the engine's interface: a feature draft reading the target's
    last hidden state, each row's first prompt slot masked out as :class:`~specresearch.drafts.eagle.EagleDraft`'s."""


def load_mtp(target_lm, directory: str | os.PathLike | None = None, *, device=None) -> MtpDraft:
    """The MTP layer of ``target_lm``'s checkpoint as a draft for it.

    Args:
        target_lm: ``models.causal_lm.CausalLM`` over a transformers model whose config announces MTP layers.
        directory: the checkpoint directory to read them from (default: the one the model was loaded from, a
            directory or a hub id transformers resolves).
        device: where the draft runs (default: the target's).

    ``ValueError`` in one line where the config announces none or no checkpoint is known (a model built from a
    config); transformers' ``RuntimeError`` names the tensors a checkpoint lacks.
    """
    from transformers.modeling_layers import MtpModel

    from specresearch.drafts.qwen_mtp import load_qwen_mtp, qwen_mtp_layer_count

    model = target_lm.model
    if mtp_layer_count(model) == 0 and qwen_mtp_layer_count(model) == 0:
        raise ValueError(f"{type(model).__name__} has no MTP layers: its config sets no num_nextn_predict_layers "
                         "(num_mtp_layers) or, for Qwen3.5 / Qwen3-Next, mtp_num_hidden_layers")
    source = str(directory) if directory is not None else str(model.config.name_or_path or "")
    if not source or (directory is not None and not Path(source).is_dir()):
        raise ValueError(f"MTP layers are read from the target's checkpoint, and {source!r} is no checkpoint directory: "
                         "load the target from its directory (or hub id) or pass directory=")
    device = torch.device(device if device is not None else target_lm.device)
    if qwen_mtp_layer_count(model):  # Qwen3.5 / Qwen3-Next: mtp.* beside the model's tensors, no transformers model
        layer = load_qwen_mtp(target_lm, source)
        head = MtpHead(model, layer, layer_count=layer.count, format="Qwen MTP")
        return MtpDraft(head, max_context=target_lm.max_context, device=device)
    saved, model.config.name_or_path = model.config.name_or_path, source
    try:
        mtp_model = MtpModel.from_pretrained(model, device_map={"": device})
    finally:
        model.config.name_or_path = saved
    if mtp_model.config._attn_implementation not in ("eager", "sdpa"):  # the head hands it a 4-D additive mask
        mtp_model.set_attn_implementation("sdpa")
    experts_in_float64(mtp_model)
    return MtpDraft(MtpHead(model, mtp_model.eval()), max_context=target_lm.max_context, device=device)
