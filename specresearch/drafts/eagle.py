"""EAGLE-1/2 and EAGLE-3 heads as their repository (and vllm-project/speculators) saves them: load, run in the engine,
save.

The formats, read from SafeAILab/EAGLE at commit cb7e084 (Li et al. 2024, EAGLE, arXiv 2401.15077; EAGLE-2, arXiv
2406.16858, drafts with the same head; Li et al. 2025, EAGLE-3, arXiv 2503.01840); our code, their facts.

EAGLE-3 (``eagle/model/cnets.py``):

* a directory with ``config.json`` (a Llama config plus ``draft_vocab_size``, optionally ``target_hidden_size``;
  ``eagle/model/ea_model.py`` l. 118-123 reads it as ``EConfig``) and ``model.safetensors`` or ``pytorch_model.bin``
  (l. 124-135);
* tensors (``eagle/model/cnets.py``, ``Model.__init__``, l. 478-541; the layer may also be saved as ``layers.0.*``, the
  name serving engines' loaders map ``midlayer`` to): ``fc.weight [H, 3 * H_target]`` (no bias),
  ``midlayer.{hidden_norm, input_layernorm, post_attention_layernorm}.weight [H]``,
  ``midlayer.self_attn.{q,k,v}_proj.weight [heads * d | kv_heads * d, 2 * H]`` and ``o_proj.weight [H, heads * d]``
  (no biases, ``d = H // heads``: l. 191-213), ``midlayer.mlp.{gate,up,down}_proj.weight`` (SwiGLU),
  ``norm.weight [H]``, ``lm_head.weight [draft_vocab, H]``, the buffers ``d2t [draft_vocab]`` (int64) and ``t2d
  [vocab]`` (bool), and optionally ``embed_tokens.weight [vocab, H]``: without it the target's embedding is used
  (``ea_model.py`` l. 55-57 and ``load_emb``, ``cnets.py`` l. 488-519); with ``draft_vocab_size == vocab_size`` the
  vocabulary maps are dropped (``ea_model.py`` l. 74-75);
* features: the target's hidden states entering its layers 2, L // 2 and L - 3 (``eagle/model/modeling_llama_kv.py``
  l. 1137-1139), concatenated in layer order (``eagle/model/utils.py`` l. 252) -- transformers' ``hidden_states``
  indices 2, L // 2, L - 3. A config key ``eagle_aux_hidden_state_layer_ids`` (top level or in ``eagle_config``),
  the key vLLM-format checkpoints carry in the same indexing, overrides them;
* one step (``cnets.py`` l. 387-431, 586-662): ``g = fc(features)`` when the input is the target's feature (width
  ``3 * H_target``), else the head's own previous output (width H, fc skipped: l. 639); ``x = cat(input_layernorm(
  embed(token)), hidden_norm(g))`` (2H) feeds the attention (RoPE with ``rope_theta``, causal over the head's own
  cache), the residual is ``g``; then the usual post-norm SwiGLU block. The output ``h`` (before ``norm``) is what the
  next drafted slot reads; the draft logits are ``lm_head(norm(h))`` over the draft vocabulary (l. 700, 734), draft
  id ``i`` being target id ``i + d2t[i]`` (l. 712, 754);
* the head at the slot of token ``x_{j+1}`` reads the feature of slot j: EAGLE's prefill drops the prompt's first
  token (``input_ids[:, 1:]``, l. 683), so here the first prompt slot of each row (whose feature the engine gives as
  zeros) is masked out.

EAGLE-3 as vllm-project/speculators saves it (the format vLLM reads): the same head, its config flattened by
``drafts.speculators``, with the options that layout adds: ``norm_before_residual`` (the layer's residual is
``hidden_norm(g)`` instead of ``g``), ``norm_before_fc`` (an RMS norm over the features before ``fc``), ``fc_norm`` (one
per feature read), ``norm_output`` (the output is ``norm(h)``), a bias on ``fc`` (its first releases), ``head_dim``
and biases, a qwen3 layer's per-head q/k norms, transformers' Llama RoPE (any ``rope_type``), and further plain Llama
layers after the first.

EAGLE-1/2 (``eagle/model/cnets1.py``, the ``Model`` that ``ea_model.py`` l. 58-59 builds when ``use_eagle3`` is
off):

* the same directory (a Llama ``config.json``, whose ``bias`` key, default true, gives ``fc`` a bias:
  ``ea_model.py`` l. 50-54) with tensors ``fc.weight [H, 2H]`` (+ ``fc.bias``), ``layers.{i}.*`` for
  ``num_hidden_layers`` Llama decoder layers (``cnets1.py`` l. 392-470; layer 0 has no ``input_layernorm``, l. 399;
  q/k/v biases iff the config has ``qkv_bias``, l. 209-217), optionally ``embed_tokens.weight``; no norm, no head;
* features: the target's last hidden state after its final norm (``ea_model.py`` l. 191, ``outputs[0]``),
  transformers' ``hidden_states[L]``;
* one step (``cnets1.py`` l. 621-623): ``x = fc(cat(embed(token), f))``, the layers, and the target's own head reads
  the output directly (``head(out_hidden)``, l. 702, 732): no final norm. Drafted slots read the output as ``f``;
  the prompt's first token is dropped as in EAGLE-3 (l. 686).

:class:`Eagle3Head` has :class:`~specresearch.drafts.feature.FeatureHead`'s drafting interface (``block``,
``logits``, ``fuse_features``, ``layers``), and so has :class:`Eagle1Head`: :class:`EagleDraft` is a ``FeatureDraft``
with its first slots masked. :func:`save_eagle3` writes an :class:`Eagle3Head` in the repository's layout. The
toolkit's own shipped head (``drafts.feature.FeatureHead``) is another architecture (``fc`` over ``[g, embedding]``
with a bias, no ``hidden_norm``, attention over H) with no exact EAGLE-3 form; ``FeatureHeadConfig(architecture=
"eagle3")`` trains an :class:`Eagle3Head` (:meth:`Eagle3Head.from_feature_config`), which :func:`save_eagle3` exports
(docs/feature_drafts.md, "Published formats").
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import torch

from specresearch.drafts.distilled import SubsetHead
from specresearch.drafts.feature_draft import (
    MLP,
    DecoderLayer,
    FeatureDraft,
    RMSNorm,
    extend_past,
    frozen_logits,
    rollout,
    rope_base,
    rotate_half,
)
from specresearch.drafts.speculators import (
    SPECULATORS_KEY,
    further_layers,
    speculators_eagle3_config,
    speculators_shapes,
)
from specresearch.drafts.store import check_tensors, published_weights, read_tensors

__all__ = ["EAGLE3_TENSORS", "Eagle3Head", "Eagle1Head", "EagleDraft", "eagle_format", "load_eagle",
           "load_eagle3", "read_eagle3_head", "save_eagle3", "eagle3_feature_layers"]

# tensor name -> (shape in terms of the config; H = hidden, T = target hidden, Q = heads * d, K = kv_heads * d,
# I = intermediate, D = draft vocabulary, V = vocabulary)
EAGLE3_TENSORS = {
    "fc.weight": ("H", "3T"),
    "midlayer.hidden_norm.weight": ("H",),
    "midlayer.input_layernorm.weight": ("H",),
    "midlayer.post_attention_layernorm.weight": ("H",),
    "midlayer.self_attn.q_proj.weight": ("Q", "2H"),
    "midlayer.self_attn.k_proj.weight": ("K", "2H"),
    "midlayer.self_attn.v_proj.weight": ("K", "2H"),
    "midlayer.self_attn.o_proj.weight": ("H", "Q"),
    "midlayer.mlp.gate_proj.weight": ("I", "H"),
    "midlayer.mlp.up_proj.weight": ("I", "H"),
    "midlayer.mlp.down_proj.weight": ("H", "I"),
    "norm.weight": ("H",),
    "lm_head.weight": ("D", "H"),
}
_OPTIONAL = {"d2t": ("D",), "t2d": ("V",), "embed_tokens.weight": ("V", "H")}


def eagle3_feature_layers(config: dict, target_layers: int) -> tuple[int, ...]:
    """The target ``hidden_states`` indices an EAGLE-3 head reads (module docstring)."""
    ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    return tuple(int(i) for i in ids) if ids else (2, target_layers // 2, target_layers - 3)


class _Eagle3Layer(torch.nn.Module):
    """EAGLE-3's ``midlayer``: attention over ``[input_layernorm(embedding), hidden_norm(g)]`` (2H), residual g."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, intermediate: int, eps: float, *,
                 head_dim: int | None = None, bias: bool = False, mlp_bias: bool = False,
                 norm_before_residual: bool = False, qk_norm: bool = False) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim or hidden // heads
        self.norm_before_residual = norm_before_residual  # speculators' option: the residual is hidden_norm(g)
        self.qk_norm = qk_norm  # speculators' qwen3 layer: q and k RMS-normed per head before RoPE
        self.hidden_norm, self.input_layernorm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.self_attn = torch.nn.Module()
        for name, rows in (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads)):
            setattr(self.self_attn, name, torch.nn.Linear(2 * hidden, rows * self.head_dim, bias=bias))
        self.self_attn.o_proj = torch.nn.Linear(heads * self.head_dim, hidden, bias=bias)
        if qk_norm:
            self.self_attn.q_norm, self.self_attn.k_norm = RMSNorm(self.head_dim, eps), RMSNorm(self.head_dim, eps)
        self.mlp = MLP(hidden, intermediate, bias=mlp_bias)

    def forward(self, g, embedding, cos, sin, past, allowed):
        """``g, embedding [B, k, H]``; ``past``: earlier (keys, values) ``[B, kv, S, d]`` or None; ``allowed [B, k,
        S + k]``. -> (``h [B, k, H]``, (keys, values) with this block's appended)."""
        B, k, _ = g.shape
        normed = self.hidden_norm(g)
        x = torch.cat([self.input_layernorm(embedding), normed], dim=-1)
        attn = self.self_attn
        q = attn.q_proj(x).view(B, k, self.heads, self.head_dim)
        keys = attn.k_proj(x).view(B, k, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, keys = attn.q_norm(q), attn.k_norm(keys)
        q, keys = q.transpose(1, 2), keys.transpose(1, 2)
        values = attn.v_proj(x).view(B, k, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q, keys = q * cos + rotate_half(q) * sin, keys * cos + rotate_half(keys) * sin
        keys, values = extend_past(past, keys, values)
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=allowed[:, None],
                                                               enable_gqa=self.heads != self.kv_heads)
        h = (normed if self.norm_before_residual else g) + attn.o_proj(out.transpose(1, 2).reshape(B, k, -1))
        return h + self.mlp(self.post_attention_layernorm(h)), (keys, values)


class Eagle3Head(torch.nn.Module):
    """An EAGLE-3 head over a transformers target (module docstring), with ``FeatureHead``'s drafting interface.

    Args:
        target: the transformers causal LM it drafts for (its embedding is used when ``embedding`` is None).
        config: the head's ``config.json`` as a dict (Llama keys, ``draft_vocab_size``, optional
            ``target_hidden_size`` and ``eagle_aux_hidden_state_layer_ids``).
        token_ids: ``[D]`` target ids of the draft vocabulary (``arange(D) + d2t``); None when D = V.
        embedding: ``[V, H]`` the checkpoint's own ``embed_tokens``, or None (the target's).
    """

    format = "EAGLE-3"

    def __init__(self, target, config: dict, token_ids: torch.Tensor | None = None,
                 embedding: torch.Tensor | None = None, *, fc_bias: bool = False) -> None:
        super().__init__()
        text = target.config.get_text_config()
        H, T = int(config["hidden_size"]), int(config.get("target_hidden_size") or text.hidden_size)
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or H // heads)
        self.eagle_config = dict(config)
        self.config = None  # the FeatureHeadConfig of a head the toolkit trains (from_feature_config)
        self.hidden_size, self.vocab_size = H, int(target.get_output_embeddings().weight.shape[0])
        self.num_hidden_states = text.num_hidden_layers + 1
        self.feature_layers = eagle3_feature_layers(config, text.num_hidden_layers)
        self.feature_size = len(self.feature_layers) * T
        eps = float(config["rms_norm_eps"])
        self.input_norm = RMSNorm(self.feature_size, eps) if config.get("norm_before_fc") else None  # speculators'
        self.fc_norm = None  # speculators' fc_norm: a norm per feature read; norm_output: the output is norm(h)
        if config.get("fc_norm"):
            self.fc_norm = torch.nn.ModuleList(RMSNorm(T, eps) for _ in self.feature_layers)
        self.norm_output = bool(config.get("norm_output"))
        self.fc = torch.nn.Linear(self.feature_size, H, bias=fc_bias)
        self.layers = torch.nn.ModuleList([_Eagle3Layer(
            H, heads, int(config.get("num_key_value_heads") or heads), int(config["intermediate_size"]), eps,
            head_dim=head_dim, bias=bool(config.get("attention_bias")), mlp_bias=bool(config.get("mlp_bias")),
            norm_before_residual=bool(config.get("norm_before_residual")), qk_norm=bool(config.get("qk_norm")))])
        self.layers.extend(further_layers(config))  # speculators' heads of more than one layer
        self.norm = RMSNorm(H, eps)
        draft_vocab = int(config.get("draft_vocab_size") or self.vocab_size)
        ids = torch.arange(draft_vocab) if token_ids is None else token_ids
        self.subset_head = SubsetHead(torch.zeros(draft_vocab, H), ids, self.vocab_size)
        self.rotary = None
        if config.get(SPECULATORS_KEY):  # a transformers Llama layer's RoPE (any rope_type transformers applies)
            from transformers import LlamaConfig
            from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

            keys = set(LlamaConfig().to_dict()) | {"rope_theta", "rope_scaling"}  # the older names it still takes
            self.rotary = LlamaRotaryEmbedding(LlamaConfig(**{k: v for k, v in config.items() if k in keys}))
        else:
            self.position_scale = _register_rope(self, config, head_dim)
        self.embed_tokens = None
        if embedding is not None:
            self.embed_tokens = torch.nn.Embedding.from_pretrained(embedding.float(), freeze=True)
        self._frozen = {"embedding": target.get_input_embeddings()}

    @classmethod
    def from_feature_config(cls, target, config, head_token_ids: torch.Tensor, seed: int = 0) -> "Eagle3Head":
        """A new head for the toolkit to train (``FeatureHeadConfig`` with ``architecture="eagle3"``): EAGLE-3's shape
        over the target's sizes, reading ``config.feature_layers``, its draft vocabulary ``head_token_ids`` read out by
        the target's rows (trained), the layer and ``fc`` seeded at random (``nn.Linear``'s initialisation), norms 1."""
        text = target.config.get_text_config()
        layers = tuple(i % (text.num_hidden_layers + 1) for i in config.feature_layers)
        eagle = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": text.hidden_size,
                 "intermediate_size": text.intermediate_size, "num_attention_heads": text.num_attention_heads,
                 "num_key_value_heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
                 "num_hidden_layers": 1, "rms_norm_eps": text.rms_norm_eps, "rope_theta": rope_base(text),
                 "vocab_size": int(target.get_output_embeddings().weight.shape[0]),
                 "draft_vocab_size": len(head_token_ids), "eagle_aux_hidden_state_layer_ids": list(layers)}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            head = cls(target, eagle, torch.as_tensor(head_token_ids, dtype=torch.long))
        with torch.no_grad():
            rows = target.get_output_embeddings().weight.detach()[head.subset_head.token_ids]
            head.subset_head.weight.copy_(rows.float())
        head.config = config
        return head

    def rollout(self, features, tokens, attention_mask, passes: int, feature_noise: float = 0.0, generator=None):
        """``drafts.feature.rollout`` (EAGLE-3's training-time test): each pass reads the layer's own outputs."""
        return rollout(self, features, tokens, attention_mask, passes, feature_noise, generator)

    @property
    def draft_to_target(self) -> torch.Tensor:
        """``d2t [D]``: target id minus draft id, the repository's vocabulary map."""
        ids = self.subset_head.token_ids
        return ids - torch.arange(len(ids), device=ids.device)

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features ``[..., 3 T]`` -> ``g [..., H]`` (through ``input_norm`` or ``fc_norm`` first where it
        has one)."""
        if self.fc_norm is not None:
            parts = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([norm(part) for norm, part in zip(self.fc_norm, parts)], dim=-1)
        return self.fc(features if self.input_norm is None else self.input_norm(features))

    def raw_input_layers(self) -> list[torch.nn.Module]:
        return [self.fc]

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rotary is not None:  # transformers' rotary reads only the dtype and device of its first argument
            return self.rotary(self.norm.weight, positions)
        return _rope(self, positions)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's outputs ``h [..., H]`` -> logits over the target vocabulary ``[..., V]`` (lowest value off the
        draft vocabulary); with ``norm_output`` the outputs are normed already."""
        return self.subset_head(hidden if self.norm_output else self.norm(hidden)).float()

    def support_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.subset_head.subset_logits(hidden if self.norm_output else self.norm(hidden)), self.subset_head.index_of

    def block(self, inputs, tokens, positions, past, allowed):
        """``FeatureHead.block``: ``inputs [B, k, H]`` (g), ``tokens [B, k]`` -> (``h [B, k, H]``, [(keys, values)])."""
        table = self.embed_tokens if self.embed_tokens is not None else self._frozen["embedding"]
        with torch.no_grad():
            embedding = table(tokens).to(inputs.dtype)
        cos, sin = self.rope(positions)
        h, kv = self.layers[0](inputs, embedding, cos, sin, past[0], allowed)
        new = [kv]
        for layer, layer_past in zip(self.layers[1:], past[1:]):  # speculators' further layers
            h, kv = layer(h, cos, sin, layer_past, allowed)
            new.append(kv)
        return (self.norm(h) if self.norm_output else h), new

    def state_dict_eagle3(self) -> dict[str, torch.Tensor]:
        """The tensors under the repository's names (``EAGLE3_TENSORS``, ``d2t``, ``t2d``, ``embed_tokens``)."""
        if len(self.layers) != 1:
            raise ValueError(f"an EAGLE-3 head of {len(self.layers)} layers has no form in the repository's layout "
                             "(one midlayer)")
        layer = self.layers[0]
        tensors = {"fc.weight": self.fc.weight, "norm.weight": self.norm.weight,
                   "lm_head.weight": self.subset_head.weight}
        if self.fc.bias is not None:
            tensors["fc.bias"] = self.fc.bias
        if self.input_norm is not None:
            tensors["input_norm.weight"] = self.input_norm.weight
        for i, norm in enumerate(self.fc_norm or ()):
            tensors[f"fc_norm.{i}.weight"] = norm.weight
        for name, value in layer.state_dict().items():
            tensors[f"midlayer.{name}"] = value
        if len(self.subset_head.token_ids) != self.vocab_size:
            tensors["d2t"] = self.draft_to_target
            tensors["t2d"] = self.subset_head.index_of >= 0
        if self.embed_tokens is not None:
            tensors["embed_tokens.weight"] = self.embed_tokens.weight
        return {name: value.detach().contiguous().clone() for name, value in tensors.items()}


