"""Recurrent layers in a static form (linear attention, state spaces, short convolutions): fixed buffers, per-token
records written on the device, a row's kept count chosen by index. What :mod:`specresearch.models.static_cache` is
to attention layers, for the layers :mod:`specresearch.models.recurrent` rolls back in the growing cache.

A recurrent layer keeps no slot per token: a call rewrites its state. transformers' layers, recording their past
(``activate_past_recording``), run a call's last ``recurrent_states_to_keep`` tokens one at a time and hand the cache
the state after each (``update_recurrent_state`` with a list), and hand the convolution the call's inputs after the
kernel's window of earlier ones (``update_conv_state``). Here each state of a layer lives in one buffer
``held [span + 1, B, ...]``: ``held[0]`` the state after the row's kept tokens, ``held[1 + j]`` the state after the
j-th token written since (a call at ``offset`` o, a Python int as in the static KV cache, starts from ``held[o]`` and
writes ``held[o + 1 ..]``); each convolution's inputs in ``inputs [B, C, K + span]``: the K inputs before the kept end,
then those written since. :meth:`StaticStateLayer.commit` keeps ``n [B]`` of the written tokens per row:
``held[0] = held[n_b]`` and the window of the K inputs ending there, both gathers on the device, so a chain step
(score gamma + 1 tokens, keep n + 1) runs with no host read. ``span``: the most tokens written between two commits
(a chain's gamma + 1); a call past it is refused.

A call hands its layers a copy of the state it starts from (``work``), since some scans update the state they are
given in place (Zamba's one-token scan does). Models whose layers record one state a call
(:data:`~specresearch.models.recurrent.ONE_TOKEN_CALLS`) are fed one token a call by
:class:`~specresearch.models.static_lm.StaticCausalLM`. The prompt runs through the growing cache
(:class:`~specresearch.models.causal_lm.CausalLM`, whose per-family masks and padding rules it keeps) and its states
are loaded here (:meth:`StaticStateLayer.load`). A draft tree's nodes are not one sequence: the static form scores
chains only (trees stay the growing loop's, path by path).
"""

from __future__ import annotations

import torch

__all__ = ["SPAN", "StateCall", "StaticStateLayer", "mark_static", "state_layer_class", "allocate_form"]

SPAN = 16  # tokens written between two commits, by default (a chain of gamma <= 15)


def mark_static(*tensors: torch.Tensor) -> None:
    """Tell dynamo these tensors keep their address across calls (cache buffers mutated in place), so a compiled or
    CUDA-graph step reads them where they are instead of copying them in."""
    if not torch.compiler.is_compiling():
        for tensor in tensors:
            torch._dynamo.mark_static_address(tensor)


def allocate_form(form, batch: int, capacity: int, span: int | None) -> None:
    """``form.allocate(batch, capacity)`` for a static form (``models.protocols.StaticModel``), with ``span`` where the
    form is ``recurrent`` (the most tokens written between two commits: its states' records)."""
    if getattr(form, "recurrent", False):
        form.allocate(batch, capacity, span=span)
    else:
        form.allocate(batch, capacity)


class StateCall:
    """Where the current call starts, in tokens written since the last commit (set by the model before each call)."""

    offset: int = 0
    width: int = 1


def state_layer_class():
    """:class:`StaticStateLayer`'s base, transformers' ``LinearAttentionLayer`` (imported on first use)."""
    from transformers.cache_utils import LinearAttentionLayer

    return LinearAttentionLayer


