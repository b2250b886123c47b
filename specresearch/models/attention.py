"""Which attention each layer of a transformers model applies, and the masks :class:`CausalLM` hands it.

Why the wrapper builds masks itself: a tree call (each node sees its ancestors, not its siblings) and a cache with
masked slots inside it (rows that rolled back different counts) need a mask transformers cannot make from a 2-D
padding mask. transformers passes a 4-D mask through unchanged (``masking_utils._preprocess_mask_arguments``), and
then each kernel treats it its own way:

* ``eager`` *adds* it to the scores (``scores + mask``): a boolean mask adds 1 / 0 and masks nothing, so the mask
  must be additive, 0 where attended and the dtype's lowest value elsewhere (the lowest finite
  value, not -inf: a row that sees nothing -- a pad slot's query -- then stays finite, and its values cannot turn the
  other rows' products into NaN);
* ``sdpa`` (and the wrapper's own :func:`cpu_sdpa_attention` /
  :func:`packed_sdpa_attention`) takes an additive mask as well;
* ``flash_attention_2/3`` (and the paged kernels) take no 4-D mask at all: they apply causal order over the physical
  slots and a 2-D padding mask. No tree, no masked slot inside the cache;
* ``flex_attention`` adds a 4-D mask too (transformers' ``score_mod``), but on the CPU torch 2.13's compiled flex
  kernel fails: a batched call with a padding mask does not compile (inductor's CPU template), and one with a 4-D
  tensor mask corrupted the process's heap (both seen with torch 2.13 on this project's 2-core CPU; tiny Llama and
  Mistral models). On CUDA it is untested here.

:func:`exact_kernel` switches a model on any kernel but the first three to ``sdpa`` (``eager`` where the model has no
``sdpa``), with a warning, or refuses where it may not change the model.

Sliding windows (Mistral, Gemma-2/3's local layers, Qwen2 with ``use_sliding_window``, Phi-3): a windowed layer sees
the keys whose *position* lies within ``window`` of the query's (``q - k < window``: transformers'
``masking_utils.sliding_window_overlay``). transformers counts that distance in physical cache slots, which is the
position distance only when no slot inside the cache is masked; in a tree a node's slot is not its position either.
So the wrapper applies every window itself, from each slot's position (``SlotMask.positions``), and keeps every slot
of the context in a full cache layer (transformers' sliding layers keep the last ``window`` slots and cannot be
rolled back past them): a windowed layer's call reads the whole context, masked, instead of the window. That costs
nothing while the context is shorter than the window (the figures of docs/engine_and_models.md), and memory and
attention time linear in the context past it. Layer types are transformers' own
(``cache_utils.get_layer_types_and_kwargs``); recurrent ones (``linear_attention``, ``hybrid``) are
``models.recurrent``'s. Llama 4's chunked layers see the keys of the query's own chunk of positions (``q // chunk ==
k // chunk``: transformers' ``chunked_overlay`` counted from a row's first token), applied here from positions like a
window, over a full cache layer. DeepSeek Sparse Attention's ``indexed_attention`` layers (DeepSeek-V3.2, GLM-5) are
masked as full attention: transformers' indexer adds the mask to its scores before it keeps each query's top-k keys,
and the cache keeps its keys (``DynamicIndexedLayer``). A layer that reuses an earlier layer's K and V (Gemma 3n,
Gemma 4: transformers' "dummy" type) needs nothing: it is handed the storing layer's whole K and V and its own type's
mask; a ``hybrid_sliding`` layer (a recurrent state and windowed attention: Inkling) takes the ``sliding_attention``
mask. A model of another family whose config names chunked or indexed layers is refused, as is any other type
(compressed attention), with one line. So is a model whose attention places a key by its slot in the cache rather
than by the position ids the wrapper passes: in a tree or after a rollback its logits would be wrong without an error.
The ALiBi of Bloom, Falcon-RW and MPT and GPT-Neo's windowed local layers place keys by slot, Llama 4's layers
without RoPE scale their queries by the slot count (its temperature tuning), and Inkling's relative bias (and Inkling
1's log scaling) counts slots; :func:`positions_from_masks` makes them read positions off the masks (Llama 4: off the
position ids) instead. (A model without a KV cache, GPT-1, is refused
by ``causal_lm.cache_argument``.)

Attention of such calls: every call that scores 2 or more cached tokens carries a mask, and under a
mask transformers' ``"sdpa"`` attention copies K and V once per query group of a grouped-query model
(SmolLM2: 9 heads over 3) to keep CUDA's fused kernels, and a query whose last axis is strided (the
transposed output of ``(W @ x^T)^T``) sends the CPU kernel down its slow unfused path. So
``kernels.skinny_linear`` returns row-major outputs and ``CausalLM`` on CPU switches ``"sdpa"`` to
:func:`cpu_sdpa_attention`, which hands the groups to the fused kernel: a two-token call of the embedded
target then costs about what a one-token call costs (it cost 5-6 ms more, ~10%). On CUDA, where a step is
bound by the host's torch calls rather than by the copy, ``CausalLM`` switches it to :func:`packed_sdpa_attention`,
which packs each group's query heads into one head instead (6 calls a layer instead of 10).

A model with one kind of layer takes one mask ``[B, 1, q, L]``; one with full and sliding layers (Gemma-2/3, Qwen2
with ``max_window_layers``) takes transformers' mapping ``{layer type: mask}``, which those models accept in place of
a 2-D mask.
"""

