"""Rotary embeddings whose frequencies transformers picks per call, fixed for a run instead.

Two of transformers' rotary types choose their frequencies from the longest position of the call they are handed:
``"longrope"`` (Phi-3's 128k models, Phi-3.5, Phi-4-mini: the long factors once a call reaches past
``original_max_position_embeddings``, the short ones otherwise; PhiMoE's forward scales cos and sin by ``long_mscale``
or ``short_mscale`` so too) and ``"dynamic"`` (NTK scaling by the longest position seen, reset below the original
length). A cached sequence then holds keys rotated by whichever set its calls had: a speculative call reaching past
the limit rotates its first tokens by the long set where autoregressive decoding rotated them by the short one, a
batch's longest row decides for every row, and an uncached forward rotates all of them by the set of its length.
Greedy speculative decoding of a tiny Phi-3 with long factors then emitted other tokens than autoregressive decoding,
itself other than transformers' ``generate`` (``tests/test_rotary.py``'s control).

So ``CausalLM`` fixes them (:func:`fix_rotaries`): each such rotary embedding runs transformers' undecorated forward
with the set (and PhiMoE's scale) of one sequence length, the run's context (:func:`plan_rotaries`: the engine gives
the longest prompt plus ``max_new_tokens``, the positions a token may be emitted at), as llama.cpp picks Phi-3's
factors from its context size. Every call, cached or not, of any row and any width then rotates a position alike,
and the uncached forward of any prefix within the original length, or past it from the prompt on, is what the cache
computes; where a run's prompt is within it and its tokens pass it, the model keeps a cache of each set
(:func:`set_change`, :mod:`~specresearch.models.prefix_sets`), each token drawn from its prefix's. Before a run
plans one, the original set rotates, and a call reaching past the original length raises (naming
:func:`plan_rotaries`) rather than choosing: that check reads the call's largest position on the host, a planned run
does not.
"""

from __future__ import annotations

import inspect
from functools import partial

import torch

from specresearch.models.mends import keep_undo, set_attribute

__all__ = ["CALL_DEPENDENT", "fix_rotaries", "plan_rotaries", "planned_context", "set_change"]

CALL_DEPENDENT = ("longrope", "dynamic")  # transformers' rope types whose frequencies follow a call's positions
_OWN = "specresearch_rotary_context"  # on each rotary embedding fix_rotaries mended: the planned length, or None
_PLANNED, _LONG = "specresearch_rotary_planned", "specresearch_rotary_long"  # what its forward reads: two booleans (a
# compiled step specializes on them, not on the context's length)


def _types(module) -> dict:
    """``{layer type or None: rope type}`` of a rotary embedding's call-dependent sets."""
    kinds = getattr(module, "rope_type", None)
    if isinstance(kinds, str):
        return {None: kinds} if kinds in CALL_DEPENDENT else {}
    if isinstance(kinds, dict):
        return {layer: kind for layer, kind in kinds.items() if kind in CALL_DEPENDENT}
    return {}


def _rotaries(model) -> list:
    return [module for module in model.modules()
            if _types(module) and hasattr(type(module).forward, "__wrapped__")]  # transformers' dynamic_rope_update


def _prefix(layer) -> str:
    return "" if layer is None else f"{layer}_"


def _original_length(module, layer) -> int:
    """The length past which transformers would change ``layer``'s set."""
    if _types(module)[layer] == "longrope":
        params = module.config.rope_parameters if layer is None else module.config.rope_parameters[layer]
        return int(params["original_max_position_embeddings"])
    return int(module.original_max_seq_len)


def fix_rotaries(model) -> int:
    """Make every rotary embedding of ``model`` whose frequencies follow its calls (``CALL_DEPENDENT``) keep one set:
    the original until :func:`plan_rotaries` plans a run (module docstring); returns how many it mended.
    Every change is logged (``models.mends``: ``engine.hf`` hands the caller's model back with transformers' forward,
    frequencies and scalings, whatever the plans since)."""
    mended = 0
    for module in _rotaries(model):
        if hasattr(module, _OWN):
            continue
        for layer in _types(module):
            prefix = _prefix(layer)
            frequencies = getattr(module, f"{prefix}inv_freq")
            keep_undo(model, partial(frequencies.copy_, frequencies.clone()))
            if hasattr(module, f"{prefix}attention_scaling"):  # logged as it is now: plan_rotaries sets it later
                set_attribute(model, module, f"{prefix}attention_scaling", getattr(module, f"{prefix}attention_scaling"))
            frequencies.copy_(getattr(module, f"{prefix}original_inv_freq"))
        for name, value in ((_OWN, None), (_PLANNED, False), (_LONG, False)):
            set_attribute(model, module, name, value)
        own = None if "long_mscale" in module.config.rope_parameters else inspect.unwrap(type(module).forward)  # PhiMoE
        set_attribute(model, module, "forward", partial(_fixed_forward, module, own=own))
        mended += 1
    return mended


