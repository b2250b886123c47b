"""Recurrent layers in a transformers model's cache (linear attention, Mamba's state spaces, short convolutions): the
per-row rollback, row selection and bounded memory :class:`~specresearch.models.causal_lm.CausalLM` needs of them.

transformers 5.25 gives each layer of type ``linear_attention`` (Qwen3.5 and Qwen3-Next's Gated DeltaNet, Mamba,
Falcon-Mamba, Mamba-2, Jamba, Bamba, Granite-4 hybrids, Nemotron-H, OLMo-hybrid, Kimi Linear, ...) or ``hybrid`` (Falcon-H1,
Zamba2: attention and a state space in one layer) a ``LinearAttentionLayer`` in a ``DynamicCache(config=...)``: a
convolution state (the last ``kernel`` inputs of the layer's causal convolution) and a recurrent state (a matrix per
head), rewritten in place by each call. Nothing of a token survives in a slot of its own, so the attention cache's
rollback (crop, or mask a row's slots) cannot undo it. transformers' own assisted generation turns on
``activate_past_recording``: the layer then keeps every convolution input since the last ``crop`` and, per token, the
recurrent state before it (its kernels run the last ``recurrent_states_to_keep`` tokens of a call one at a time to
produce them), and ``crop(-n)`` restores the state before the last n tokens, the same n for every row.

Here the same records give each row its own count (:func:`rollback_rows`): row b takes the recurrent state recorded
``n_b`` tokens back and the ``kernel`` convolution inputs ending there (zeros before a row's first input, as the
layer's own initial state). The records span the calls since the last rollback, which the engine makes after every
verification (the draft's ``gamma - 1`` one-token calls and the target's scoring call alike), and are cut to the last
:data:`KEEP` tokens before each call (:func:`trim`), so a loop that never rolls back holds a bounded history.
:func:`select_rows` / :func:`repeat_rows` carry the records with the rows.

A draft tree's nodes are not one sequence, and a recurrent layer reads every earlier token in order, so a tree call
on such a model (:func:`score_tree_as_paths`) scores each root-to-leaf path as a chain, one row per path (the cache
repeated: memory and compute times the number of paths), each node's logits read off a path through it, and the
tree's end (:func:`end_tree_as_paths`) keeps a path holding the accepted nodes and rolls the rest back. The captured
steps' static form keeps these states in fixed buffers, for chains (:mod:`specresearch.models.static_states`:
:func:`recurrent_kinds`, :func:`static_cache_base`). Sliding windows beside recurrent
layers (Lara mini) are masked by the wrapper, over the full attention layers :func:`recurrent_cache` puts where the
config names sliding ones.
Padding reaches a recurrent layer as the 2-D mask of the call's tokens, which zeroes a left-padded prompt's pad
inputs (transformers' ``apply_mask_to_padding_states``), so a row's state starts at zero where its tokens start; a
model with no attention layer (Mamba, Falcon-Mamba) gets only the call's columns. A cached call runs its last
:data:`KEEP` tokens one at a time from the records and the rest by a scan, which Mamba's and Jamba's kernels start from
a zero state, so ``CausalLM.score`` runs a longer call after a cached state :data:`KEEP` tokens at a time; a model
whose layers record their state once a call (Zaya, Zamba, MiniMax: :data:`ONE_TOKEN_CALLS`), one token at a time.
MiniMax keeps its lightning attention's state in a cache class of its own, which its forward insists on: the
wrapper's is that class over transformers' layers (:func:`recurrent_cache`).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from specresearch.models.mends import keep_hook, set_attribute

__all__ = ["RECURRENT_TYPES", "KEEP", "ONE_TOKEN_CALLS", "piece_size", "clamp_time_steps", "recurrent_cache", "recurrent_layers", "rollback_rows", "before_call", "after_call",
           "trim", "select_rows", "repeat_rows", "set_length", "score_in_pieces", "tree_paths", "score_tree_as_paths",
           "end_tree_as_paths", "recurrent_kinds", "static_cache_base"]

RECURRENT_TYPES = ("linear_attention", "hybrid", "hybrid_sliding", "conv")  # transformers' layer types whose cache
# holds recurrent state ("hybrid": attention and a recurrent state in one layer; "hybrid_sliding": its attention windowed)
KEEP = 64  # tokens of records kept: the most one rollback may undo
ONE_TOKEN_CALLS = ("zaya", "zamba", "minimax")  # model types whose recurrent layers record a call's state once, not
# once a token


def recurrent_cache(model, keep: int = KEEP):
    """``DynamicCache(config=...)`` of ``model`` (MiniMax: its own cache class over the same layers) with every
    recurrent layer recording its past (``keep`` tokens of intermediate recurrent states per call), and full attention
    layers where the config names sliding ones (the wrapper masks windows itself: ``models.attention``)."""
    from transformers import DynamicCache
    from transformers.cache_utils import (
        DynamicLayer,
        DynamicSlidingWindowLayer,
        LinearAttentionAndFullAttentionLayer,
        LinearAttentionAndSlidingWindowAttentionLayer,
    )

    own = model.config.model_type == "minimax"  # MiniMax refuses any cache but its own class
    cache = _minimax_cache()(model.config) if own else DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionAndSlidingWindowAttentionLayer):
            cache.layers[i] = LinearAttentionAndFullAttentionLayer(number_of_states=layer.number_of_states)
        elif isinstance(layer, DynamicSlidingWindowLayer):
            cache.layers[i] = DynamicLayer()
    for layer in recurrent_layers(cache):
        layer.activate_past_recording(recurrent_states_to_keep=keep)
        layer.recurrent_states_history = {i: [] for i in range(layer.number_of_states)}  # one list per state
    return cache


@functools.cache
def _minimax_cache():
    """MiniMax's cache class (its forward takes no other) over transformers' layers of its config: each lightning
    attention layer's state (``K^T V``, decayed per token) in a ``LinearAttentionLayer`` instead of the class's own list,
    so that it is recorded, rolled back and carried with the rows as the other recurrent layers' are."""
    from transformers import DynamicCache
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    class RecordedMiniMaxCache(MiniMaxCache):
        def __init__(self, config):
            DynamicCache.__init__(self, config=config)
            self.linear_cache = []

        def get_linear_cache(self, layer_idx: int):
            layer = self.layers[layer_idx]
            return layer.recurrent_states[0] if layer.is_recurrent_states_initialized[0] else None

        def set_linear_cache(self, layer_idx: int, linear_cache) -> None:
            self.layers[layer_idx].update_recurrent_state(linear_cache)  # records the state before the call

        def get_seq_length(self, layer_idx: int = 0) -> int:  # an attention layer's: the lightning layers count none
            return next((layer.get_seq_length() for layer in self.layers if layer not in recurrent_layers(self)), 0)

        __len__ = DynamicCache.__len__
        crop = DynamicCache.crop
        batch_select_indices = DynamicCache.batch_select_indices
        batch_repeat_interleave = DynamicCache.batch_repeat_interleave

    return RecordedMiniMaxCache