from __future__ import annotations

import copy
import math
import sys
import warnings
from dataclasses import dataclass
from functools import partial

import torch

from specresearch.models.recurrent import RECURRENT_TYPES

__all__ = ["AttentionLayout", "attention_layout", "exact_kernel", "additive_mask", "MASKED_KERNELS", "CPU_SDPA", "PACKED_SDPA",
           "cpu_sdpa_attention", "packed_sdpa_attention", "use_cpu_sdpa", "use_packed_sdpa", "additive_sdpa_mask",
           "positions_from_masks"]

# Kernels that apply a 4-D additive mask as given (transformers' own and the two CausalLM registers on CPU / CUDA).
MASKED_KERNELS = ("eager", "sdpa", "specresearch_cpu_sdpa", "specresearch_packed_sdpa")
_WHY = {"flex_attention": "whose compiled kernel fails on batched masked calls on the CPU (torch 2.13) and is not "
                          "tested with a tree mask on CUDA"}
_LAYER_TYPES = ("full_attention", "sliding_attention")
CHUNKED_FAMILIES = ("llama4_text",)  # model types whose forward masks "chunked_attention" layers by chunk (Llama 4)
# model types whose "indexed_attention" layers (DeepSeek Sparse Attention) pick keys by an indexer that reads the mask
INDEXED_FAMILIES = ("deepseek_v32", "glm_moe_dsa")


