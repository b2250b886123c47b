"""P-EAGLE heads (parallel drafting EAGLE-3) as vllm-project/speculators saves them: load, draft in the engine.

The facts are read from speculators 0.9.0's ``src/speculators/models/peagle/{config,core,attention,data}.py`` and
its trainer's ``shift_batch`` (``models/eagle3/data.py``), the code that trains these heads (our code, their facts):

* layout: an EAGLE-3 head in speculators' layout (``drafts.speculators``) with ``speculators_model_type: "peagle"``,
  ``mask_token_id`` (the token id of every mask slot; speculators' config allows none, which its training cannot
  run: refused here) and two tensors beside EAGLE-3's: ``mask_hidden [1, 1, n T]`` (a learned stand-in for the
  target's ``n`` concatenated features) and ``embed_tokens.weight`` (trained with the head, ``embed_requires_grad``);
  the trained depth K is ``speculators_config.proposal_methods[0].speculative_tokens`` (its ``num_depths``,
  default 8);
* one rollout (``PEagleDraftModel.forward`` with ``create_peagle_mask_mod``): after ``shift_batch`` slot j holds
  token ``x_{j+1}`` with the target's features of slot j, as an EAGLE-3 head reads them (depth 0). Depth d >= 1 of
  the rollout anchored at slot j sits at position ``j + d`` and reads ``embed(mask_token_id)`` and ``mask_hidden``
  (through ``fc_norm`` / ``input_norm`` and ``fc``, as features are); it sees the depth-0 slots up to j and its own
  rollout's depths up to d: a causal pass over the head's context followed by the mask slots. Depth d is trained
  (KL to the target's logits at ``j + d``) to predict ``x_{j+d+2}``, the (d + 1)-th token after the anchor's; the
  logits are ``lm_head(norm(h))`` over the draft vocabulary (``d2t``), whatever ``norm_output`` says.

So one head call drafts K tokens: the d-th drafted token's law reads the context only, never the tokens drafted
before it (the draft's q is a product over depths, which every verifier accepts: q may be any law given the
context). :class:`PEagleDraft` runs the mask slots in the call that feeds the target's true features (the pending
block after each verification) and keeps their logits; the engine's drafting calls then read them one depth at a
time, each adding an empty slot so the engine's rollback counts hold (it drops them all before it re-feeds the
accepted tokens). At most K tokens a step (``plan_length``; a tree deeper than K is refused). vLLM 0.34 refuses this
layout (``transformers_utils/configs/speculators/algos.py``: "P-EAGLE ... is not supported"). In the captured steps
(``engine.static``) :class:`StaticPEagleDraft` runs the mask slots of every re-fed column in the re-feed's call.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from specresearch.drafts.eagle import EagleDraft, read_eagle3_head
from specresearch.drafts.feature_draft import FeatureDraft, StaticFeatureDraft, windowed
from specresearch.drafts.speculators import SPECULATORS_KEY, speculators_eagle3_config
from specresearch.models.static_cache import StaticPast

__all__ = ["PEagleDraft", "StaticPEagleDraft", "load_peagle", "speculators_peagle_config", "is_peagle_dir", "PEAGLE_TENSORS"]

PEAGLE_TENSORS = {"mask_hidden": ("1", "1", "3T")}  # beside EAGLE-3's, in drafts.eagle's size letters


def speculators_peagle_config(config: dict) -> tuple[dict, int, int]:
    """A P-EAGLE head's ``config.json`` as speculators saves it -> (the EAGLE-3 config ``drafts.eagle`` reads, the
    mask token id, the depths trained); ``ValueError`` in one line for what this loader does not read."""
    if config.get("mask_token_id") is None:
        raise ValueError("speculators P-EAGLE config without mask_token_id: the mask slots' token is unknown (its "
                         "training cannot run without one either)")
    try:
        depths = int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    except (KeyError, IndexError, TypeError, ValueError):
        raise ValueError("speculators P-EAGLE config without speculators_config.proposal_methods[0]."
                         "speculative_tokens: the number of depths the head was trained to draft is unknown") from None
    if depths < 1:
        raise ValueError(f"speculators P-EAGLE config with {depths} speculative tokens: at least 1")
    flat = speculators_eagle3_config({k: v for k, v in config.items() if k != "mask_token_id"} | {SPECULATORS_KEY: "eagle3"})
    return flat, int(config["mask_token_id"]), depths


def is_peagle_dir(directory: str | os.PathLike) -> bool:
    """Whether ``directory``'s config is a P-EAGLE head's as speculators saves it."""
    config = Path(directory) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get(SPECULATORS_KEY) == "peagle"


class PEagleDraft(EagleDraft):
    """A P-EAGLE head behind the engine's interface (module docstring): an :class:`EagleDraft` whose feeding call also
    runs ``depths - 1`` mask slots and whose drafting calls read their logits (``[B, depths - 1, V]``, ``_block``)."""

    def __init__(self, head, mask_token_id: int, mask_hidden: torch.Tensor, depths: int, **options) -> None:
        super().__init__(head, **options)
        if not 0 <= mask_token_id < self.vocab_size:
            raise ValueError(f"P-EAGLE mask_token_id {mask_token_id} is not a token id of the target's vocabulary "
                             f"(0..{self.vocab_size - 1})")
        self.mask_token_id, self.depths = int(mask_token_id), int(depths)
        self.mask_hidden = mask_hidden.detach().float().reshape(1, 1, -1).to(self.device)
        self._block: torch.Tensor | None = None
        self._drafted = 0  # empty slots added since the last feeding call

    @property
    def format(self) -> str:
        return "P-EAGLE"

    def reset(self, batch_size: int) -> None:
        super().reset(batch_size)
        self._block, self._drafted = None, 0

    def plan_length(self, gamma: int) -> int:
        """At most the ``depths`` the head was trained to draft."""
        return min(gamma, self.depths)

    @torch.no_grad()
    def score(self, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """With queued features: append ``tokens [B, k]`` and return their logits ``[B, k, V]`` (the mask slots run in
        the same call). Else (k = 1, a drafted token): an empty slot, and the next depth's logits ``[B, 1, V]``."""
        if self._slots is None or self._queued is not None:
            return self.head.logits(self._append(tokens, valid))
        if self._block is None or tokens.shape[1] != 1:
            raise ValueError("a P-EAGLE draft needs the target's features (observe) before scoring these tokens")
        if self._drafted >= self._block.shape[1]:
            raise ValueError(f"a P-EAGLE head trained on {self.depths} depths drafts at most {self.depths} tokens a "
                             "step (gamma, or a tree's depth)")
        batch = tokens.shape[0]
        self._slots.append(torch.ones(batch, 1, dtype=torch.bool, device=self.device) if valid is None else valid.bool())
        self._cache = [(torch.cat([k, k.new_zeros(*k.shape[:2], 1, k.shape[-1])], 2),
                        torch.cat([v, v.new_zeros(*v.shape[:2], 1, v.shape[-1])], 2)) for k, v in self._cache]
        self._drafted += 1
        return self._block[:, self._drafted - 1 : self._drafted]

    def _append(self, tokens: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """The true-feature slots for ``tokens [B, k]`` and, in the same head call, the mask slots after them (dropped
        from the cache again, their logits kept) -> the true slots' outputs ``[B, k, H]``."""
        if self._slots is None:
            raise ValueError("score called before prefill/reset: start a batch first")
        if self._drafted:
            raise ValueError(f"a P-EAGLE draft's {self._drafted} drafted slots hold no state: roll them back before "
                             "feeding tokens with the target's features")
        queued = self._take_queued(tokens)
        if queued is None:
            raise ValueError("a P-EAGLE draft needs the target's features (observe) before scoring these tokens")
        (batch, k), width = tokens.shape, self.depths - 1
        tokens = tokens.to(self.device)
        valid = torch.ones(batch, k, dtype=torch.bool, device=self.device) if valid is None else valid.bool().to(self.device)
        inputs = self.head.fuse_features(torch.cat([queued, self.mask_hidden.expand(batch, width, -1)], 1))
        ids = torch.cat([tokens, tokens.new_full((batch, width), self.mask_token_id)], 1)
        hidden = self._run(ids, torch.cat([valid, valid.new_ones(batch, width)], 1), inputs)
        FeatureDraft.rollback(self, width)  # the mask slots: not context for anything after this step
        self._block = self.head.logits(hidden[:, k:])
        return hidden[:, :k]

    def rollback(self, n) -> None:
        """Forget the last ``n`` slots; the drafted depths' logits with them (the next call feeds true features)."""
        super().rollback(n)
        if self._drafted:  # the engine's counts are Python ints: a tensor is read back only outside its loop
            self._drafted = max(0, self._drafted - min(torch.as_tensor(n).reshape(-1).tolist()))
        self._block = None

    def _rows(self, change) -> None:
        super()._rows(change)
        self._block = None if self._block is None else change(self._block)

    def static_form(self) -> "StaticPEagleDraft":
        """This head in the engine's captured steps (:class:`StaticPEagleDraft`)."""
        return StaticPEagleDraft(self)


class _MaskSlotsPast(StaticPast):
    """A layer's static keys and values whose call writes only its first ``kept`` slots (the re-fed tokens'); the mask
    slots' keys and values follow the buffers' as extra columns, seen in this call only."""

    kept: int | None = None  # None: every slot of the call (the prompt's)

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = keys.shape[2] if self.kept is None else self.kept
        buffers = super().extend(keys[:, :, :k], values[:, :, :k])
        return torch.cat([buffers[0], keys[:, :, k:]], 2), torch.cat([buffers[1], values[:, :, k:]], 2)


class StaticPEagleDraft(StaticFeatureDraft):
    """A P-EAGLE head in the engine's captured steps: the EAGLE-3 head's static form (``drafts.feature_draft.
    StaticFeatureDraft``) whose re-feed (:meth:`refeed`) also runs, for every re-fed column as the anchor, the ``depths
    - 1`` mask slots after it in the same head call: each sees the kept context up to its column and its own column's
    mask slots up to itself, at positions after the column's, and writes nothing to the cache (their keys are extra
    columns of that call). Each column's mask slots' outputs are its prediction, which the engine gathers at the next
    token's column; a drafting call at depth d (a chain's ``offset = d - 1``, a tree's ``(d - 1) K``) gives the head's
    logits of mask slot d. The growing draft runs the mask slots after the last column only (it re-feeds exactly the
    accepted tokens); here the re-feed's width is fixed and the column kept is known after the call."""

    def __init__(self, draft: PEagleDraft):
        super().__init__(draft)
        self.mask_token_id, self.depths, self.mask_hidden = draft.mask_token_id, draft.depths, draft.mask_hidden

    def allocate(self, batch: int, capacity: int) -> None:
        super().allocate(batch, capacity)
        self._pasts = [_MaskSlotsPast(batch, capacity) for _ in self.head.layers]

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, leave: int = 0,
                inputs: torch.Tensor | None = None):
        """The EAGLE-3 head's prefill (its prompt slots written as its static form writes them)."""
        for past in self._pasts:
            past.kept = None
        return super().prefill(input_ids, attention_mask, leave=leave, inputs=inputs)

    @torch.no_grad()
    def refeed(self, tokens: torch.Tensor, *, inputs: torch.Tensor):
        """Write ``tokens [B, k]`` read with ``inputs [B, k, H]`` and run every column's mask slots; keeps nothing. ->
        (logits ``[B, k, V]``, each column's mask slots' outputs ``[B, k, (depths - 1) H]``)."""
        (batch, k), width, rows = tokens.shape, self.depths - 1, self.rows
        call = rows.call(k)
        masked = call.positions[:, :, None] + torch.arange(1, width + 1, device=self.device)  # [B, k, W]
        positions = torch.cat([call.positions, masked.reshape(batch, -1)], 1)
        ids = torch.cat([tokens, tokens.new_full((batch, k * width), self.mask_token_id)], 1)
        fill = self.head.fuse_features(self.mask_hidden.to(inputs.device).expand(batch, k * width, -1))
        seen = (rows.columns[None, None] >= rows.start[:, None, None]) & (
            rows.columns[None, None] <= call.slots[:, :, None])  # [B, k, C]: the context up to each column
        own = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        group = torch.block_diag(*[own] * k)  # [kW, kW]: a column's mask slots up to themselves
        allowed = torch.cat([
            torch.cat([call.allowed, seen.new_zeros(batch, k, k * width)], 2),
            torch.cat([seen.repeat_interleave(width, 1), group[None].expand(batch, -1, -1)], 2)], 1)
        keys_at = torch.cat([call.key_positions, masked.reshape(batch, -1)], 1)
        allowed = windowed(allowed, getattr(self.head, "window", None), positions, keys_at)
        for past in self._pasts:
            past.slots, past.kept = call.slots, k
        hidden, _ = self.head.block(torch.cat([inputs, fill.to(inputs.dtype)], 1), ids, positions, self._pasts, allowed)
        return self.head.logits(hidden[:, :k]), hidden[:, k:].reshape(batch, k, width * hidden.shape[-1])

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, *, inputs: torch.Tensor, offset: int = 0, depth=None, visible=None):
        """A drafting call at depth ``offset // k + 1``: mask slot d's logits from its column's ``inputs`` (the
        re-feed's prediction). -> (logits ``[B, k, V]``, ``inputs``)."""
        (batch, k), d = tokens.shape, offset // tokens.shape[1] + 1
        if d >= self.depths:
            raise ValueError(f"a P-EAGLE head trained on {self.depths} depths drafts at most {self.depths} tokens a "
                             "step (gamma, or a tree's depth)")
        return self.head.logits(inputs.view(batch, k, self.depths - 1, -1)[:, :, d - 1]), inputs


def load_peagle(target_lm, directory: str | os.PathLike, *, device=None) -> PEagleDraft:
    """A P-EAGLE head saved by speculators (module docstring) as a draft for ``target_lm`` (a ``CausalLM``); a
    missing, unknown or misshapen tensor is refused with its name and the shape expected."""
    directory = Path(directory)
    if not is_peagle_dir(directory):
        raise ValueError(f"{directory} is not a P-EAGLE head: expected config.json with speculators_model_type "
                         "'peagle' (the vllm-project/speculators layout)")
    flat, mask_token_id, depths = speculators_peagle_config(json.loads((directory / "config.json").read_text()))
    head, tensors = read_eagle3_head(target_lm, directory, flat, PEAGLE_TENSORS, "P-EAGLE")
    return PEagleDraft(head, mask_token_id, tensors["mask_hidden"], depths, max_context=target_lm.max_context,
                       device=device or target_lm.device)