def clamp_time_steps(model) -> int:
    """Make each Mamba-2 mixer of ``model`` whose ``time_step_limit`` bounds its time step bound it in every call;
    returns how many it mended.

    transformers' Mamba-2 mixers (Mamba-2, Bamba, Granite-4 hybrids, Falcon-H1, Nemotron-H, Zamba2) clamp the time step
    ``softplus(dt + dt_bias)`` to ``time_step_limit`` in their scan (a prompt, an uncached forward) but not in their
    one-token step (cached decoding, and the last tokens of a cached call, which run one at a time to record their
    states), so a cached call scores otherwise than a forward wherever a step passes the limit. Zamba2 sets the limit
    ``(time_step_min, inf)`` itself, some checkpoints of the others bound it (Nemotron 3: ``[1e-4, 0.1]``); the default
    ``(0, inf)`` bounds nothing. A hook on the mixer's ``in_proj`` clamps the ``dt`` columns of its output (the last
    ``num_heads``; Falcon-H1's are scaled by its ``mup_vector`` after) to where the softplus lands inside the limit, and
    leaves every other value as it is: the scan's own clamp then changes nothing (to a rounding at the limit), and the
    step computes what the forward does."""
    mended = 0
    for module in model.modules():
        low, high = getattr(module, "time_step_limit", None) or (0.0, float("inf"))
        if low <= 0 and high == float("inf") or not hasattr(module, "dt_bias") or getattr(module, _CLAMPED, False):
            continue
        keep_hook(model, module.in_proj.register_forward_hook(functools.partial(_clamp_dt, mixer=module, low=low,
                                                                                high=high)))
        set_attribute(model, module, _CLAMPED, True)  # both logged (models.mends): engine.hf undoes them
        mended += 1
    return mended