@dataclass(frozen=True)
class AttentionLayout:
    """The attention of one model: its kernel and, per transformers layer type, the sliding window (None: full)."""

    kernel: str
    # ((layer type, window or None), ...) in order of first use; a "chunked_attention" type's number is its chunk
    windows: tuple[tuple[str, int | None], ...]
    recurrent: bool = False  # some layers keep recurrent state (models.recurrent): they read the 2-D mask
    attends: bool = True  # some layer attends over the cache's slots (False: Mamba, Mamba-2: recurrent layers only)
    indexed: bool = False  # DeepSeek Sparse Attention: its cache layers keep the indexer's keys beside K and V

    @property
    def windowed(self) -> bool:
        """Whether any layer has a sliding window or chunks (then every call gets a mask built here)."""
        return any(window is not None for _, window in self.windows)

    def masks(self, allowed: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor,
              dtype: torch.dtype):
        """The masks of one call: ``allowed [B, q, L]`` (slot j visible to query i, windows aside), the queries'
        positions ``[B, q]`` and every slot's ``[B, L]`` -> an additive ``[B, 1, q, L]`` mask in ``dtype``, or the
        mapping {layer type: mask} for a model with several layer types."""
        distance = query_positions[:, :, None] - key_positions[:, None, :]  # [B, q, L]

        def reach(kind: str, window: int | None) -> torch.Tensor:
            if window is None:
                return allowed
            if kind == "chunked_attention":  # Llama 4: the keys of the query's own chunk of positions
                return allowed & (query_positions[:, :, None] // window == key_positions[:, None, :] // window)
            return allowed & (distance < window)

        made = {kind: additive_mask(reach(kind, window), dtype) for kind, window in self.windows}
        return next(iter(made.values())) if len(made) == 1 else made


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``allowed [B, q, L]`` bool -> ``[B, 1, q, L]``: 0 where attended, ``dtype``'s lowest value elsewhere, or
    float32's for a wider dtype: ``eager`` takes its softmax in float32, where float64's lowest value is -inf, and a
    pad slot's query, which sees nothing, would turn its row into NaN (module docstring)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, _lowest(dtype))[:, None]


def _lowest(dtype: torch.dtype) -> float:
    """The value a mask puts where a key is not seen: ``dtype``'s lowest, or float32's for a wider dtype (eager's
    float32 softmax reads float64's as -inf, and a query that sees nothing turns NaN)."""
    return max(torch.finfo(dtype).min, torch.finfo(torch.float32).min)


def attention_layout(model) -> AttentionLayout:
    """The layout of a transformers model (module docstring); ``ValueError`` naming the model and the layer type
    for layers this wrapper cannot mask exactly."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    config = model.config.get_text_config(decoder=True)
    reads_slots = _positions_from_slots(model, config)
    if reads_slots:
        raise ValueError(f"{_name(model)} {reads_slots}, not from the positions CausalLM passes: in a draft tree, a "
                         "rolled-back row or a static cache a token's slot is not its position, and its logits would "
                         "be wrong: use a model of another family")
    kinds, options = get_layer_types_and_kwargs(config)
    if isinstance(options, dict):  # older transformers (5.17): one kwargs mapping for every layer, not one per layer
        options = [options] * len(kinds)
    if not kinds:
        raise ValueError(f"{_name(model)}: transformers names no attention layer types for it")
    windows: dict[str, int | None] = {}
    recurrent = any(kind in RECURRENT_TYPES for kind in kinds)
    for kind, option in zip(kinds, options):
        if kind == "hybrid_sliding":  # a recurrent state and windowed attention in one layer (Inkling): the
            kind = "sliding_attention"  # attention's mask is the model's "sliding_attention" one
        elif kind == "hybrid" and any(k == "hybrid_sliding" for k in kinds):
            kind = "full_attention"  # beside windowed hybrids, the others' mask is the model's "full_attention" one
        elif kind in RECURRENT_TYPES or kind == "dummy":  # models.recurrent's; an MLP-only layer ("mlp" / "moe"), or
            continue  # one reading the K / V its type's storing layer keeps (KV sharing: Gemma 3n, Gemma 4), masked by its type
        if kind == "indexed_attention" and config.model_type in INDEXED_FAMILIES:  # masked as full attention:
            windows.setdefault(kind, None)  # the indexer adds the mask to its scores before its top-k
            continue
        if kind == "chunked_attention" and config.model_type in CHUNKED_FAMILIES:
            window = option.get("sliding_window")  # transformers' cache kwargs carry the chunk as sliding_window
            if not window or windows.setdefault(kind, window) != window:
                raise ValueError(f"{_name(model)} has chunked layers of chunk sizes {window!r} and "
                                 f"{windows.get(kind)!r}: CausalLM takes one")
            continue
        if kind not in _LAYER_TYPES:
            raise ValueError(f"{_name(model)} has {kind!r} layers; CausalLM masks full and sliding-window attention "
                             f"only ({', '.join(_LAYER_TYPES)}; Llama 4's chunked_attention): use a model of another family")
        window = option.get("sliding_window") if kind == "sliding_attention" else None
        if kind == "sliding_attention" and not window:
            raise ValueError(f"{_name(model)} has sliding-window layers without a window (sliding_window={window!r})")
        if windows.setdefault(kind, window) != window:
            raise ValueError(f"{_name(model)} has {kind!r} layers with different windows; CausalLM takes one per type")
    attends = any(kind not in ("linear_attention", "conv", "dummy") for kind in kinds)  # "hybrid" attends too
    return AttentionLayout(model.config._attn_implementation, tuple(windows.items()), recurrent, attends,
                           "indexed_attention" in windows)


def _positions_from_slots(model, config) -> str | None:
    """What a model's attention takes token positions from where it is not the position ids and additive mask the
    wrapper hands it, or None: the ALiBi of Bloom, Falcon-RW (Falcon with ``alibi``) and MPT and GPT-Neo's local
    layers place a key by its slot until :func:`positions_from_masks` has mended them, Llama 4's NoPE layers scale
    their queries by it."""
    kind = getattr(config, "model_type", "")
    if any(not getattr(module, _MENDED, False) for module in _slot_placed(model)):
        if kind == "llama4_text":
            return "scales the queries of its layers without RoPE by each token's slot in the cache"
        if kind == "gpt_neo":
            return "windows its local layers over cache slots (its attention's own causal buffer)"
        if kind == "mpt":
            return "computes ALiBi from each key's slot in the cache"
        if kind.startswith("inkling"):
            return "takes its relative position bias (and log-scaled queries) from each key's and query's slot"
        return "places each key by counting the unmasked slots before it (ALiBi from a 2-D padding mask)"
    return None


_MENDED = "specresearch_positions_from_masks"  # set on each module positions_from_masks has mended


def positions_from_masks(model) -> bool:
    """Make the ALiBi of Bloom, Falcon-RW and MPT and GPT-Neo's local windows place each key by its position; whether
    ``model`` needed it.

    All four read a key's position off its slot: Bloom and Falcon-RW build ALiBi (``slope * key position``) from a
    2-D padding mask (a tree's 4-D mask fails with "too many values to unpack"), MPT's attention adds
    ``slope * (slot - last slot)`` (one ``[heads, 1, slots]`` bias for every row, which no batch axis can correct),
    GPT-Neo's local layers apply their window (``q - k < window_size``) from a causal buffer of their own over the
    cache's slots; in a tree, after a row's rollback or in a static cache a slot is not a position. Every mask the
    wrapper (or transformers, from a 2-D padding mask) builds lets a query see exactly one key at each position from
    0 to its own, in slot order, so the mask itself gives each key's position: the number of keys a query sees before
    it, and ``q - k`` the number it sees after. So Bloom's model builds its ALiBi from a 4-D mask that way (a 2-D one
    as before); Falcon-RW's model leaves ALiBi out and each of its layers adds it to the mask it is handed (a forward
    pre-hook, with transformers' slopes, rounding and scale); each of MPT's attentions runs :func:`_mpt_attention`,
    transformers' computation with the bias ``slope * (position - the row's last position)`` (equal to MPT's own
    where slots are positions, and a softmax ignores a constant per row in any case); each of GPT-Neo's local
    attentions takes the global layers' buffer (causal over slots, which the wrapper's masks make exact) and a
    pre-hook that narrows its mask to the window. Where transformers builds the mask itself nothing changes but MPT's
    masked value in float64 (float32's lowest, as :func:`additive_mask`). Llama 4's attentions without RoPE scale
    their queries by ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` with ``p`` the cache's slot count plus
    the token's index in the call; each gets the scale from the position ids its decoder layer is handed instead (a
    pre-hook on the layer keeps them, a hook on ``q_proj`` scales its output). Inkling's attentions gather a relative
    bias at ``query slot - key slot`` (Inkling 2: the model's one ``relative_distance`` for every row) and Inkling 1's
    full layers scale queries and bias by ``tau`` of the query's slot count (:func:`_mend_inkling`); each takes the
    distances (and ``p + 1``, the keys a full layer's query sees) from its mask. A model of another family is left as
    it is."""
    modules = _slot_placed(model)
    for module in modules:
        if getattr(module, _MENDED, False):
            continue
        if hasattr(module, "build_alibi_tensor"):  # Bloom's model
            own = module.build_alibi_tensor
            module.build_alibi_tensor = partial(_alibi_from_mask, own, _slopes(own, module, module.num_heads))
        elif hasattr(module, "use_alibi"):  # Falcon-RW's model: its layers add ALiBi
            module.use_alibi = False
        elif hasattr(module, "Wqkv"):  # one of MPT's attentions
            build = sys.modules[type(module).__module__].build_mpt_alibi_tensor  # as MPT's model calls it
            slopes = -build(module.n_heads, 2, device=next(module.parameters()).device)[:, 0, 0]  # bias at -1
            module.forward = partial(_mpt_attention, module, slopes=slopes)
        elif hasattr(module, "self_attention"):  # one of Falcon-RW's layers
            config = model.config
            build = sys.modules[type(module).__module__].build_alibi_tensor
            module.register_forward_pre_hook(partial(_falcon_alibi, slopes=_slopes(build, module, module.num_heads),
                                                     scale=math.sqrt(config.hidden_size // config.num_attention_heads)),
                                             with_kwargs=True)
        elif hasattr(module, "relative_position_bias"):  # one of Inkling 2's attentions: distances from its mask
            module.register_forward_pre_hook(_inkling2_distances, with_kwargs=True)
        elif hasattr(module, "rel_logits_proj"):  # one of Inkling's attentions: distances and log scale from its mask
            _mend_inkling(module)
        elif hasattr(module, "floor_scale"):  # one of Llama 4's NoPE attentions: its query scale from positions
            module.attn_temperature_tuning = False
            layer = next(layer for layer in model.modules() if getattr(layer, "self_attn", None) is module)
            layer.register_forward_pre_hook(partial(_llama4_positions, attention=module), with_kwargs=True)
            module.q_proj.register_forward_hook(partial(_llama4_query_scale, attention=module))
        else:  # one of GPT-Neo's local attentions
            module.bias = torch.tril(torch.ones_like(module.bias))
            module.register_forward_pre_hook(partial(_windowed_mask, window=model.config.window_size),
                                             with_kwargs=True)
        setattr(module, _MENDED, True)
    return bool(modules)


def _slot_placed(model) -> list:
    kind = getattr(model.config, "model_type", "")
    if kind == "bloom":
        return [module for module in model.modules() if type(module).__name__ == "BloomModel"]
    if kind == "falcon" and getattr(model.config, "alibi", False):
        return [module for module in model.modules() if type(module).__name__ in ("FalconModel", "FalconDecoderLayer")]
    if kind == "mpt":
        return [module for module in model.modules() if type(module).__name__ == "MptAttention"]
    if kind == "gpt_neo":
        return [module for module in model.modules()
                if getattr(module, "attention_type", None) == "local" and hasattr(module, "bias")]
    if kind in ("inkling", "inkling_text"):
        return [module for module in model.modules() if type(module).__name__ == "InklingAttention"]
    if kind.startswith("inkling2"):
        return [module for module in model.modules() if hasattr(module, "relative_position_bias")]
    if kind == "llama4_text":
        return [module for module in model.modules() if type(module).__name__ == "Llama4TextAttention"
                and getattr(module, "attn_temperature_tuning", False) and not module.use_rope]
    return []


def _key_positions(seen: torch.Tensor) -> torch.Tensor:
    """``seen [B, q, L]`` (0 / 1, the keys each query sees) -> each key's position ``[B, L]`` (0 where none sees it)."""
    return ((seen.cumsum(-1) - 1) * seen).amax(1)


def _visible(mask: torch.Tensor) -> torch.Tensor:
    """A 4-D mask, additive (0 where attended) or boolean -> ``[B, 1, q, L]`` bool, True where attended."""
    return mask == 0 if mask.is_floating_point() else mask.bool()


def _slopes(build, module, num_heads: int) -> torch.Tensor:
    """Each head's ALiBi slope as transformers' ``build`` (mask, heads, dtype) makes it: its bias at position 1, on
    ``module``'s device."""
    ones = torch.ones(1, 2, dtype=torch.long, device=next(module.parameters()).device)
    return build(ones, num_heads, torch.float32)[:, 0, 1]


def _alibi_from_mask(own, slopes: torch.Tensor, attention_mask: torch.Tensor, num_heads: int,
                     dtype: torch.dtype) -> torch.Tensor:
    if attention_mask.ndim != 4:
        return own(attention_mask, num_heads, dtype)
    positions = _key_positions(_visible(attention_mask)[:, 0].long())
    slopes = slopes.to(attention_mask.device)
    alibi = slopes[None, :, None] * positions[:, None, :]  # [B, H, L], as transformers' (float32, then dtype)
    return alibi.reshape(-1, 1, positions.shape[-1]).to(dtype)


def _falcon_alibi(module, args, kwargs, *, slopes: torch.Tensor, scale: float):
    mask = kwargs.get("attention_mask")
    if mask is None:
        raise ValueError(f"{type(module).__name__}: an ALiBi layer needs the attention mask to place its keys")
    visible = _visible(mask)[:, :1]  # [B, 1, q, L]
    positions = _key_positions(visible[:, 0].long())
    dtype = (args[0] if args else kwargs["hidden_states"]).dtype
    # transformers' Falcon: bfloat16 slopes times positions, then the model's dtype, scaled, masked (float64's mask
    # value as additive_mask's, which eager's float32 softmax reads as finite)
    alibi = (slopes.to(mask.device).bfloat16()[None, :, None] * positions[:, None, :]).to(dtype)[:, :, None, :] / scale
    mask = alibi.masked_fill(~visible, _lowest(dtype))  # [B, H, q, L]
    return args, {**kwargs, "attention_mask": mask}


def _mpt_attention(module, hidden_states: torch.Tensor, position_bias=None, cache=None, attention_mask=None, *,
                   slopes: torch.Tensor, **kwargs):
    """transformers' ``MptAttention.forward`` (5.25) with each key's ALiBi from its position (:func:`positions_from_masks`):
    ``attention_mask`` is the boolean ``[B, 1, q, L]`` mask MPT's model makes of the additive one, True where masked;
    ``position_bias`` (by slot) is not read."""
    if attention_mask is None:
        raise ValueError(f"{type(module).__name__}: an ALiBi layer needs the attention mask to place its keys")
    batch, length = hidden_states.shape[:2]
    mixed = module.Wqkv(hidden_states)
    if module.clip_qkv:
        mixed = mixed.clamp(min=-module.clip_qkv, max=module.clip_qkv)
    query, key, value = (part.reshape(batch, length, module.n_heads, module.head_dim).transpose(1, 2)
                         for part in mixed.chunk(3, dim=2))
    if cache is not None:
        key, value = cache.update(key, value, module.layer_idx)
    scores = torch.matmul(query, key.transpose(-1, -2)) * module.softmax_scale
    positions = _key_positions((~attention_mask[:, 0]).long())  # [B, L]
    relative = positions - positions.amax(-1, keepdim=True)  # MPT's slot - last slot, where slots are positions
    scores = scores + relative[:, None, None, :].to(torch.int32) * slopes.to(scores.device)[None, :, None, None]
    scores = scores.masked_fill(attention_mask, _lowest(query.dtype))
    weights = torch.nn.functional.softmax(scores.float(), dim=-1).to(value.dtype)
    weights = torch.nn.functional.dropout(weights, p=module.attn_dropout_p, training=module.training)
    context = torch.matmul(weights, value).permute(0, 2, 1, 3).contiguous().view(batch, length, -1)
    return module.out_proj(context), weights


def _llama4_positions(layer, args, kwargs, *, attention):
    """Keep the positions a Llama 4 decoder layer is handed for its NoPE attention's query scale."""
    attention.specresearch_positions = kwargs["position_ids"]


def _llama4_query_scale(q_proj, args, output, *, attention):
    """transformers' Llama 4 temperature tuning (``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` on a NoPE
    layer's queries) with ``p`` each token's position; transformers takes the cache's slot count."""
    positions = attention.specresearch_positions.float()
    scales = torch.log1p(torch.floor((positions + 1.0) / attention.floor_scale)) * attention.attn_scale + 1.0
    return (output * scales[..., None]).to(output.dtype)


def _distances(mask: torch.Tensor) -> torch.Tensor:
    """A 4-D mask -> ``[B, 1, q, L]``: how many positions back each key a query sees lies (the keys it sees after
    it), -1 where it sees none."""
    seen = _visible(mask)[:, :1].long()
    return (seen.flip(-1).cumsum(-1).flip(-1) - 1).masked_fill(seen == 0, -1)


def _inkling2_distances(module, args, kwargs):
    """Inkling 2's attentions take ``relative_distance`` (query slot minus key slot, one ``[q, L]`` for every row) from
    the model; each gets the distances its own mask gives instead, per row (the bias broadcasts over heads)."""
    mask = kwargs.get("attention_mask")
    if mask is None or mask.ndim != 4:
        return None  # transformers' own causal mask over a row's slots: slots are positions
    return args, {**kwargs, "relative_distance": _distances(mask)}


def _mend_inkling(module) -> None:
    """Inkling's attention measures its relative bias's distances, and the position its full layers' log scaling
    (``tau = 1 + alpha * log(max((p + 1) / n_floor, 1))`` on queries and bias) reads, in cache slots; a pre-hook keeps
    each call's distances and positions from its mask, ``rel_logits_proj`` gathers the bias at those distances and
    scales it, a hook on ``q_norm`` scales the queries, and the module reads a copy of the config without the scaling."""
    config = module.config
    scaled = not module.is_sliding and config.log_scaling_n_floor is not None
    if scaled:
        module.config = copy.copy(config)
        module.config.log_scaling_n_floor = None
        module.q_norm.register_forward_hook(partial(_inkling_query_scale, attention=module))
    module.specresearch_tau = (config.log_scaling_alpha, config.log_scaling_n_floor) if scaled else None
    module.register_forward_pre_hook(_inkling_positions, with_kwargs=True)
    own = module.rel_logits_proj
    own.forward = partial(_inkling_bias, own, own.forward, attention=module)


def _inkling_positions(module, args, kwargs):
    mask, cache = kwargs.get("attention_mask"), kwargs.get("cache")
    hidden = args[0] if args else kwargs["hidden_states"]
    if mask is not None and mask.ndim == 4:
        distances = _distances(mask)
        module.specresearch_inkling = distances, (distances >= 0).sum(-1)  # [B, 1, q, L]; each query's position + 1
    else:  # transformers' own causal mask over a row's slots: the slots are the positions, as Inkling counts them
        offset = cache.get_query_offset(module.layer_idx) if cache is not None else 0
        module.specresearch_inkling = None, torch.arange(1, hidden.shape[1] + 1, device=hidden.device)[None, None] + offset


def _inkling_tau(attention, counts: torch.Tensor) -> torch.Tensor:
    alpha, floor = attention.specresearch_tau
    return 1.0 + alpha * torch.log((counts.float() / floor).clamp(min=1.0))  # [B, 1, q]


def _inkling_bias(proj, own, relative_states, query_positions, key_positions, *, attention):
    distances, counts = attention.specresearch_inkling
    if distances is None:
        bias = own(relative_states, query_positions, key_positions)
    else:
        logits = (relative_states @ proj.proj).transpose(1, 2)  # [B, H, q, extent]
        index = distances.clamp(0, proj.rel_extent - 1).expand(*logits.shape[:2], -1, -1)
        bias = logits.gather(-1, index).masked_fill((distances < 0) | (distances >= proj.rel_extent), 0.0)
    if attention.specresearch_tau is None:
        return bias
    return (bias.float() * _inkling_tau(attention, counts)[..., None]).to(bias.dtype)


def _inkling_query_scale(q_norm, args, output, *, attention):
    """``q_norm``'s output ``[B, q, H, D]`` times each query's ``tau``."""
    tau = _inkling_tau(attention, attention.specresearch_inkling[1])  # [B, 1, q]
    return (output.float() * tau.transpose(1, 2)[..., None]).to(output.dtype)


def _windowed_mask(module, args, kwargs, *, window: int):
    mask = kwargs.get("attention_mask")
    if mask is None:
        raise ValueError(f"{type(module).__name__}: a local layer needs the attention mask to apply its window")
    seen = _visible(mask).long()
    after = seen.flip(-1).cumsum(-1).flip(-1) - seen  # the keys seen after each slot: how many positions back it lies
    outside = seen.bool() & (after >= window)
    if mask.is_floating_point():
        mask = mask.masked_fill(outside, _lowest(mask.dtype))
    else:
        mask = mask & ~outside
    return args, {**kwargs, "attention_mask": mask}


def exact_kernel(model, *, may_switch: bool = True) -> str | None:
    """Make sure ``model``'s attention kernel applies the wrapper's masks (module docstring): a kernel that takes no
    4-D mask is switched to ``sdpa`` (``eager`` where the model has none) with a warning, or, with ``may_switch=False``
    (the caller's model must stay as it is), refused with one line naming the model, the kernel and what to pass.
    Returns the kernel switched from, or None."""
    kernel = model.config._attn_implementation
    if kernel in MASKED_KERNELS:
        return None
    to = "sdpa" if getattr(model, "_supports_sdpa", False) else "eager"
    reason = _WHY.get(kernel, "which takes no 4-D mask (no draft tree, no masked slot inside the cache)")
    why = f"{_name(model)} uses attention {kernel!r}, {reason}"
    if not may_switch:
        raise ValueError(f"{why}: load it with attn_implementation={to!r} (or 'eager')")
    model.set_attn_implementation(to)
    if model.config._attn_implementation != to:
        raise ValueError(f"{why}, and it cannot be switched to {to!r}: load it with attn_implementation={to!r}")
    warnings.warn(f"{why}: switched to {to!r}, which is exact (load it with attn_implementation={to!r} to silence "
                  "this)", stacklevel=3)
    return kernel


def _name(model) -> str:
    path = getattr(model.config, "_name_or_path", "") or ""
    return f"{type(model).__name__}{f' ({path})' if path else ''}"


CPU_SDPA = "specresearch_cpu_sdpa"  # the attention implementation CausalLM selects on CPU (cpu_sdpa_attention)


def cpu_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs):
    """transformers' ``"sdpa"`` attention, except that a masked call of a grouped-query layer on CPU hands the
    groups to the kernel (``enable_gqa``) instead of copying K and V once per group.

    transformers copies them whenever a mask is given (CUDA's fused kernels take grouped heads only without a
    mask), and every call that scores 2 or more cached tokens has a mask. On CPU the fused kernel takes both,
    so the copy (2 x layers x heads x context x head_dim floats per call) is pure cost. Any other call (no
    mask, no groups, another device, position bias, soft-capping, attention weights asked) goes to
    transformers' own function. Inputs ``query [B, h, q, d]``, ``key / value [B, kv, S, d]``; returns
    ``([B, q, h, d], None)`` as transformers' attention functions do.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    special = _special(kwargs)
    if attention_mask is None or groups == 1 or query.device.type != "cpu" or special or key.shape[-1] != value.shape[-1]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                                           scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


PACKED_SDPA = "specresearch_packed_sdpa"  # the attention CausalLM selects on CUDA (packed_sdpa_attention)


def packed_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                          is_causal: bool | None = None, **kwargs):
    """transformers' ``"sdpa"`` attention, except that a masked call of a grouped-query layer packs each group's
    query heads into one head of ``groups x q`` queries (and the mask alike) instead of copying K and V once per
    group. Any device; meant for CUDA, whose fused kernels take grouped heads only without a mask.

    The same scores and outputs: query head ``h`` reads K / V head ``h // groups`` either way. A GPU step is
    bound by the host issuing its torch calls (``benchmarks/bench_step_ops.py``): this takes 6 a layer where
    transformers' copies take 10, 120 fewer per call of the embedded target. Any other call (no mask, no groups,
    a mask per head that is not one per query head, position bias, soft-capping, attention weights asked) goes
    to transformers' own function. Inputs ``query [B, h, q, d]``, ``key / value [B, kv, S, d]``, ``attention_mask
    [B or 1, 1 or h, q, S]``; returns ``([B, q, h, d], None)`` as transformers' attention functions do.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    special = _special(kwargs)
    batch, heads, length, dim = query.shape
    if (attention_mask is None or groups == 1 or special or key.shape[-1] != value.shape[-1]
            or attention_mask.ndim != 4 or attention_mask.shape[1] not in (1, heads)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    packed = query.reshape(batch, heads // groups, groups * length, dim)  # head j * groups + r -> rows r * q + t
    if attention_mask.shape[1] == 1:
        mask = attention_mask.repeat(1, 1, groups, 1)
    else:
        mask = attention_mask.expand(batch, -1, -1, -1).reshape(batch, heads // groups, groups * length, -1)
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)
    # reshape, not view: CUDA's memory-efficient kernel (float32 there) returns [B, h, q, d] strided as [B, q, h, d]
    return out.reshape(batch, heads, length, dim).transpose(1, 2).contiguous(), None


def _special(kwargs) -> bool:
    """Whether an attention call asks for what only transformers' own function does."""
    return any(kwargs.get(name) is not None for name in ("position_bias", "cache", "softcap")) or bool(kwargs.get("output_attentions"))


def use_cpu_sdpa(model) -> bool:
    """Switch a transformers model that uses ``"sdpa"`` attention to :func:`cpu_sdpa_attention` (registered with
    transformers as ``CPU_SDPA``, with :func:`additive_sdpa_mask`); returns whether it was switched."""
    return _use_attention(model, CPU_SDPA, cpu_sdpa_attention, additive_sdpa_mask)


def additive_sdpa_mask(*args, dtype: torch.dtype = torch.float32, **kwargs) -> torch.Tensor | None:
    """transformers' sdpa mask (None where a call needs none), a boolean one made additive once per forward: 0 where
    attended, -inf elsewhere, in the activations' ``dtype``. ``scaled_dot_product_attention`` makes exactly this of a
    boolean mask itself, but in every layer: ~30 µs a layer on the AVX2 EPYC, ~1 ms of a two-token call of the
    embedded target."""
    from transformers.masking_utils import sdpa_mask

    mask = sdpa_mask(*args, **kwargs)
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def use_packed_sdpa(model) -> bool:
    """Switch a transformers model that uses ``"sdpa"`` attention to :func:`packed_sdpa_attention` (registered
    as ``PACKED_SDPA``, with transformers' sdpa masks); returns whether it was switched."""
    return _use_attention(model, PACKED_SDPA, packed_sdpa_attention)


def _use_attention(model, name: str, function, mask=None) -> bool:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    if getattr(model.config, "model_type", "") in INDEXED_FAMILIES:  # DeepSeek Sparse Attention masks its top-k
        return False  # keys under transformers' eager and sdpa only; other functions get indices they do not read
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, mask or sdpa_mask)
    model.set_attn_implementation(name)
    return True