def _register_rope(module: torch.nn.Module, config: dict, head_dim: int) -> float:
    """RoPE as the repository's heads apply it (``rope_theta``; ``rope_scaling`` none or linear, ``cnets.py`` l.
    215-236): registers ``inv_freq``; returns the positions' scale."""
    base = float(config.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling")
    if scaling and scaling.get("type", scaling.get("rope_type")) != "linear":
        raise ValueError(f"EAGLE head: rope_scaling {scaling!r} is not one this loader applies (none or linear, as the "
                         "EAGLE repository's heads)")
    module.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim), persistent=False)
    return 1.0 / float(scaling["factor"]) if scaling else 1.0


def _rope(module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = (positions.float() * module.position_scale)[..., None] * module.inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


class Eagle1Head(torch.nn.Module):
    """An EAGLE-1/2 head over a transformers target (module docstring), with ``FeatureHead``'s drafting interface.

    Args:
        target: the transformers causal LM it drafts for (its head reads the output; its embedding is used when
            ``embedding`` is None).
        config: the head's ``config.json`` as a dict (Llama keys; ``bias``, ``qkv_bias``).
        embedding: ``[V, H]`` the checkpoint's own ``embed_tokens``, or None (the target's).
    """

    format = "EAGLE-1/2"

    def __init__(self, target, config: dict, embedding: torch.Tensor | None = None) -> None:
        super().__init__()
        text = target.config.get_text_config()
        H, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        self.config = dict(config)
        self.hidden_size, self.vocab_size = H, int(target.get_output_embeddings().weight.shape[0])
        self.feature_layers, self.feature_size = (text.num_hidden_layers,), H
        self.fc = torch.nn.Linear(2 * H, H, bias=bool(config.get("bias", True)))
        shape = SimpleNamespace(hidden_size=H, rms_norm_eps=float(config["rms_norm_eps"]), num_attention_heads=heads,
                                head_dim=H // heads, num_key_value_heads=kv_heads, attention_bias=False,
                                intermediate_size=int(config["intermediate_size"]), mlp_bias=False)
        self.layers = torch.nn.ModuleList(DecoderLayer(shape) for _ in range(int(config["num_hidden_layers"])))
        self.layers[0].input_layernorm = torch.nn.Identity()
        if config.get("qkv_bias"):
            for layer in self.layers:
                for name in ("q_proj", "k_proj", "v_proj"):
                    old = getattr(layer.self_attn, name)
                    setattr(layer.self_attn, name, torch.nn.Linear(old.in_features, old.out_features, bias=True))
        self.position_scale = _register_rope(self, config, H // heads)
        self.embed_tokens = None
        if embedding is not None:
            self.embed_tokens = torch.nn.Embedding.from_pretrained(embedding.float(), freeze=True)
        self._frozen = {"embedding": target.get_input_embeddings(), "head": target.get_output_embeddings()}

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        return features

    def raw_input_layers(self) -> list[torch.nn.Module]:
        return [self.fc]

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _rope(self, positions)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layers' outputs ``[..., H]`` -> the target's head on them ``[..., V]`` (no norm: module docstring)."""
        return frozen_logits(self._frozen["head"], hidden)

    def support_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.logits(hidden), None

    def block(self, inputs, tokens, positions, past, allowed):
        """``FeatureHead.block``: ``x = fc(cat(embedding, inputs))`` through the layers -> (out ``[B, k, H]``, cache)."""
        table = self.embed_tokens if self.embed_tokens is not None else self._frozen["embedding"]
        with torch.no_grad():
            embedding = table(tokens).to(inputs.dtype)
        x = self.fc(torch.cat([embedding, inputs], dim=-1))
        cos, sin = self.rope(positions)
        new = []
        for layer, layer_past in zip(self.layers, past):
            x, kv = layer(x, cos, sin, layer_past, allowed)
            new.append(kv)
        return x, new


class EagleDraft(FeatureDraft):
    """An EAGLE head (:class:`Eagle3Head`, :class:`Eagle1Head`) behind the engine's interface: a ``FeatureDraft``
    whose prompt's first slot in each row is masked out (EAGLE drafts from token ``x_{j+1}`` with the feature of slot
    j; slot 0 has none). ``format``: which layout it was read from."""

    skips_first_slot = True

    @property
    def format(self) -> str:
        return self.head.format

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self._restart(input_ids, attention_mask)
        valid = attention_mask.bool()
        first = valid & (valid.long().cumsum(-1) == 1)
        return self.head.logits(self._append(input_ids, valid & ~first)[:, -1])


def eagle_format(directory: str | os.PathLike) -> str | None:
    """``"EAGLE-3"`` or ``"EAGLE-1/2"`` when ``directory`` holds such a head in the repository's layout (a
    ``config.json`` and a weights file whose tensors carry the head's names: ``midlayer.*``, or ``layers.*`` beside
    ``fc.weight``, with no ``model.`` prefix), else None."""
    directory = Path(directory)
    weights = published_weights(directory)
    if not (directory / "config.json").is_file() or weights is None:
        return None
    names = _tensor_names(weights)
    if any(n.startswith("midlayer.") for n in names) or "layers.0.hidden_norm.weight" in names:
        return "EAGLE-3"
    return "EAGLE-1/2" if {"fc.weight", "layers.0.self_attn.q_proj.weight"} <= names else None


def is_eagle3_dir(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds an EAGLE-3 head in the repository's layout."""
    return eagle_format(directory) == "EAGLE-3"