_CLAMPED = "specresearch_time_step_clamped"


def _softplus_inverse(value: float) -> float:
    return value if value > 20 else math.log(math.expm1(value))  # torch's softplus is the identity past 20


def _clamp_dt(in_proj, inputs, output, *, mixer, low: float, high: float):
    heads = mixer.num_heads
    dt = output[..., -heads:]
    scale = mixer.mup_vector[..., -heads:].to(dt.dtype) if hasattr(mixer, "mup_vector") else None  # Falcon-H1
    scaled = dt * scale if scale is not None else dt
    bias = mixer.dt_bias.to(dt.dtype)
    bounded = scaled
    if low > 0:
        bounded = torch.maximum(bounded, _softplus_inverse(low) - bias)
    if high < float("inf"):
        bounded = torch.minimum(bounded, _softplus_inverse(high) - bias)
    moved = bounded != scaled
    output[..., -heads:] = torch.where(moved, bounded / scale if scale is not None else bounded, dt)
    return output


def recurrent_layers(cache) -> list:
    """The layers of ``cache`` that hold recurrent state (transformers' ``LinearAttentionCacheLayerMixin``)."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]


def _states(layer):
    """(state index, has a recurrent state, has a convolution state) of each state ``layer`` keeps."""
    return [(i, layer.is_recurrent_states_initialized[i], layer.is_conv_states_initialized[i])
            for i in range(layer.number_of_states)]


def rollback_rows(cache, counts: torch.Tensor, most: int) -> None:
    """Undo the last ``counts[b]`` tokens of row b in every recurrent layer (``counts [B]`` int64 on the states'
    device; ``most``: their largest, known on the host); the records start afresh."""
    for layer in recurrent_layers(cache):
        for i, recurrent, conv in _states(layer):
            if recurrent:
                history = layer.recurrent_states_history[i]
                if most > len(history):
                    raise ValueError(f"a recurrent layer can undo the {len(history)} tokens since its last rollback "
                                     f"(at most {KEEP}), not {most}")
                state = layer.recurrent_states[i]
                n = counts.to(state.device)
                stacked = torch.stack([*history, state])  # [T + 1, B, ...]: the state before each token, and now
                layer.recurrent_states[i] = stacked[len(history) - n, torch.arange(len(n), device=state.device)]
                layer.recurrent_states_history[i] = []
            if conv:
                inputs, kernel = layer.conv_states[i], layer.conv_kernel_size[i]  # [B, C, T]
                n = counts.to(inputs.device)
                padded = F.pad(inputs, (kernel, 0))  # input j at kernel + j; zeros before the first
                at = inputs.shape[-1] - n[:, None] + torch.arange(kernel, device=inputs.device)  # [B, kernel]
                layer.conv_states[i] = padded.gather(-1, at[:, None, :].expand(-1, inputs.shape[1], -1))


def before_call(cache) -> list:
    """A copy of each recurrent state before a call, and where the call's records will start: hand it to
    :func:`after_call` (Jamba's scan updates the cached state in place before transformers records it, so the
    record it makes of the state before a call is the state after the call's first token)."""
    return [(layer, i, layer.recurrent_states[i].clone(), len(layer.recurrent_states_history[i]))
            for layer in recurrent_layers(cache) for i, recurrent, _ in _states(layer) if recurrent]


def after_call(kept: list, tokens: int) -> None:
    """Each call's first record replaced by the copy :func:`before_call` made (a layer not yet started has none); a
    one-token call that recorded nothing (Zamba's one-token scan updates its state in place and records none) gets
    that copy as its record."""
    for layer, i, state, start in kept:
        history = layer.recurrent_states_history[i]
        if len(history) > start:
            history[start] = state
        elif tokens == 1:
            history.append(state)


def trim(cache, keep: int = KEEP) -> None:
    """Keep the records of the last ``keep`` tokens only (before a call: what a rollback may undo)."""
    for layer in recurrent_layers(cache):
        for i, recurrent, conv in _states(layer):
            history = layer.recurrent_states_history[i]
            if recurrent and len(history) > keep:
                del history[:-keep]
            if conv and layer.conv_states[i].shape[-1] > keep + layer.conv_kernel_size[i]:
                layer.conv_states[i] = layer.conv_states[i][..., -(keep + layer.conv_kernel_size[i]):]


def select_rows(cache, index: torch.Tensor) -> None:
    """Keep rows ``index`` of every recurrent layer's states and records."""
    _rows(cache, lambda t: t.index_select(0, index.to(t.device)))


def repeat_rows(cache, k: int) -> None:
    """Each row of every recurrent layer's states and records becomes ``k`` consecutive rows."""
    _rows(cache, lambda t: t.repeat_interleave(k, 0))


def _rows(cache, change) -> None:
    for layer in recurrent_layers(cache):
        for i, recurrent, conv in _states(layer):
            if recurrent:
                layer.recurrent_states[i] = change(layer.recurrent_states[i])
                layer.recurrent_states_history[i] = [change(h) for h in layer.recurrent_states_history[i]]
            if conv:
                layer.conv_states[i] = change(layer.conv_states[i])


def set_length(cache, length: int) -> None:
    """The recurrent layers' token count (what the cache reports as its length) set to ``length`` slots."""
    for layer in recurrent_layers(cache):
        layer.cumulative_length_linear = torch.full_like(torch.as_tensor(layer.cumulative_length_linear), length)


def piece_size(model) -> int:
    """The most tokens a cached call of ``model`` (with recurrent layers) scores at once: :data:`KEEP`, or 1 for a
    type of :data:`ONE_TOKEN_CALLS` (Zaya's, Zamba's and MiniMax's layers record their state once a call, so a call's
    tokens could not be rolled back one by one)."""
    return 1 if getattr(model.config, "model_type", "") in ONE_TOKEN_CALLS else KEEP


def score_in_pieces(lm, tokens: torch.Tensor, valid: torch.Tensor, hidden_layers=None, size: int = KEEP):
    """``lm.score`` of more than ``size`` tokens after a cached state, ``size`` tokens at a time: a cached call runs
    its last :data:`KEEP` tokens one at a time from the state and the rest by a scan, which Mamba's and Jamba's kernels
    start from a zero state (a 150-token call after a prompt came out 11 off the logits' scale); a model of
    :data:`ONE_TOKEN_CALLS` goes one token at a time (:func:`piece_size`)."""
    pieces = [lm.score(tokens[:, i:i + size], valid[:, i:i + size], hidden_layers)
              for i in range(0, tokens.shape[1], size)]
    if hidden_layers is None:
        return torch.cat(pieces, dim=1)
    return torch.cat([logits for logits, _ in pieces], dim=1), torch.cat([hidden for _, hidden in pieces], dim=1)


def tree_paths(depth: torch.Tensor, visible: torch.Tensor) -> list[list[list[int]]]:
    """Each row's root-to-leaf paths of a tree call (``visible [B, 1+n, 1+n]``: each call row sees itself and its
    ancestors; ``depth [B, 1+n]``), as call-row indices in depth order: a leaf is a row no other row sees."""
    visible, depth = visible.cpu(), depth.cpu().tolist()
    paths = []
    for b, seen in enumerate(visible):
        leaves = (seen.sum(0) == 1).nonzero().flatten().tolist()  # seen by itself only
        paths.append([sorted(seen[i].nonzero().flatten().tolist(), key=lambda j: depth[b][j]) for i in leaves])
    return paths


def score_tree_as_paths(lm, tokens: torch.Tensor, depth: torch.Tensor, visible: torch.Tensor, hidden_layers=None):
    """A tree call of a model with recurrent layers (``lm``: a ``CausalLM``): each row becomes one row per root-to-leaf
    path (``lm.repeat_rows``), each path scored as a chain (shorter paths padded at their end), and each node's logits
    (and hidden states) read off a path through it. The rows stay expanded until :func:`end_tree_as_paths`."""
    paths = tree_paths(depth, visible)
    count, length = max(map(len, paths)), max(len(p) for row in paths for p in row)
    paths = [row + [row[0]] * (count - len(row)) for row in paths]  # a row with fewer paths repeats its first
    rows = [p for row in paths for p in row]
    index = torch.tensor([p + [0] * (length - len(p)) for p in rows], device=tokens.device)  # [B P, L]
    valid = torch.tensor([[True] * len(p) + [False] * (length - len(p)) for p in rows], device=lm.device)
    lm.repeat_rows(count)
    out = lm.score(tokens.repeat_interleave(count, 0).gather(1, index), valid, hidden_layers=hidden_layers)
    logits, hidden = out if hidden_layers is not None else (out, None)
    where = []  # each node's (expanded row, place on its path)
    for b, row in enumerate(paths):
        first = {}
        for p, path in enumerate(row):
            for place, node in enumerate(path):
                first.setdefault(node, (b * count + p, place))
        where.append([first.get(i, first[0]) for i in range(tokens.shape[1])])
    at = torch.tensor(where, device=logits.device)  # [B, 1+n, 2]
    lm.tree_paths = (paths, count, length)
    pick = lambda x: x[at[..., 0], at[..., 1]]  # noqa: E731
    return pick(logits) if hidden is None else (pick(logits), pick(hidden.to(logits.device)))


def end_tree_as_paths(lm, kept: torch.Tensor) -> None:
    """Keep, for each row, a path holding the nodes ``kept [B, 1+n]`` marks (the accepted path's prefix from the root)
    and its first ``len(kept nodes)`` slots: ``lm.select_rows`` then a rollback of the rest."""
    if getattr(lm, "tree_paths", None) is None:
        raise ValueError("end_tree called without a tree call (score_tree) before it")
    paths, count, length = lm.tree_paths
    lm.tree_paths = None
    chosen, drops = [], []
    for b, marks in enumerate(kept.cpu().tolist()):
        nodes = {i for i, mark in enumerate(marks) if mark}
        p = next((p for p, path in enumerate(paths[b]) if nodes <= set(path)), None)
        if p is None or set(paths[b][p][: len(nodes)]) != nodes:
            raise ValueError(f"row {b} keeps tree nodes {sorted(nodes)}, which are not a path from the root")
        chosen.append(b * count + p)
        drops.append(length - len(nodes))
    lm.select_rows(torch.tensor(chosen, device=lm.device))
    lm.rollback(drops)


def recurrent_kinds(model) -> list[tuple[str, int]]:
    """Each layer of ``model``'s cache as ``models.static_cache.static_kv_cache`` builds its static form:
    ``("attention", 0)``, ``("states", m)`` (m recurrent states) or ``("both", m)`` (attention beside them); a model
    that runs some layers several times (Inkling 2's loop: ``loop_num_passes``) has a cache layer for each pass after
    the first, after the others (its forward appends them to a cache of one layer a layer)."""
    from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

    kinds = []
    for layer in recurrent_cache(model).layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            kinds.append(("both" if isinstance(layer, CacheLayerMixin) else "states", layer.number_of_states))
        else:
            kinds.append(("attention", 0))
    config = model.config.get_text_config(decoder=True)
    passes = getattr(config, "loop_num_passes", 1) or 1
    if passes > 1:
        kinds += kinds[config.loop_layer_index_start: config.loop_layer_index_end] * (passes - 1)
    return kinds



def static_cache_base(model):
    """A cache class the static form's cache of ``model`` must also be, or None: MiniMax's forward takes its own
    class only (:func:`recurrent_cache`), whose lightning layers read and write their state through
    ``get_linear_cache`` / ``set_linear_cache``: here the static layers' (``models.static_states``)."""
    return _minimax_static_cache() if model.config.model_type == "minimax" else None


@functools.cache
def _minimax_static_cache():
    """:func:`_minimax_cache`'s class over given layers (the static form's) instead of its config's."""
    from transformers.cache_utils import Cache

    class StaticMiniMaxCache(_minimax_cache()):
        def __init__(self, layers):
            Cache.__init__(self, layers=layers)
            self.linear_cache = []

    return StaticMiniMaxCache