class StaticStateLayer:
    """Mixin over transformers' ``LinearAttentionLayer``: one layer's states in fixed buffers (module docstring).
    Built by ``models.static_cache.static_kv_cache``; ``call``: the model's shared :class:`StateCall`."""

    def setup(self, number_of_states: int, batch: int, span: int, call: "StateCall") -> None:
        state_layer_class().__init__(self, number_of_states=number_of_states)
        self.record_past = True  # transformers' mixers then hand every token's state and the conv inputs to the cache
        self.recurrent_states_to_keep = span
        self.batch, self.span, self.call = batch, span, call
        self.held: dict[int, torch.Tensor] = {}
        self.work: dict[int, torch.Tensor] = {}
        self.inputs: dict[int, torch.Tensor] = {}

    def load(self, grown, clear: bool = False) -> None:
        """The states a growing cache's layer ``grown`` (transformers', after a prefill) holds, as the kept ones
        (``clear``: buffers of their shapes, the kept states zeros, as before any token)."""
        for i in range(self.number_of_states):
            if grown.is_recurrent_states_initialized[i]:
                state = grown.recurrent_states[i]
                if i not in self.held:
                    self.held[i] = state.new_zeros((self.span + 1, *state.shape))
                    self.work[i] = torch.zeros_like(state)
                    mark_static(self.held[i], self.work[i])
                self.held[i][0].copy_(state)
                if clear:
                    self.held[i][0].zero_()
                self.recurrent_states[i] = self.work[i]
                self.is_recurrent_states_initialized[i] = True
            if grown.is_conv_states_initialized[i]:
                conv, kernel = grown.conv_states[i], grown.conv_kernel_size[i]
                if i not in self.inputs:
                    self.inputs[i] = conv.new_zeros((*conv.shape[:-1], kernel + self.span))
                    mark_static(self.inputs[i])
                window = conv[..., -kernel:]
                self.inputs[i].zero_()
                if not clear:
                    self.inputs[i][..., kernel - window.shape[-1]: kernel].copy_(window)  # zeros before a short prompt
                self.conv_kernel_size[i] = kernel
                self.conv_states[i] = self.inputs[i][..., :kernel]
                self.is_conv_states_initialized[i] = True
            self.has_previous_state[i] = True

    steps_only = True  # every token of its calls is real (no padding): a block that reads validity off a mask need not

    def begin_call(self) -> None:
        """Hand the coming call the state it starts from (a copy: a scan may update it in place)."""
        self.recorded = set()
        offset, width = self.call.offset, self.call.width
        if offset + width > self.span:
            raise ValueError(f"a call of {width} tokens at {offset} written since the last commit passes the static "
                             f"form's span of {self.span}: allocate a larger span")
        for i, held in self.held.items():
            self.work[i].copy_(held[offset])
            self.recurrent_states[i] = self.work[i]
        for i, inputs in self.inputs.items():
            kernel = self.conv_kernel_size[i]
            self.conv_states[i] = inputs[..., offset: offset + kernel]

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size=None, **kwargs):
        """Write the call's inputs ``[B, C, k]`` after those before it; -> the kernel's window before them and them."""
        inputs, kernel, offset = self.inputs[state_idx], self.conv_kernel_size[state_idx], self.call.offset
        width = conv_states.shape[-1]
        inputs[..., kernel + offset: kernel + offset + width].copy_(conv_states)
        return inputs[..., offset: kernel + offset + width]

    def update_recurrent_state(self, recurrent_states, state_idx: int = 0, **kwargs):
        """Record the state after each of the call's tokens (a list) or after its one token; -> the last."""
        states = [recurrent_states] if isinstance(recurrent_states, torch.Tensor) else list(recurrent_states)
        if len(states) != self.call.width:
            raise RuntimeError(f"a recurrent layer recorded {len(states)} states for a call of {self.call.width} "
                               "tokens: its model records once a call (models.recurrent.ONE_TOKEN_CALLS)")
        offset = self.call.offset
        self.held[state_idx][1 + offset: 1 + offset + len(states)].copy_(torch.stack(states))
        self.recorded.add(state_idx)
        return states[-1]

    def end_call(self) -> None:
        """After a one-token call: a state the layer updated in place without recording it (Zamba's one-token scan)
        is recorded from the copy it was handed."""
        for i, work in self.work.items():
            if i not in self.recorded and self.call.width == 1:
                self.held[i][1 + self.call.offset].copy_(work)

    def commit(self, n: torch.Tensor) -> None:
        """Keep the first ``n [B]`` tokens written since the last commit (a gather per buffer, on the device)."""
        rows = torch.arange(self.batch, device=n.device)
        for held in self.held.values():
            held[0].copy_(held[n, rows])
        for i, inputs in self.inputs.items():
            kernel = self.conv_kernel_size[i]
            at = n[:, None] + torch.arange(kernel, device=n.device)  # [B, K]: the window ending at the kept end
            at = at.view(at.shape[0], *([1] * (inputs.dim() - 2)), kernel).expand(*inputs.shape[:-1], kernel)
            inputs[..., :kernel].copy_(inputs.gather(-1, at))

    def kept(self) -> list[torch.Tensor]:
        """Views of what :meth:`commit` writes: each kept state and each convolution's window."""
        return [held[0] for held in self.held.values()] + [
            inputs[..., :self.conv_kernel_size[i]] for i, inputs in self.inputs.items()]

    def get_seq_length(self) -> int:
        return 0  # positions and masks are always given (models.static_cache.StaticRows.call)

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int):
        raise RuntimeError("a static recurrent layer keeps what commit() says; it is not cropped")
