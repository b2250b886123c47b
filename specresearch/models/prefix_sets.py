"""Two rotary sets in one run, each token drawn from its prefix's (:class:`PrefixSets`).

Phi-3's long factors (``longrope``: Phi-3 128k, Phi-3.5, Phi-4-mini; PhiMoE's scale likewise) rotate a sequence longer
than ``original_max_position_embeddings`` by the long set and a shorter one by the original set. The model's law of the
token after a prefix is therefore the uncached forward of that prefix with its own set: the original one up to the
original length, the long one past it, where every key, the prompt's too, is rotated by the long set. transformers'
Phi-3 ``generate`` draws so (it recomputes its cache once the sequence passes the length). A cache rotated by one set
for the whole run (:func:`~specresearch.models.rotary.plan_rotaries`) draws the first tokens of a run that crosses
the length from the long set.

So a ``CausalLM`` planned for a run that crosses it (:func:`~specresearch.models.rotary.set_change`) keeps two
caches, one per set: each call runs on both (the short one rotated by the original set), and each output, a slot's
logits and hidden states, comes from the cache of its prefix's set, row by row. Once every row's call starts past
the length the short cache is dropped, and the run goes on with one. The cost: until then each call runs twice,
reads the rows' lengths once on the host, and the caches hold twice the keys; a run whose prompts all pass the
length, or whose context stays within it, keeps one cache. A static cache holds one set: such a run has no captured
steps (``CausalLM.static_refusal``).
"""

from __future__ import annotations

import functools
import inspect

import torch

from specresearch.models import rotary

__all__ = ["PrefixSets", "both_sets"]


class PrefixSets:
    """The second cache of a ``CausalLM`` whose run changes its rotary set past ``limit`` positions (module
    docstring); ``context``: the run's planned length, whose set the model's own cache holds."""

    def __init__(self, lm, limit: int, context: int):
        if lm.recurrent:
            raise ValueError(f"{type(lm.model).__name__} has recurrent layers and changes its rotary set at position "
                             f"{limit} within a run of {context}: keep the run within {limit} positions")
        self.lm, self.limit, self.context = lm, limit, context
        self.short = None  # the original set's (cache, slots), (None, None) before its reset; None: not kept
        self.busy = False  # inside a call on both caches: the methods it calls run as they are

    def call(self, method, lm, args: tuple, kwargs: dict, prefixes):
        """Run ``method`` on the short cache, then on the model's own, and splice their outputs by ``prefixes`` (the
        length of the prefix each output slot follows, None: nothing to splice)."""
        if method.__name__ in ("reset", "prefill"):  # a new run starts with both
            self.short = (None, None)
        prefix = None
        if prefixes is not None and self.short is not None:
            prefix = _PREFIXES[prefixes](lm, inspect.signature(method).bind(lm, *args, **kwargs).arguments)
            if int(prefix.min()) > self.limit:  # every row past the length: the short cache is not needed again
                self.short = None
        if self.short is None:
            return method(lm, *args, **kwargs)
        self.busy = True
        try:
            own = lm._cache, lm._slots
            lm._cache, lm._slots = self.short
            rotary.plan_rotaries(lm.model, self.limit)
            try:
                first = method(lm, *args, **kwargs)
            finally:
                self.short = lm._cache, lm._slots
                lm._cache, lm._slots = own
                rotary.plan_rotaries(lm.model, self.context)
            second = method(lm, *args, **kwargs)
        finally:
            self.busy = False
        return second if prefix is None else _splice(first, second, prefix > self.limit)


def both_sets(prefixes: str | None = None):
    """Decorate a ``CausalLM`` method to run on both caches where the model keeps :class:`PrefixSets`; ``prefixes``
    names how its output slots' prefix lengths follow from its arguments ("prompt", "chain", "tree")."""
    def decorate(method):
        @functools.wraps(method)
        def run(lm, *args, **kwargs):
            sets = getattr(lm, "_sets", None)
            if sets is None or sets.busy:
                return method(lm, *args, **kwargs)
            return sets.call(method, lm, args, kwargs, prefixes)
        return run
    return decorate


def _prompt(lm, arguments) -> torch.Tensor:
    return arguments["attention_mask"].to(lm.device).long().cumsum(-1)  # [B, L]: a pad's is its row's before


def _chain(lm, arguments) -> torch.Tensor:
    tokens, valid = arguments["tokens"], arguments.get("valid")
    valid = torch.ones(tokens.shape, dtype=torch.long, device=lm.device) if valid is None else valid.to(lm.device).long()
    return lm.valid_lengths[:, None] + valid.cumsum(-1)  # [B, k]


def _tree(lm, arguments) -> torch.Tensor:
    slots = lm._slots  # a node sits at (valid slots before the tree) + its depth
    return slots.mask[:, :slots.tree_start].sum(-1, keepdim=True) + arguments["depth"].to(lm.device) + 1  # [B, k]


_PREFIXES = {"prompt": _prompt, "chain": _chain, "tree": _tree}


def _splice(first, second, long: torch.Tensor):
    """``second``'s outputs (logits ``[B, V]`` of a prompt's last slot or ``[B, k, V]``, hidden states
    ``[B, k, H]``) where ``long [B, k]``, ``first``'s elsewhere."""
    if isinstance(first, tuple):
        return tuple(_splice(a, b, long) for a, b in zip(first, second))
    where = long if first.dim() == long.dim() + 1 else long[:, -1]
    return torch.where(where[..., None].to(first.device), second, first)