def plan_rotaries(model, context: int) -> bool:
    """Rotate every call of ``model``'s mended rotary embeddings (:func:`fix_rotaries`) by the set transformers gives a
    sequence of ``context`` positions: the long factors (longrope) or the NTK scale (dynamic) past the original
    length, the original set within it. Call it before a run, outside any captured step (it writes the buffers the
    steps read). Returns whether a rotation changed (a cache built before then rotates otherwise)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    changed = False
    for module in _rotaries(model):
        if not hasattr(module, _OWN):
            continue
        for layer, kind in _types(module).items():
            prefix, limit = _prefix(layer), _original_length(module, layer)
            frequencies = getattr(module, f"{prefix}inv_freq")
            options = {} if layer is None else {"layer_type": layer}
            if context > limit:  # longrope's long set is the one of any length past the limit
                new, scaling = ROPE_INIT_FUNCTIONS[kind](module.config, frequencies.device,
                                                         seq_len=limit + 1 if kind == "longrope" else context, **options)
                if kind != "longrope":  # longrope's scaling is its attention factor whatever the set
                    setattr(module, f"{prefix}attention_scaling", scaling)
            else:
                new = getattr(module, f"{prefix}original_inv_freq")
            new = new.to(frequencies)
            changed = changed or not torch.equal(new, frequencies)
            frequencies.copy_(new)
        long = None in _types(module) and context > _original_length(module, None)
        changed = changed or long != getattr(module, _LONG)  # PhiMoE's scale
        setattr(module, _OWN, int(context))
        setattr(module, _PLANNED, True)
        setattr(module, _LONG, long)
    return changed


def planned_context(model) -> int | None:
    """The context :func:`plan_rotaries` last planned for ``model`` (None: none yet, or no rotary needs one)."""
    return next((getattr(module, _OWN) for module in _rotaries(model) if hasattr(module, _OWN)), None)


def set_change(model, context: int) -> int | None:
    """The length past which a run of ``context`` positions changes the set of ``model``'s mended longrope rotaries:
    a prefix up to it is rotated by the original set, a longer one by the long set (each prefix's uncached forward;
    :mod:`~specresearch.models.prefix_sets` keeps a cache of each). None where no set changes within the run.
    Dynamic NTK changes at every length past its original one, ``max_position_embeddings``, which no run passes
    (``engine.results.check_context``): it keeps the run's set."""
    limits = {_original_length(module, layer) for module in _rotaries(model) if hasattr(module, _OWN)
              for layer, kind in _types(module).items() if kind == "longrope"}
    limits = sorted(limit for limit in limits if limit < context)
    if len(limits) > 1:
        raise ValueError(f"{type(model).__name__}'s longrope layers change their sets at {limits} within a run of "
                         f"{context} positions: one change a run is supported; keep the run within {limits[1]}")
    return limits[0] if limits else None


def _fixed_forward(module, x, position_ids, layer_type=None, *, own):
    if not getattr(module, _PLANNED):
        limits = [_original_length(module, layer) for layer in _types(module) if layer == layer_type]
        reach = int(position_ids.max()) + 1
        if limits and reach > limits[0]:
            raise ValueError(
                f"{type(module).__name__} ({_types(module)[layer_type]}) chooses its rotary frequencies by the length "
                f"of each call; this call reaches position {reach} past its original {limits[0]}, so a cached "
                "sequence would mix two sets: plan the run's context first (CausalLM.plan_context(n), which "
                "speculative_generate and autoregressive_generate do from the prompt and max_new_tokens)")
    if own is None:
        return _phimoe_rotation(module, x, position_ids)
    return own(module, x, position_ids, **({} if layer_type is None else {"layer_type": layer_type}))


def _phimoe_rotation(module, x, position_ids):
    """PhiMoE's rotary forward with its planned scale: the frequencies of its config (its forward recomputes them each
    call; they are the ones it keeps as ``original_inv_freq``), cos and sin scaled by ``long_mscale`` or
    ``short_mscale`` as the plan passes the original length or not (its forward: as the call does, a host read)."""
    params = module.config.rope_parameters
    scale = params["long_mscale"] if getattr(module, _LONG) else params["short_mscale"]
    freqs = position_ids[..., None].float() * module.original_inv_freq.to(device=x.device, dtype=torch.float)
    angles = torch.cat((freqs, freqs), dim=-1)
    return (angles.cos() * scale).to(x.dtype), (angles.sin() * scale).to(x.dtype)