def _tensor_names(path: Path) -> set[str]:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            return set(f.keys())
    return set(read_tensors(path))


def _expected_shapes(config: dict, text_config, vocab: int, extra: dict | None = None) -> dict[str, tuple[int, ...]]:
    """Every EAGLE-3 tensor's shape for ``config`` over a target of ``text_config`` and ``vocab`` ("3T": the features
    read, ``len(eagle3_feature_layers)`` of the target's hidden size), and those of ``extra``."""
    H, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    d, kv = int(config.get("head_dim") or H // heads), int(config.get("num_key_value_heads") or heads)
    T, features = int(config.get("target_hidden_size") or text_config.hidden_size), len(eagle3_feature_layers(
        config, text_config.num_hidden_layers))
    sizes = {"H": H, "2H": 2 * H, "3T": features * T, "T": T, "Q": heads * d, "K": kv * d,
             "I": int(config["intermediate_size"]), "d": d, "D": int(config.get("draft_vocab_size") or vocab), "V": vocab,
             "1": 1}
    shapes = {**EAGLE3_TENSORS, **_OPTIONAL, "fc.bias": ("H",)}  # fc's bias: speculators' first releases
    if config.get("attention_bias"):
        shapes |= {f"midlayer.self_attn.{n}_proj.bias": (r,) for n, r in (("q", "Q"), ("k", "K"), ("v", "K"), ("o", "H"))}
    if config.get("qk_norm"):
        shapes |= {f"midlayer.self_attn.{n}_norm.weight": ("d",) for n in ("q", "k")}
    if config.get("mlp_bias"):
        shapes |= {f"midlayer.mlp.{n}_proj.bias": (r,) for n, r in (("gate", "I"), ("up", "I"), ("down", "H"))}
    shapes |= speculators_shapes(config, features) | (extra or {})
    return {name: tuple(sizes[s] for s in shape) for name, shape in shapes.items()}


def load_eagle3(target_lm, directory: str | os.PathLike, *, device=None) -> EagleDraft:
    """An EAGLE-3 head saved in the repository's layout (module docstring) as a draft for ``target_lm`` (a
    ``CausalLM``); a missing, unknown or misshapen tensor is refused with its name and the shape expected."""
    directory = Path(directory)
    if not is_eagle3_dir(directory):
        raise ValueError(f"{directory} is not an EAGLE-3 head: expected config.json and model.safetensors or "
                         "pytorch_model.bin with fc.weight and midlayer.* (the SafeAILab/EAGLE layout)")
    config = json.loads((directory / "config.json").read_text())
    if config.get(SPECULATORS_KEY) == "eagle3" and "transformer_layer_config" in config:
        config = speculators_eagle3_config(config)
    head, _ = read_eagle3_head(target_lm, directory, config)
    return EagleDraft(head, max_context=target_lm.max_context, device=device or target_lm.device)


def read_eagle3_head(target_lm, directory: Path, config: dict, extra: dict[str, tuple] | None = None,
                     what: str = "EAGLE-3") -> tuple[Eagle3Head, dict[str, torch.Tensor]]:
    """The :class:`Eagle3Head` of ``directory`` for ``target_lm`` from its (flattened) ``config``, and every tensor
    read; ``extra``: further tensors the layout ``what`` requires (name -> shape in this module's size
    letters), checked with the rest and left to the caller."""
    target = target_lm.model
    text = target.config.get_text_config()
    tensors = read_tensors(published_weights(directory))
    if "layers.0.hidden_norm.weight" in tensors:  # the layer under the name vLLM's and speculators' loaders give it
        tensors = {(f"midlayer.{k[len('layers.0.'):]}" if k.startswith("layers.0.") else k): v
                   for k, v in tensors.items()}
    expected = _expected_shapes(config, text, int(target.get_output_embeddings().weight.shape[0]), extra)
    check_tensors(directory, tensors, expected, set(_OPTIONAL) | {"fc.bias"}, what)
    draft_vocab = expected["lm_head.weight"][0]
    token_ids = None
    if "d2t" in tensors and draft_vocab != expected["t2d"][0]:
        token_ids = torch.arange(draft_vocab) + tensors["d2t"].long()
    head = Eagle3Head(target, config, token_ids, tensors.get("embed_tokens.weight"), fc_bias="fc.bias" in tensors)
    with torch.no_grad():
        head.fc.weight.copy_(tensors["fc.weight"].float())
        if "fc.bias" in tensors:
            head.fc.bias.copy_(tensors["fc.bias"].float())
        if head.input_norm is not None:
            head.input_norm.weight.copy_(tensors["input_norm.weight"].float())
        for i, norm in enumerate(head.fc_norm or ()):
            norm.weight.copy_(tensors[f"fc_norm.{i}.weight"].float())
        head.norm.weight.copy_(tensors["norm.weight"].float())
        head.subset_head.weight.copy_(tensors["lm_head.weight"].float())
        head.layers[0].load_state_dict({k[len("midlayer."):]: v.float() for k, v in tensors.items()
                                        if k.startswith("midlayer.")}, strict=True)
        for i, layer in enumerate(head.layers[1:], start=1):
            at = f"layers.{i}."
            layer.load_state_dict({k[len(at):]: v.float() for k, v in tensors.items() if k.startswith(at)}, strict=True)
    return head, tensors


def _eagle1_shapes(config: dict, vocab: int) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(expected shape of every tensor name, the optional names) of an EAGLE-1/2 head (module docstring)."""
    H, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    d, kv, inter = H // heads, int(config.get("num_key_value_heads") or heads), int(config["intermediate_size"])
    shapes = {"fc.weight": (H, 2 * H), "embed_tokens.weight": (vocab, H)}
    if config.get("bias", True):
        shapes["fc.bias"] = (H,)
    for i in range(int(config["num_hidden_layers"])):
        at = f"layers.{i}."
        shapes |= {at + "self_attn.q_proj.weight": (heads * d, H), at + "self_attn.k_proj.weight": (kv * d, H),
                   at + "self_attn.v_proj.weight": (kv * d, H), at + "self_attn.o_proj.weight": (H, heads * d),
                   at + "post_attention_layernorm.weight": (H,), at + "mlp.gate_proj.weight": (inter, H),
                   at + "mlp.up_proj.weight": (inter, H), at + "mlp.down_proj.weight": (H, inter)}
        if i:
            shapes[at + "input_layernorm.weight"] = (H,)
        if config.get("qkv_bias"):
            shapes |= {at + f"self_attn.{n}_proj.bias": (rows,) for n, rows in (("q", heads * d), ("k", kv * d),
                                                                               ("v", kv * d))}
    return shapes, {"embed_tokens.weight"}


def load_eagle(target_lm, directory: str | os.PathLike, *, device=None) -> EagleDraft:
    """An EAGLE-1/2 or EAGLE-3 head in the repository's layout (:func:`eagle_format`) as a draft for ``target_lm``."""
    kind = eagle_format(directory)
    if kind == "EAGLE-3":
        return load_eagle3(target_lm, directory, device=device)
    if kind is None:
        raise ValueError(f"{directory} is not an EAGLE head: expected config.json and model.safetensors or "
                         "pytorch_model.bin with fc.weight and midlayer.* (EAGLE-3) or layers.* (EAGLE-1/2)")
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    target = target_lm.model
    if int(config["hidden_size"]) != target.config.get_text_config().hidden_size:
        raise ValueError(f"{directory}: an EAGLE-1/2 head of hidden size {config['hidden_size']} cannot read a target "
                         f"of hidden size {target.config.get_text_config().hidden_size}")
    tensors = read_tensors(published_weights(directory))
    expected, optional = _eagle1_shapes(config, int(target.get_output_embeddings().weight.shape[0]))
    check_tensors(directory, tensors, expected, optional, "EAGLE-1/2")
    head = Eagle1Head(target, config, tensors.get("embed_tokens.weight"))
    head.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)  # names checked above
    return EagleDraft(head, max_context=target_lm.max_context, device=device or target_lm.device)


def save_eagle3(head: Eagle3Head, directory: str | os.PathLike, *, safetensors: bool = True) -> Path:
    """Write ``head`` in the repository's layout (``config.json`` and ``model.safetensors`` or
    ``pytorch_model.bin``), what ``load_eagle3`` and the engines that load EAGLE-3 heads read."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {**head.eagle_config, "draft_vocab_size": len(head.subset_head.token_ids)}
    config.setdefault("architectures", ["LlamaForCausalLMEagle3"])
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = head.state_dict_eagle3()
    if safetensors:
        from safetensors.torch import save_file

        save_file(tensors, directory / "model.safetensors")
    else:
        torch.save(tensors, directory / "pytorch_model.bin")
    return directory
