"""EAGLE-3 heads as their repository saves them: load, run in the engine, save the toolkit's own layout into theirs.

The format, read from SafeAILab/EAGLE at commit cb7e084 (Li et al. 2025, EAGLE-3, arXiv 2503.01840); our code,
their facts:

* a directory with ``config.json`` (a Llama config plus ``draft_vocab_size``, optionally ``target_hidden_size``;
  ``eagle/model/ea_model.py`` l. 118-123 reads it as ``EConfig``) and ``model.safetensors`` or ``pytorch_model.bin``
  (l. 124-135);
* tensors (``eagle/model/cnets.py``, ``Model.__init__``, l. 478-541): ``fc.weight [H, 3 * H_target]`` (no bias),
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

:class:`Eagle3Head` has :class:`~specresearch.drafts.feature.FeatureHead`'s drafting interface (``block``,
``logits``, ``fuse_features``, ``layers``), so :class:`Eagle3Draft` is a ``FeatureDraft`` with its first slots masked.
:func:`save_eagle3` writes an :class:`Eagle3Head` in the repository's layout. The toolkit's own trained head
(``drafts.feature.FeatureHead``) is another architecture (``fc`` over ``[g, embedding]`` with a bias, no
``hidden_norm``, attention over H), so it has no exact EAGLE-3 form: what the toolkit trains reaches other engines
once the training loop trains an :class:`Eagle3Head` (docs/feature_drafts.md, "Published formats").
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from specresearch.drafts.distilled import SubsetHead
from specresearch.drafts.feature import _MLP, FeatureDraft, _RMSNorm, _rotate_half

__all__ = ["EAGLE3_TENSORS", "Eagle3Head", "Eagle3Draft", "is_eagle3_dir", "load_eagle3", "save_eagle3",
           "eagle3_feature_layers"]

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

    def __init__(self, hidden: int, heads: int, kv_heads: int, intermediate: int, eps: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.hidden_norm, self.input_layernorm = _RMSNorm(hidden, eps), _RMSNorm(hidden, eps)
        self.post_attention_layernorm = _RMSNorm(hidden, eps)
        self.self_attn = torch.nn.Module()
        for name, rows in (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads)):
            setattr(self.self_attn, name, torch.nn.Linear(2 * hidden, rows * self.head_dim, bias=False))
        self.self_attn.o_proj = torch.nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.mlp = _MLP(hidden, intermediate, bias=False)

    def forward(self, g, embedding, cos, sin, past, allowed):
        """``g, embedding [B, k, H]``; ``past``: earlier (keys, values) ``[B, kv, S, d]`` or None; ``allowed [B, k,
        S + k]``. -> (``h [B, k, H]``, (keys, values) with this block's appended)."""
        B, k, _ = g.shape
        x = torch.cat([self.input_layernorm(embedding), self.hidden_norm(g)], dim=-1)
        attn = self.self_attn
        q = attn.q_proj(x).view(B, k, self.heads, self.head_dim).transpose(1, 2)
        keys = attn.k_proj(x).view(B, k, self.kv_heads, self.head_dim).transpose(1, 2)
        values = attn.v_proj(x).view(B, k, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q, keys = q * cos + _rotate_half(q) * sin, keys * cos + _rotate_half(keys) * sin
        if past is not None:
            keys, values = torch.cat([past[0], keys], dim=2), torch.cat([past[1], values], dim=2)
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=allowed[:, None],
                                                               enable_gqa=self.heads != self.kv_heads)
        h = g + attn.o_proj(out.transpose(1, 2).reshape(B, k, -1))
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

    def __init__(self, target, config: dict, token_ids: torch.Tensor | None = None,
                 embedding: torch.Tensor | None = None) -> None:
        super().__init__()
        text = target.config.get_text_config()
        H, T = int(config["hidden_size"]), int(config.get("target_hidden_size") or text.hidden_size)
        heads = int(config["num_attention_heads"])
        self.config = dict(config)
        self.hidden_size, self.vocab_size = H, int(target.get_output_embeddings().weight.shape[0])
        self.feature_layers = eagle3_feature_layers(config, text.num_hidden_layers)
        self.feature_size = len(self.feature_layers) * T
        self.fc = torch.nn.Linear(self.feature_size, H, bias=False)
        self.layers = torch.nn.ModuleList([_Eagle3Layer(H, heads, int(config.get("num_key_value_heads") or heads),
                                                        int(config["intermediate_size"]), float(config["rms_norm_eps"]))])
        self.norm = _RMSNorm(H, float(config["rms_norm_eps"]))
        draft_vocab = int(config.get("draft_vocab_size") or self.vocab_size)
        ids = torch.arange(draft_vocab) if token_ids is None else token_ids
        self.subset_head = SubsetHead(torch.zeros(draft_vocab, H), ids, self.vocab_size)
        base = float(config.get("rope_theta", 10000.0))
        scaling = config.get("rope_scaling")
        if scaling and scaling.get("type", scaling.get("rope_type")) != "linear":
            raise ValueError(f"EAGLE-3 head: rope_scaling {scaling!r} is not one this loader applies (none or linear, "
                             "as the EAGLE repository's cnets.py)")
        self.position_scale = 1.0 / float(scaling["factor"]) if scaling else 1.0
        d = H // heads
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, d, 2).float() / d), persistent=False)
        self.embed_tokens = None
        if embedding is not None:
            self.embed_tokens = torch.nn.Embedding.from_pretrained(embedding.float(), freeze=True)
        self._frozen = {"embedding": target.get_input_embeddings()}

    @property
    def draft_to_target(self) -> torch.Tensor:
        """``d2t [D]``: target id minus draft id, the repository's vocabulary map."""
        ids = self.subset_head.token_ids
        return ids - torch.arange(len(ids), device=ids.device)

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features ``[..., 3 T]`` -> ``g [..., H]``."""
        return self.fc(features)

    def raw_input_layers(self) -> list[torch.nn.Module]:
        return [self.fc]

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = (positions.float() * self.position_scale)[..., None] * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's outputs ``h [..., H]`` -> logits over the target vocabulary ``[..., V]`` (lowest value off the
        draft vocabulary)."""
        return self.subset_head(self.norm(hidden)).float()

    def support_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.subset_head.subset_logits(self.norm(hidden)), self.subset_head.index_of

    def block(self, inputs, tokens, positions, past, allowed):
        """``FeatureHead.block``: ``inputs [B, k, H]`` (g), ``tokens [B, k]`` -> (``h [B, k, H]``, [(keys, values)])."""
        table = self.embed_tokens if self.embed_tokens is not None else self._frozen["embedding"]
        with torch.no_grad():
            embedding = table(tokens).to(inputs.dtype)
        cos, sin = self.rope(positions)
        h, kv = self.layers[0](inputs, embedding, cos, sin, past[0], allowed)
        return h, [kv]

    def state_dict_eagle3(self) -> dict[str, torch.Tensor]:
        """The tensors under the repository's names (``EAGLE3_TENSORS``, ``d2t``, ``t2d``, ``embed_tokens``)."""
        layer = self.layers[0]
        tensors = {"fc.weight": self.fc.weight, "norm.weight": self.norm.weight,
                   "lm_head.weight": self.subset_head.weight}
        for name, value in layer.state_dict().items():
            tensors[f"midlayer.{name}"] = value
        if len(self.subset_head.token_ids) != self.vocab_size:
            tensors["d2t"] = self.draft_to_target
            tensors["t2d"] = self.subset_head.index_of >= 0
        if self.embed_tokens is not None:
            tensors["embed_tokens.weight"] = self.embed_tokens.weight
        return {name: value.detach().contiguous().clone() for name, value in tensors.items()}


