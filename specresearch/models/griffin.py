"""RecurrentGemma's (Griffin's) recurrent blocks with their states in the cache, as the other recurrent layers keep theirs.

transformers' ``RecurrentGemmaRecurrentBlock`` keeps its convolution state (``conv1d_state``) and its RG-LRU state
(``rg_lru.recurrent_states``) on its modules, not in the cache it is handed, so a rollback cannot undo them; a cached
call of several tokens restarts the convolution from zeros (its prefill branch) while the RG-LRU goes on from its
state; a left-padded prompt's pads reach the convolution of its first tokens; and the cache's token count stays 0 (its
``LinearAttentionLayer``, which the block never touches). :func:`keep_states_in_cache` gives each block a forward of
its own with the same weights and arithmetic (the Griffin paper's recurrent block: a gate branch, a depthwise causal
convolution, the RG-LRU with its state reset where a position is 0) in which the convolution's inputs (zero where a
slot is padding or masked) and the RG-LRU's state after each token go through the block's layer of the cache
(``update_conv_state`` / ``update_recurrent_state``). :mod:`~specresearch.models.recurrent` then records them, rolls
them back per row and carries them with the rows as it does Mamba's; a call of any length goes on from the cached
states, and without a cache (an uncached forward) both start from zeros, as transformers' own does.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from specresearch.models.mends import set_attribute

__all__ = ["keep_states_in_cache"]

_BLOCK = "RecurrentGemmaRecurrentBlock"
_MENDED = "specresearch_states_in_cache"


def keep_states_in_cache(model) -> int:
    """Give each RecurrentGemma recurrent block of ``model`` the forward of the module docstring (once); returns how
    many it mended."""
    mended = 0
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList):
            continue
        for index, layer in enumerate(layers):
            block = getattr(layer, "temporal_block", None)
            if type(block).__name__ != _BLOCK or getattr(block, _MENDED, False):
                continue
            set_attribute(model, block, "forward", functools.partial(_forward, block, index=index))  # logged
            set_attribute(model, block, _MENDED, True)  # (models.mends: engine.hf undoes them)
            mended += 1
    return mended


def _forward(block, input_states: torch.Tensor, position_ids: torch.Tensor, attention_mask=None, use_cache=True,
             cache=None, *, index: int, **kwargs):
    length = input_states.shape[1]
    gate = block.act_fn(block.linear_y(input_states))
    layer = cache.layers[index] if cache is not None and use_cache else None
    valid = _valid(None if getattr(layer, "steps_only", False) else attention_mask, input_states)  # a static form's
    inputs = block.linear_x(input_states) * valid[..., None]  # [B, T, W]          step: every token real
    width = block.conv1d_width
    inputs = inputs.transpose(1, 2)  # [B, W, T]
    if layer is not None:  # the cached inputs (the last width - 1, or all since the last rollback) and these
        inputs = layer.update_conv_state(inputs, conv_kernel_size=width - 1)
    span = width - 1 + length
    inputs = F.pad(inputs, (max(0, span - inputs.shape[-1]), 0))[..., -span:]  # zeros before a row's first input
    convolved = F.conv1d(inputs, block.conv_1d.weight, block.conv_1d.bias, groups=block.conv_1d.groups)  # [B, W, T]
    start = layer.recurrent_states[0] if layer is not None and layer.is_recurrent_states_initialized[0] else None
    output, states = _rg_lru(block.rg_lru, convolved.transpose(1, 2), position_ids, start)
    if layer is not None:
        layer.update_recurrent_state(states, 0)  # the state after each token: the layer records the one before it
    return block.linear_out(output * gate), None


def _valid(mask, hidden: torch.Tensor) -> torch.Tensor:
    """Whether each slot of the call is a token (not padding, not masked) -> ``[B, T]`` in ``hidden``'s dtype: read off
    the 4-D mask the block is handed (a slot that sees itself); None: every slot."""
    batch, length = hidden.shape[:2]
    if mask is None:
        return torch.ones(batch, length, dtype=hidden.dtype, device=hidden.device)
    at = torch.arange(length, device=mask.device)
    own = mask[:, 0, at, mask.shape[-1] - length + at]  # [B, T]
    seen = own if own.dtype == torch.bool else own == 0
    return seen.to(device=hidden.device, dtype=hidden.dtype)


def _rg_lru(lru, activations: torch.Tensor, position_ids: torch.Tensor, state: torch.Tensor | None):
    """The RG-LRU over a call (``activations [B, T, W]``) from ``state [B, W]`` (float32; None: zeros), reset where a
    position is 0 -> (outputs ``[B, T, W]``, the float32 state after each token: a list of T ``[B, W]``)."""
    batch, length, width = activations.shape
    heads, block = lru.num_attention_heads, lru.block_width
    reset = position_ids[:, :, None] == 0
    grouped = activations.reshape(batch * length, heads, block).permute(1, 0, 2)

    def gate(weight, bias):
        product = torch.baddbmm(bias[:, None, :], grouped, weight)
        return torch.sigmoid(product.transpose(0, 1).reshape(batch, length, width))

    input_gate = gate(lru.input_gate_weight, lru.input_gate_bias)
    log_a = -8.0 * gate(lru.recurrent_gate_weight, lru.recurrent_gate_bias) * F.softplus(lru.recurrent_param)
    decay = torch.exp(log_a) * ~reset
    multiplier = torch.sqrt(1 - torch.exp(2 * log_a))
    multiplier = reset + ~reset * multiplier
    normalized = activations * input_gate * multiplier.type(activations.dtype)
    state = torch.zeros(batch, width, dtype=torch.float32, device=activations.device) if state is None else state
    outputs, states = torch.empty_like(normalized), []
    for t in range(length):
        state = decay[:, t].float() * state.to(decay.device) + normalized[:, t].float()
        outputs[:, t] = state.type(normalized.dtype)
        states.append(state)
    return outputs, states
