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
1's log scaling) counts slots; ``models.positions.positions_from_masks`` makes them read positions off the masks
(Llama 4: off the position ids) instead. (A model without a KV cache, GPT-1, is refused by
``causal_lm.cache_argument``.)

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

import warnings
from dataclasses import dataclass

import torch

from specresearch.models import positions
from specresearch.models.positions import masked_value
from specresearch.models.recurrent import RECURRENT_TYPES

__all__ = ["AttentionLayout", "attention_layout", "exact_kernel", "additive_mask", "MASKED_KERNELS", "CPU_SDPA", "PACKED_SDPA",
           "cpu_sdpa_attention", "packed_sdpa_attention", "use_cpu_sdpa", "use_packed_sdpa", "additive_sdpa_mask",
           "WIDENS_2D", "WINDOWS_FULL"]

# Kernels that apply a 4-D additive mask as given (transformers' own and the two CausalLM registers on CPU / CUDA).
MASKED_KERNELS = ("eager", "sdpa", "specresearch_cpu_sdpa", "specresearch_packed_sdpa")
_WHY = {"flex_attention": "whose compiled kernel fails on batched masked calls on the CPU (torch 2.13) and is not "
                          "tested with a tree mask on CUDA"}
_LAYER_TYPES = ("full_attention", "sliding_attention")
CHUNKED_FAMILIES = ("llama4_text",)  # model types whose forward masks "chunked_attention" layers by chunk (Llama 4)
# model types whose "indexed_attention" layers (DeepSeek Sparse Attention) pick keys by an indexer that reads the mask
INDEXED_FAMILIES = ("deepseek_v32", "glm_moe_dsa")
# model types that widen a 2-D padding mask after a cached call by tokens they assume cached (GIT: an image's patch
# tokens, which a text-only model has none of): every call of theirs gets a 4-D mask built here
WIDENS_2D = ("git",)
# model types whose "full_attention" layers window by config.sliding_window when it is set (MiniMax; transformers'
# cache names those layers full all the same)
WINDOWS_FULL = ("minimax",)


@dataclass(frozen=True)
class AttentionLayout:
    """The attention of one model: its kernel and, per transformers layer type, the sliding window (None: full)."""

    kernel: str
    # ((layer type, window or None), ...) in order of first use; a "chunked_attention" type's number is its chunk
    windows: tuple[tuple[str, int | None], ...]
    recurrent: bool = False  # some layers keep recurrent state (models.recurrent): they read the 2-D mask
    attends: bool = True  # some layer attends over the cache's slots (False: Mamba, Mamba-2: recurrent layers only)
    indexed: bool = False  # DeepSeek Sparse Attention: its cache layers keep the indexer's keys beside K and V
    four_d: bool = False  # it misreads a 2-D mask after a cached call (GIT: :data:`WIDENS_2D`): masks built here always

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
    return mask.masked_fill_(~allowed, masked_value(dtype))[:, None]


def attention_layout(model) -> AttentionLayout:
    """The layout of a transformers model (module docstring); ``ValueError`` naming the model and the layer type
    for layers this wrapper cannot mask exactly."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    config = model.config.get_text_config(decoder=True)
    reads_slots = positions.slot_placement(model, config)
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
        if kind == "full_attention" and config.model_type in WINDOWS_FULL:  # its cache names the layers full
            window = getattr(config, "sliding_window", None)
        if kind == "sliding_attention" and not window:
            raise ValueError(f"{_name(model)} has sliding-window layers without a window (sliding_window={window!r})")
        if windows.setdefault(kind, window) != window:
            raise ValueError(f"{_name(model)} has {kind!r} layers with different windows; CausalLM takes one per type")
    attends = any(kind not in ("linear_attention", "conv", "dummy") for kind in kinds)  # "hybrid" attends too
    return AttentionLayout(model.config._attn_implementation, tuple(windows.items()), recurrent, attends,
                           "indexed_attention" in windows, config.model_type in WIDENS_2D)


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