class Eagle3Draft(FeatureDraft):
    """An :class:`Eagle3Head` behind the engine's interface: a ``FeatureDraft`` whose prompt's first slot in each row
    is masked out (EAGLE drafts from token ``x_{j+1}`` with the feature of slot j; slot 0 has none)."""

    format = "eagle3"

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        valid = attention_mask.bool()
        first = valid & (valid.long().cumsum(-1) == 1)
        queued = self._queued
        self.reset(input_ids.shape[0])
        self._queued = queued
        return self.head.logits(self._append(input_ids, valid & ~first)[:, -1])


def is_eagle3_dir(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds an EAGLE-3 head in the repository's layout (a config with ``draft_vocab_size``
    and a weights file)."""
    directory = Path(directory)
    config = directory / "config.json"
    if not config.is_file() or not _weights_file(directory):
        return False
    return "draft_vocab_size" in json.loads(config.read_text())


def _weights_file(directory: Path) -> Path | None:
    return next((p for p in (directory / "model.safetensors", directory / "pytorch_model.bin") if p.is_file()), None)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def _expected_shapes(config: dict, target_hidden: int, vocab: int) -> dict[str, tuple[int, ...]]:
    H, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    d, kv = H // heads, int(config.get("num_key_value_heads") or heads)
    sizes = {"H": H, "T": int(config.get("target_hidden_size") or target_hidden), "Q": heads * d, "K": kv * d,
             "I": int(config["intermediate_size"]), "D": int(config.get("draft_vocab_size") or vocab), "V": vocab}
    layers = len(eagle3_feature_layers(config, 1 << 20)) if config.get("eagle_aux_hidden_state_layer_ids") or (
        config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") else 3

    def size(symbol: str) -> int:
        if symbol == "3T":
            return layers * sizes["T"]
        return 2 * sizes["H"] if symbol == "2H" else sizes[symbol]

    return {name: tuple(size(s) for s in shape) for name, shape in {**EAGLE3_TENSORS, **_OPTIONAL}.items()}


def load_eagle3(target_lm, directory: str | os.PathLike, *, device=None) -> Eagle3Draft:
    """An EAGLE-3 head saved in the repository's layout (module docstring) as a draft for ``target_lm`` (a
    ``CausalLM``); a missing, unknown or misshapen tensor is refused with its name and the shape expected."""
    directory = Path(directory)
    if not is_eagle3_dir(directory):
        raise ValueError(f"{directory} is not an EAGLE-3 head: expected config.json with draft_vocab_size and "
                         "model.safetensors or pytorch_model.bin (the SafeAILab/EAGLE layout)")
    config = json.loads((directory / "config.json").read_text())
    target = target_lm.model
    text = target.config.get_text_config()
    tensors = _read_tensors(_weights_file(directory))
    expected = _expected_shapes(config, text.hidden_size, int(target.get_output_embeddings().weight.shape[0]))
    missing = sorted(set(EAGLE3_TENSORS) - set(tensors))
    unknown = sorted(set(tensors) - set(expected))
    if missing or unknown:
        raise ValueError(f"{directory}: not the EAGLE-3 layout: missing {missing}, unknown {unknown} (expected the "
                         f"tensors {sorted(EAGLE3_TENSORS)}, optionally d2t, t2d, embed_tokens.weight)")
    for name, value in tensors.items():
        if tuple(value.shape) != expected[name]:
            raise ValueError(f"{directory}: tensor {name} has shape {tuple(value.shape)}, expected {expected[name]} "
                             f"for this config and a target of hidden size {text.hidden_size}")
    draft_vocab = expected["lm_head.weight"][0]
    token_ids = None
    if "d2t" in tensors and draft_vocab != expected["t2d"][0]:
        token_ids = torch.arange(draft_vocab) + tensors["d2t"].long()
    head = Eagle3Head(target, config, token_ids, tensors.get("embed_tokens.weight"))
    with torch.no_grad():
        head.fc.weight.copy_(tensors["fc.weight"].float())
        head.norm.weight.copy_(tensors["norm.weight"].float())
        head.subset_head.weight.copy_(tensors["lm_head.weight"].float())
        head.layers[0].load_state_dict({k[len("midlayer."):]: v.float() for k, v in tensors.items()
                                        if k.startswith("midlayer.")}, strict=True)
    return Eagle3Draft(head, max_context=target_lm.max_context, device=device or target_lm.device)


def save_eagle3(head: Eagle3Head, directory: str | os.PathLike, *, safetensors: bool = True) -> Path:
    """Write ``head`` in the repository's layout (``config.json`` and ``model.safetensors`` or
    ``pytorch_model.bin``), what ``load_eagle3`` and the engines that load EAGLE-3 heads read."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {**head.config, "draft_vocab_size": len(head.subset_head.token_ids)}
    config.setdefault("architectures", ["LlamaForCausalLMEagle3"])
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = head.state_dict_eagle3()
    if safetensors:
        from safetensors.torch import save_file

        save_file(tensors, directory / "model.safetensors")
    else:
        torch.save(tensors, directory / "pytorch_model.bin")
    return directory
