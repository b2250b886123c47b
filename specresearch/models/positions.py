"""Models that place tokens by cache slot, mended to read positions off the masks ``CausalLM`` passes.

A family's attention (or embedding) may take a token's position from its slot in the cache rather than from the
position ids and
the additive mask the wrapper hands it; in a draft tree, after a row's rollback or in a static cache a slot is not a
position, and its logits would be wrong without an error (``models.attention``'s module docstring). Every mask the
wrapper (or transformers, from a 2-D padding mask) builds lets a query see exactly one key at each position from 0 to
its own, in slot order, so the mask itself gives each key's position (the keys a query sees before it) and its
distance back from the query (the keys it sees after it). :func:`positions_from_masks` mends the families that need it
(Bloom's, Falcon-RW's and MPT's ALiBi, GPT-Neo's local windows, Llama 4's query scale, Inkling's relative bias and log
scaling, the absolute positions BART's kin (and RoFormer's rotation) count from the cache's length and RoBERTa's kin
from the padding id);
:func:`slot_placement` says what an unmended one does, for ``attention_layout``'s refusal.
"""

from __future__ import annotations

import copy
import math
import sys
from functools import partial

import torch

from specresearch.models.mends import keep_hook, set_attribute

__all__ = ["positions_from_masks", "slot_placement", "masked_value", "ROBERTA_KIN", "CACHE_COUNTED"]


def masked_value(dtype: torch.dtype) -> float:
    """The value a mask puts where a key is not seen: ``dtype``'s lowest, or float32's for a wider dtype (eager's
    float32 softmax reads float64's as -inf, and a query that sees nothing turns NaN)."""
    return max(torch.finfo(dtype).min, torch.finfo(torch.float32).min)


def slot_placement(model, config) -> str | None:
    """What a model's attention takes token positions from where it is not the position ids and additive mask the
    wrapper hands it, or None once :func:`positions_from_masks` has mended it (or it needs no mend): the ALiBi of
    Bloom, Falcon-RW (Falcon with ``alibi``) and MPT and GPT-Neo's local layers place a key by its slot, Llama 4's NoPE
    layers and Inkling scale their queries by it, Inkling's bias reads distances in slots, BART's kin and RoFormer
    count positions from the cache's length, RoBERTa's kin from the padding id."""
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
        if kind in ROBERTA_KIN:
            return "numbers its positions from its padding id + 1 past the cache's slots"
        if kind in CACHE_COUNTED:
            return "embeds each token's position as the cache's slot count plus its index in the call"
        if kind == "roformer":
            return "rotates queries and keys by the cache's slot count plus each token's index in the call"
        return "places each key by counting the unmasked slots before it (ALiBi from a 2-D padding mask)"
    return None


_MENDED = "specresearch_positions_from_masks"  # set on each module positions_from_masks has mended
# decoders of encoder-decoder families as causal LMs: absolute positions counted from the cache's length
CACHE_COUNTED = ("bart", "mbart", "mvp", "plbart", "blenderbot", "blenderbot-small", "bigbird_pegasus", "marian",
                 "pegasus", "trocr")
# RoBERTa and its kin as decoders: absolute positions numbered from the padding id + 1
ROBERTA_KIN = ("roberta", "roberta-prelayernorm", "camembert", "xlm-roberta", "xlm-roberta-xl", "data2vec-text")


