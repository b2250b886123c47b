"""EAGLE-3 heads as vllm-project/speculators saves them (the format vLLM reads): what differs from the SafeAILab/EAGLE
layout that ``drafts.eagle`` loads, read from speculators' ``src/speculators/models/eagle3/config.py``, ``core.py``
and ``model_definitions.py`` (release 0.9.0) and vLLM 0.34's ``model_executor/models/llama_eagle3.py`` (our code,
their facts).

* ``config.json`` with ``speculators_model_type: "eagle3"`` and the layer's config under ``transformer_layer_config``
  (llama, or qwen3 with per-head q/k norms), beside ``draft_vocab_size``, ``norm_before_residual``,
  ``norm_before_fc``, ``fc_norm``, ``norm_output``, ``target_hidden_size`` and ``eagle_aux_hidden_state_layer_ids``:
  :func:`speculators_eagle3_config` flattens it to the keys ``drafts.eagle.Eagle3Head`` reads, and refuses in one line
  a key it does not know (a newer option would otherwise be dropped silently), a config without
  ``norm_before_residual`` (speculators writes it always; its own config reads a missing one as False, vLLM 0.34's
  ``transformers_utils/configs/speculators/algos.py`` as True) and a layer it does not build (sliding windows, partial
  RoPE, an activation other than SiLU);
* ``fc_norm``: one RMS norm per feature read (``fc_norm.{i}.weight``, the target's hidden size) over its own slice of
  the features before ``fc`` (``concat(norm_a(h_a), norm_b(h_b), ...)``; exclusive with ``norm_before_fc``'s one norm
  over the concatenation); ``norm_output`` (EAGLE 3.1): the output is ``norm(h)``, both what the logits read (no
  second norm) and what the next drafted slot reads, instead of ``h``;
* a llama head of N layers: the EAGLE-3 layer, then N - 1 plain Llama decoder layers (``layers.{i}.*``) over its
  output (:func:`further_layers`, :func:`speculators_shapes`); the last one's output is the logits' input and what
  the next drafted slot reads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

from specresearch.drafts.feature_draft import DecoderLayer

__all__ = ["SPECULATORS_KEY", "SPECULATORS_METADATA", "speculators_eagle3_config", "is_speculators_dir",
           "further_layers", "speculators_shapes", "refused_layer"]

SPECULATORS_KEY = "speculators_model_type"  # a config read from the vllm-project/speculators layout keeps it
_READ = ("target_hidden_size", "eagle_aux_hidden_state_layer_ids", "norm_before_residual", "norm_before_fc", "fc_norm",
         "norm_output")
# the keys every speculators config carries that do not change what its model computes (or that its loaders read
# themselves: the draft vocabulary, the layer's config)
SPECULATORS_METADATA = {"architectures", "auto_map", "draft_vocab_size", "dtype", "torch_dtype", "has_no_defaults_at_init",
                        "speculators_config", SPECULATORS_KEY, "speculators_version", "tie_word_embeddings",
                        "transformer_layer_config", "transformers_version", "_name_or_path", "model_type"}
_METADATA = SPECULATORS_METADATA | {"embed_requires_grad"}


def refused_layer(layer: dict) -> str | None:
    """Why the toolkit's loaders do not build the speculators layer config ``layer`` (sliding windows, RoPE per layer
    type, partial RoPE, an activation other than SiLU), or None."""
    kinds = set(layer.get("layer_types") or ())
    rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    if "sliding_attention" in kinds or layer.get("use_sliding_window"):
        return "sliding-window attention layers"
    if "sliding_attention" in rope or "full_attention" in rope:
        return "RoPE parameters per layer type"
    if float(rope.get("partial_rotary_factor", layer.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        return "a partial rotary factor"
    if layer.get("hidden_act", "silu") != "silu":
        return f"the activation {layer['hidden_act']!r}"
    return None


def speculators_eagle3_config(config: dict) -> dict:
    """An EAGLE-3 head's ``config.json`` as vllm-project/speculators saves it flattened to the keys
    ``drafts.eagle.Eagle3Head`` reads; ``ValueError`` in one line for layers this loader does not build (another model
    type, a qwen3 head of more than one layer)."""
    layer = dict(config.get("transformer_layer_config") or {})
    kind, count = layer.get("model_type", "llama"), int(layer.get("num_hidden_layers") or 1)
    if kind not in ("llama", "qwen3") or (kind == "qwen3" and count != 1):
        raise ValueError(f"speculators EAGLE-3 head with {count} {kind!r} layer(s): this loader builds llama layers "
                         "or one qwen3 layer")
    unknown = sorted(set(config) - _METADATA - set(_READ))
    if unknown:
        raise ValueError(f"speculators EAGLE-3 config keys {unknown} are not read by this loader (it reads "
                         f"{list(_READ)}): a newer option would change the draft; refusing rather than dropping it")
    if "norm_before_residual" not in config:  # speculators writes it always: a config written by hand may lack it
        raise ValueError("speculators EAGLE-3 config without norm_before_residual: speculators 0.9.0 reads it as "
                         "False, vLLM 0.34 as True (two different drafts); write the key")
    why = refused_layer(layer)
    if why:
        raise ValueError(f"speculators EAGLE-3 head with {why}: this loader builds full-attention SiLU layers with "
                         "full RoPE")
    if config.get("fc_norm") and config.get("norm_before_fc"):
        raise ValueError("speculators EAGLE-3 config with both fc_norm and norm_before_fc (exclusive in speculators)")
    flat = {**layer, SPECULATORS_KEY: "eagle3", "draft_vocab_size": config.get("draft_vocab_size"),
            "qk_norm": kind == "qwen3"}
    for key in _READ:
        if config.get(key) is not None:
            flat[key] = config[key]
    return flat


def is_speculators_dir(directory: str | os.PathLike) -> bool:
    """Whether ``directory``'s config is an EAGLE-3 head's as vllm-project/speculators saves it."""
    config = Path(directory) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get(SPECULATORS_KEY) == "eagle3"


def _count(config: dict) -> int:
    return int(config.get("num_hidden_layers") or 1) if config.get(SPECULATORS_KEY) else 1


def further_layers(config: dict) -> list[DecoderLayer]:
    """The plain Llama decoder layers after the EAGLE-3 layer of a (flattened) speculators config; none otherwise."""
    H, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    shape = SimpleNamespace(hidden_size=H, rms_norm_eps=float(config["rms_norm_eps"]), num_attention_heads=heads,
                            head_dim=int(config.get("head_dim") or H // heads),
                            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
                            attention_bias=bool(config.get("attention_bias")),
                            intermediate_size=int(config["intermediate_size"]), mlp_bias=bool(config.get("mlp_bias")))
    return [DecoderLayer(shape) for _ in range(_count(config) - 1)]


def speculators_shapes(config: dict, features: int) -> dict[str, tuple[str, ...]]:
    """The tensors a (flattened) speculators config adds to the SafeAILab layout by name, their shapes in
    ``drafts.eagle``'s size letters: ``input_norm`` (``norm_before_fc``), ``fc_norm.{i}`` for each of the
    ``features`` read (``fc_norm``), the further layers (``layers.{i}.*``, i >= 1)."""
    shapes = {"input_norm.weight": ("3T",)} if config.get("norm_before_fc") else {}
    if config.get("fc_norm"):
        shapes |= {f"fc_norm.{i}.weight": ("T",) for i in range(features)}
    for i in range(1, _count(config)):
        at = f"layers.{i}."
        shapes |= {at + "input_layernorm.weight": ("H",), at + "post_attention_layernorm.weight": ("H",),
                   at + "self_attn.q_proj.weight": ("Q", "H"), at + "self_attn.k_proj.weight": ("K", "H"),
                   at + "self_attn.v_proj.weight": ("K", "H"), at + "self_attn.o_proj.weight": ("H", "Q"),
                   at + "mlp.gate_proj.weight": ("I", "H"), at + "mlp.up_proj.weight": ("I", "H"),
                   at + "mlp.down_proj.weight": ("H", "I")}
        if config.get("attention_bias"):
            shapes |= {at + f"self_attn.{n}_proj.bias": (r,) for n, r in (("q", "Q"), ("k", "K"), ("v", "K"), ("o", "H"))}
        if config.get("mlp_bias"):
            shapes |= {at + f"mlp.{n}_proj.bias": (r,) for n, r in (("gate", "I"), ("up", "I"), ("down", "H"))}
    return shapes