def positions_from_masks(model) -> bool:
    """Make the families that place tokens by cache slot (:func:`_slot_placed`) place them by position; whether
    ``model`` needed it.

    The ALiBi of Bloom, Falcon-RW and MPT and GPT-Neo's local windows read a key's position off its slot: Bloom and
    Falcon-RW build ALiBi (``slope * key position``) from a 2-D padding mask (a tree's 4-D mask fails with "too many
    values to unpack"), MPT's attention adds ``slope * (slot - last slot)`` (one ``[heads, 1, slots]`` bias for
    every row, which no batch axis can correct), GPT-Neo's local layers apply their window (``q - k < window_size``)
    from a causal buffer of their own over the cache's slots; in a tree, after a row's rollback or in a static cache
    a slot is not a position. Every mask the wrapper (or transformers, from a 2-D padding mask) builds lets a query
    see exactly one key at each position from 0 to its own, in slot order, so the mask itself gives each key's
    position: the number of keys a query sees before it, and ``q - k`` the number it sees after. So Bloom's model
    builds its ALiBi from a 4-D mask that way (a 2-D one as before); Falcon-RW's model leaves ALiBi out and each of
    its layers adds it to the mask it is handed (a forward pre-hook, with transformers' slopes, rounding and scale);
    each of MPT's attentions runs :func:`_mpt_attention`, transformers' computation with the bias ``slope *
    (position - the row's last position)`` (equal to MPT's own where slots are positions, and a softmax ignores a
    constant per row in any case); each of GPT-Neo's local attentions takes the global layers' buffer (causal over
    slots, which the wrapper's masks make exact) and a pre-hook that narrows its mask to the window. Where
    transformers builds the mask itself nothing changes but MPT's masked value in float64 (float32's lowest, as
    ``models.attention.additive_mask``). Llama 4's attentions without RoPE scale their queries by ``log1p(floor((p +
    1) / floor_scale)) * attn_scale + 1`` with ``p`` the cache's slot count plus the token's index in the call; each
    gets the scale from the position ids its decoder layer is handed instead (a pre-hook on the layer keeps them, a
    hook on ``q_proj`` scales its output). Inkling's attentions gather a relative bias at ``query slot - key slot``
    (Inkling 2: the model's one ``relative_distance`` for every row) and Inkling 1's full layers scale queries and
    bias by ``tau`` of the query's slot count (:func:`_mend_inkling`); each takes the distances (and ``p + 1``, the
    keys a full layer's query sees) from its mask. The decoders of BART's kin (:data:`CACHE_COUNTED`) embed ``cache
    length + index in the call`` as each token's position: a pre-hook keeps the positions its mask gives
    (:func:`_call_positions`) and its ``embed_positions`` embeds those. RoBERTa's kin (:data:`ROBERTA_KIN`) number a
    row's tokens from the padding id + 1 where they number them themselves: a pre-hook on the embeddings offsets the
    wrapper's position ids so. RoFormer's encoder hands every attention one rotation for ``cache length + index``;
    each gets its rows' own from its mask (:func:`_roformer_positions`). A model of another family is left as it is."""
    modules = _slot_placed(model)
    for module in modules:
        if getattr(module, _MENDED, False):
            continue
        change, hook = partial(set_attribute, model), partial(_hook, model)  # logged: engine.hf undoes them
        if hasattr(module, "build_alibi_tensor"):  # Bloom's model
            own = module.build_alibi_tensor
            change(module, "build_alibi_tensor", partial(_alibi_from_mask, own, _slopes(own, module, module.num_heads)))
        elif hasattr(module, "use_alibi"):  # Falcon-RW's model: its layers add ALiBi
            change(module, "use_alibi", False)
        elif hasattr(module, "Wqkv"):  # one of MPT's attentions
            build = sys.modules[type(module).__module__].build_mpt_alibi_tensor  # as MPT's model calls it
            slopes = -build(module.n_heads, 2, device=next(module.parameters()).device)[:, 0, 0]  # bias at -1
            change(module, "forward", partial(_mpt_attention, module, slopes=slopes))
        elif hasattr(module, "self_attention"):  # one of Falcon-RW's layers
            config = model.config
            build = sys.modules[type(module).__module__].build_alibi_tensor
            hook(module, partial(_falcon_alibi, slopes=_slopes(build, module, module.num_heads),
                                 scale=math.sqrt(config.hidden_size // config.num_attention_heads)))
        elif hasattr(module, "relative_position_bias"):  # one of Inkling 2's attentions: distances from its mask
            hook(module, _inkling2_distances)
        elif hasattr(module, "rel_logits_proj"):  # one of Inkling's attentions: distances and log scale from its mask
            _mend_inkling(model, module)
        elif type(module).__name__ == "RoFormerAttention":  # one of RoFormer's attentions: rotation from its mask
            table = next(m.embed_positions for m in model.modules() if hasattr(m, "embed_positions"))
            hook(module, partial(_roformer_positions, table=table))
        elif hasattr(module, "embed_positions"):  # a decoder of BART's kin: positions from its masks
            hook(module, _call_positions)
            embed = module.embed_positions
            change(embed, "forward", partial(_embed_positions, embed, embed.forward, decoder=module))
        elif hasattr(module, "position_embeddings"):  # RoBERTa's embeddings: position ids numbered as its own
            hook(module, _from_padding_id)
        elif hasattr(module, "floor_scale"):  # one of Llama 4's NoPE attentions: its query scale from positions
            change(module, "attn_temperature_tuning", False)
            layer = next(layer for layer in model.modules() if getattr(layer, "self_attn", None) is module)
            hook(layer, partial(_llama4_positions, attention=module))
            keep_hook(model, module.q_proj.register_forward_hook(partial(_llama4_query_scale, attention=module)))
        else:  # one of GPT-Neo's local attentions
            change(module, "bias", torch.tril(torch.ones_like(module.bias)))
            hook(module, partial(_windowed_mask, window=model.config.window_size))
        change(module, _MENDED, True)
    return bool(modules)


def _hook(model, module, function) -> None:
    """A forward pre-hook with keyword arguments on ``module``, logged on ``model`` (``models.mends``)."""
    keep_hook(model, module.register_forward_pre_hook(function, with_kwargs=True))


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
    if kind == "roformer":
        return [module for module in model.modules() if type(module).__name__ == "RoFormerAttention"]
    if kind in CACHE_COUNTED:
        return [module for module in model.modules() if type(module).__name__.endswith("Decoder")
                and isinstance(getattr(module, "embed_positions", None), torch.nn.Embedding)]
    if kind in ROBERTA_KIN:
        return [module for module in model.modules() if type(module).__name__.endswith("Embeddings")
                and hasattr(module, "padding_idx") and hasattr(module, "position_embeddings")]
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
    mask = alibi.masked_fill(~visible, masked_value(dtype))  # [B, H, q, L]
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
    scores = scores.masked_fill(attention_mask, masked_value(query.dtype))
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


def _query_positions(mask: torch.Tensor) -> torch.Tensor:
    """A 4-D mask -> each query's position ``[B, q]``: the keys it sees, less one (0 for a query that sees none)."""
    return (_visible(mask)[:, 0].sum(-1) - 1).clamp(min=0)


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


def _mend_inkling(model, module) -> None:
    """Inkling's attention measures its relative bias's distances, and the position its full layers' log scaling
    (``tau = 1 + alpha * log(max((p + 1) / n_floor, 1))`` on queries and bias) reads, in cache slots; a pre-hook keeps
    each call's distances and positions from its mask, ``rel_logits_proj`` gathers the bias at those distances and
    scales it, a hook on ``q_norm`` scales the queries, and the module reads a copy of the config without the scaling."""
    config = module.config
    scaled = not module.is_sliding and config.log_scaling_n_floor is not None
    if scaled:
        unscaled = copy.copy(config)
        unscaled.log_scaling_n_floor = None
        set_attribute(model, module, "config", unscaled)
        keep_hook(model, module.q_norm.register_forward_hook(partial(_inkling_query_scale, attention=module)))
    set_attribute(model, module, "specresearch_tau",
                  (config.log_scaling_alpha, config.log_scaling_n_floor) if scaled else None)
    _hook(model, module, _inkling_positions)
    own = module.rel_logits_proj
    set_attribute(model, own, "forward", partial(_inkling_bias, own, own.forward, attention=module))


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


def _call_positions(decoder, args, kwargs):
    """Keep each token's position in a call to a decoder of BART's kin, from its mask: the keys a query sees, less one
    (a 4-D mask), or the row's unmasked slots up to the token's own, less one (a 2-D one); None without a mask."""
    mask = kwargs.get("attention_mask")
    tokens = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
    if mask is None or tokens is None:
        decoder.specresearch_positions = None
    elif mask.ndim == 4:
        decoder.specresearch_positions = _query_positions(mask)
    else:
        decoder.specresearch_positions = (mask.long().cumsum(-1) - 1)[:, -tokens.shape[1]:].clamp(min=0)


def _embed_positions(embed, own, *args, decoder, **kwargs):
    """BART's kin embed ``cache length + index`` (BART, mBART, TrOCR: plus their offset of 2), learned or sinusoidal;
    the positions :func:`_call_positions` kept instead, ``[B, q, hidden]``."""
    positions = decoder.specresearch_positions
    if positions is None:
        return own(*args, **kwargs)
    return torch.nn.Embedding.forward(embed, positions + getattr(embed, "offset", 0))


def _roformer_positions(module, args, kwargs, *, table):
    """RoFormer's encoder hands every attention one ``[1, 1, q, d]`` rotation for the slots ``cache length + index``;
    each attention gets its rows' own, ``[B, 1, q, d]``, from the sinusoids ``table`` at the positions its mask gives
    (the keys a query sees, less one)."""
    mask = kwargs.get("attention_mask")
    if mask is None or mask.ndim != 4 or kwargs.get("sinusoidal_pos") is None:
        return None
    rotation = torch.nn.Embedding.forward(table, _query_positions(mask))[:, None].to(kwargs["sinusoidal_pos"].dtype)
    return args, {**kwargs, "sinusoidal_pos": rotation}


def _from_padding_id(module, args, kwargs):
    """RoBERTa's embeddings number a row's tokens from ``padding_idx + 1`` (past the cache's slot count) where they
    number them themselves; the position ids the wrapper passes count a row's tokens from 0."""
    if kwargs.get("position_ids") is None:
        return None
    return args, {**kwargs, "position_ids": kwargs["position_ids"] + module.padding_idx + 1}


def _windowed_mask(module, args, kwargs, *, window: int):
    mask = kwargs.get("attention_mask")
    if mask is None:
        raise ValueError(f"{type(module).__name__}: a local layer needs the attention mask to apply its window")
    seen = _visible(mask).long()
    after = seen.flip(-1).cumsum(-1).flip(-1) - seen  # the keys seen after each slot: how many positions back it lies
    outside = seen.bool() & (after >= window)
    if mask.is_floating_point():
        mask = mask.masked_fill(outside, masked_value(mask.dtype))
    else:
        mask = mask & ~outside
    return args, {**kwargs, "attention_mask": mask}
