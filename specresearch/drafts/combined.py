"""Prompt lookup where the context matches, another draft elsewhere (:class:`LookupOrDraft`).
"""

from __future__ import annotations

import torch

from specresearch.checks import check_int
from specresearch.drafts.ngram import NGramDraft
from specresearch.models.slots import SlotMask, rollback_counts
from specresearch.models.static_cache import StaticRows
from specresearch.models.static_states import allocate_form

__all__ = ["LookupOrDraft", "StaticLookupOrDraft"]


class LookupOrDraft:
    """Prompt lookup where the context has a match, another draft elsewhere: a combined draft.

    Per row and slot, the logits are the :class:`NGramDraft`'s ``log q`` when the context's suffix of
    ``min_match`` or more tokens occurred earlier in it (:func:`ngram_match_length`), else the wrapped
    draft's. The engine samples each draft token from ``logits_to_probs`` of exactly those logits and
    hands that law to the verifier, so q is the law actually sampled from. A wrapped feature draft keeps
    its feature channel (``feature_layers``, ``observe`` are forwarded).

    ``lazy`` (default): the wrapped draft is fed only when its logits are needed. Slots scored while every
    valid (row, slot) has a match wait in a backlog (tokens, validity, observed features) that rollbacks
    trim like a cache, and are fed in one call, ahead of the slots that need them. The wrapped draft
    then computes exactly what it would have computed slot by slot (up to float rounding of a wider
    call): a feature draft's own-prediction slots are fed one at a time after the true-feature slots
    before them. While lookup drafts, the wrapped draft costs nothing. ``lazy=False`` feeds it every slot.

    ``draft_gamma`` (:class:`PlansLength`): a step where some row's context ends in a match of ``plan_match``
    tokens or more (default ``min_match``) drafts the engine's full gamma; any other step drafts at most
    ``draft_gamma`` tokens. Lookup drafts are cheap and, where they match, long runs of them are accepted;
    a trained draft's best length is usually shorter. ``None`` (default) always drafts the engine's gamma.
    With ``plan_match < min_match`` a weaker match already plans a long step, whose first token the
    wrapped draft may still propose.
    """

    def __init__(self, draft, *, max_ngram: int = 3, min_match: int = 2, floor: float = 0.02, lazy: bool = True,
                 draft_gamma: int | None = None, plan_match: int | None = None):
        plan_match = min_match if plan_match is None else plan_match
        for field, value in (("min_match", min_match), ("plan_match", plan_match)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= max_ngram:
                raise ValueError(f"{field} must be an integer in 1..max_ngram={max_ngram}, got {value!r}")
        if draft_gamma is not None:
            check_int("draft_gamma", draft_gamma, meaning="or None")
        self.draft, self.min_match, self.plan_match = draft, min_match, plan_match
        self.lazy, self.draft_gamma = lazy, draft_gamma
        self.lookup = NGramDraft(draft.vocab_size, max_ngram=max_ngram, floor=floor, device=draft.device)
        self.vocab_size, self.device = draft.vocab_size, draft.device
        self.max_context = getattr(draft, "max_context", None)
        self._reads = hasattr(draft, "feature_layers")
        if self._reads:  # the wrapped draft reads the target's features: forward the channel
            self.feature_layers, self.feature_size = draft.feature_layers, draft.feature_size
        self._backlog: _Backlog | None = None
        self._observed: torch.Tensor | None = None  # [B, k, F] features for the next k slots scored
        self._next_match: torch.Tensor | None = None  # [B] match length of each row's context, for the next token
        self.draft_slots_fed = 0  # slots the wrapped draft computed (lazy: fewer than the slots scored)

    @property
    def cache_length(self) -> int:
        return self.draft.cache_length + (0 if self._backlog is None else self._backlog.length)

    def observe(self, features: torch.Tensor) -> None:
        if features.ndim != 3 or features.shape[-1] != self.feature_size:
            raise ValueError(f"features must be [B, k, {self.feature_size}] (target hidden states {self.feature_layers}), "
                             f"got shape {tuple(features.shape)}")
        if self.lazy:
            self._observed = features
        else:
            self.draft.observe(features)

    def reset(self, batch_size: int) -> None:
        self.lookup.reset(batch_size)
        self.draft.reset(batch_size)
        self._backlog, self._observed, self._next_match = _Backlog(batch_size), None, None

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        looked = self.lookup.prefill(input_ids, attention_mask)
        self._backlog = _Backlog(input_ids.shape[0])
        if self._observed is not None:
            self.draft.observe(self._observed)
            self._observed = None
        self.draft_slots_fed += input_ids.shape[1]
        matches = self.lookup.match_lengths()
        self._next_match = matches
        return self._choose(looked, self.draft.prefill(input_ids, attention_mask), matches)

    def plan_context(self, positions: int, shortest: int | None = None) -> bool:
        """The wrapped draft's plan of the run's context (``models.protocols.PlansContext``), where it has one."""
        plan = getattr(self.draft, "plan_context", None)
        return bool(plan(positions, shortest)) if plan is not None else False

    @property
    def static_refusal(self) -> str | None:
        """Why this draft has no static form (the wrapped draft has none), or None."""
        if not hasattr(self.draft, "static_form"):
            return f"prompt lookup over {type(self.draft).__name__}, which has no static form"
        return getattr(self.draft, "static_refusal", None)

    @property
    def recurrent(self) -> bool:
        """Whether the wrapped draft has recurrent layers (its captured steps then draft chains only)."""
        return bool(getattr(self.draft, "recurrent", False))

    def static_form(self) -> "StaticLookupOrDraft":
        """Prompt lookup and the wrapped draft's static form in the engine's captured steps (:class:`StaticLookupOrDraft`)."""
        if self.static_refusal:
            raise ValueError(f"{self.static_refusal}: run the growing loop (compile='off')")
        return StaticLookupOrDraft(self)

    def fixed_length(self, gamma: int) -> int | None:
        """The tokens every step drafts (``models.protocols.PlansLength``): ``gamma``, or None where the length plan
        (``draft_gamma`` below ``gamma``) decides it per step on the host."""
        return gamma if self.draft_gamma is None or self.draft_gamma >= gamma else None

    def plan_length(self, gamma: int) -> int:
        """``gamma`` if some row's context ends in a match of ``plan_match`` tokens or more (or ``draft_gamma``
        is None), else ``min(gamma, draft_gamma)``."""
        if self.draft_gamma is None or self._next_match is None or bool((self._next_match >= self.plan_match).any()):
            return gamma
        return min(gamma, self.draft_gamma)

    def score(self, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Append ``tokens [B, k]`` (``valid [B, k]``); return logits ``[B, k, V]``."""
        if self._backlog is None:
            raise ValueError("score called before prefill/reset: start a batch first")
        if not self.lazy:
            return self._score_every_slot(tokens, valid)
        features, self._observed = self._observed, None
        if self._reads:
            if features is None and tokens.shape[1] != 1:
                raise ValueError("a feature draft needs the target's features (observe) before scoring these tokens")
            if features is not None and features.shape[:2] != tokens.shape:
                raise ValueError(f"observed features cover {tuple(features.shape[:2])} slots but tokens are {tuple(tokens.shape)}")
        looked, matches = self._look(tokens, valid)
        self._next_match = matches[:, -1]
        slot_valid = torch.ones(tokens.shape, dtype=torch.bool) if valid is None else valid.bool().cpu()
        self._backlog.append(tokens, slot_valid, features)
        if not bool((slot_valid & (matches < self.min_match)).any()):  # lookup drafts every valid slot
            return looked.to(self.device)
        return self._choose(looked, self._flush()[:, -tokens.shape[1] :], matches)

    def rollback(self, n) -> None:
        counts = rollback_counts(n, self._backlog.batch, "cpu")
        self.lookup.rollback(counts)
        self._next_match = None
        rest = counts if not self.lazy else self._backlog.drop(counts)  # [B] what the wrapped draft has to drop
        if not self.lazy or bool((rest > 0).any()):
            self.draft.rollback(rest.to(self.draft.device))

    def repeat_rows(self, k: int) -> None:
        """Each row becomes ``k`` consecutive copies (the lookup, the wrapped draft and what waits for it)."""
        self._rows(lambda t: t.repeat_interleave(k, 0), lambda m: m.repeat_rows(k))

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index [B']``, in that order."""
        self._rows(lambda t: t[index.to(t.device)], lambda m: m.select_rows(index.to(m.device)))

    def _rows(self, change, change_model) -> None:
        change_model(self.lookup)
        change_model(self.draft)
        self._observed = None if self._observed is None else change(self._observed)
        self._next_match = None if self._next_match is None else change(self._next_match)
        if self._backlog is not None:
            self._backlog.change_rows(change)

    def _score_every_slot(self, tokens: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        drafted = self.draft.score(tokens, valid)  # [B, k, V]
        self.draft_slots_fed += tokens.shape[1]
        looked, matches = self._look(tokens, valid)
        self._next_match = matches[:, -1]
        return self._choose(looked, drafted, matches)

    def _look(self, tokens: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the lookup slot by slot. -> (its logits ``[B, k, V]``, match lengths ``[B, k]``)."""
        looked, matches = [], []
        for j in range(tokens.shape[1]):
            looked.append(self.lookup.score(tokens[:, j : j + 1], None if valid is None else valid[:, j : j + 1])[:, 0])
            matches.append(self.lookup.match_lengths())
        return torch.stack(looked, 1), torch.stack(matches, 1)

    def _flush(self) -> torch.Tensor:
        """Feed the backlog to the wrapped draft: true-feature (or feature-free) runs in one call each, a
        feature draft's own-prediction slots one by one. -> the last run's logits ``[B, k, V]``."""
        logits = None
        for tokens, valid, features in self._backlog.runs(self._reads):
            if features is not None:
                self.draft.observe(features)
            logits = self.draft.score(tokens.to(self.draft.device), valid.to(self.draft.device))
            self.draft_slots_fed += tokens.shape[1]
        self._backlog = _Backlog(self._backlog.batch)
        return logits

    def _choose(self, looked: torch.Tensor, drafted: torch.Tensor, matches: torch.Tensor) -> torch.Tensor:
        """Lookup's logits where ``matches`` (``[B]`` or ``[B, k]``) reach ``min_match``, else the wrapped draft's."""
        use = (matches >= self.min_match).to(drafted.device)[..., None]
        return torch.where(use, looked.to(drafted.device, drafted.dtype), drafted)


class StaticLookupOrDraft:
    """:class:`LookupOrDraft` in the engine's captured steps (chains and draft trees): each slot's logits are prompt
    lookup's ``log q`` where its context's suffix of ``min_match`` or more tokens occurred earlier in it (a tree node's
    context: the kept one, then its own path), else the wrapped draft's static form's, whose state and predictions it
    passes on. The lookup is its own static form (``drafts.ngram.StaticNGramDraft``: a static buffer of each slot's
    token, looked up on the device), so nothing reads the host but ``allocate`` and ``prefill``; the
    wrapped draft runs every call (laziness is a host decision: on a GPU its calls cost a step's launches, not its
    weights). A feature draft wrapped keeps the feature channel."""

    def __init__(self, draft: LookupOrDraft) -> None:
        self.inner = draft.draft.static_form()
        self.looker = draft.lookup.static_form()  # prompt lookup's own static form: its token buffer and rows
        self.min_match = draft.min_match
        self.vocab_size, self.device = draft.vocab_size, draft.device
        self.max_context = draft.max_context
        if draft._reads:  # a feature draft wrapped: forward its channel (models.protocols.StaticFeatureModel)
            self.feature_layers, self.feature_size = self.inner.feature_layers, self.inner.feature_size
        if hasattr(self.inner, "refeed"):  # a block drafter's own re-feed (engine.static re-feeds through it)
            self.refeed = self._refeed

    @property
    def rows(self) -> StaticRows:
        return self.looker.rows

    @property
    def held_rows(self) -> list[StaticRows]:
        """The lookup's rows and the wrapped draft's: every extent a step changes (``engine.static``'s small state)."""
        return [self.looker.rows, *getattr(self.inner, "held_rows", [self.inner.rows])]

    def bind(self, target) -> None:  # a wrapped draft that reads its target's cache (models.protocols.BindsTarget)
        if hasattr(self.inner, "bind"):
            self.inner.bind(target)

    @property
    def recurrent(self) -> bool:
        return bool(getattr(self.inner, "recurrent", False))

    @property
    def held_states(self) -> list[torch.Tensor]:
        """The wrapped draft's kept recurrent states (``models.static_lm.StaticCausalLM.held_states``), if any."""
        return list(getattr(self.inner, "held_states", []))

    def allocate(self, batch: int, capacity: int, span: int | None = None) -> None:
        """``span``: for a wrapped draft with recurrent layers, the most tokens written between two commits."""
        allocate_form(self.inner, batch, capacity, span)
        self.looker.allocate(batch, capacity)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        return self.inner.fuse(features)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, leave: int = 0, **inputs):
        """Start a batch: the wrapped draft's prefill, and the lookup's (the prompt's first ``L - leave`` tokens)."""
        self.looker.prefill(input_ids, attention_mask, leave=leave)
        return self.inner.prefill(input_ids, attention_mask, leave=leave, **inputs)

    def _choose(self, tokens: torch.Tensor, offset: int, visible, logits: torch.Tensor) -> torch.Tensor:
        """Lookup's logits (:meth:`~specresearch.drafts.ngram.StaticNGramDraft.look`) where its match reaches
        ``min_match``, else ``logits``, slot by slot."""
        looked, matches = self.looker.look(tokens, offset, visible)
        return torch.where((matches >= self.min_match)[:, :, None], looked, logits)

    def _refeed(self, tokens: torch.Tensor, **inputs):
        logits, extra = self.inner.refeed(tokens, **inputs)
        return self._choose(tokens, 0, None, logits), extra

    def forward(self, tokens: torch.Tensor, *, offset: int = 0, depth=None, visible=None, **inputs):
        logits, extra = self.inner.forward(tokens, offset=offset, depth=depth, visible=visible, **inputs)
        return self._choose(tokens, offset, visible, logits), extra

    def commit(self, n) -> None:
        self.inner.commit(n)
        self.looker.commit(n)

    def keep_path(self, source: torch.Tensor, n: torch.Tensor) -> None:
        self.inner.keep_path(source, n)
        self.looker.keep_path(source, n)


class _Backlog:
    """Slots appended to a wrapped draft but not yet fed to it: tokens, validity and (feature drafts) the
    observed features per slot, trimmed by rollbacks exactly as a cache's ``SlotMask`` is."""

    def __init__(self, batch: int):
        self.batch = batch
        self.tokens = torch.zeros(batch, 0, dtype=torch.long)
        self.slots = SlotMask(torch.zeros(batch, 0, dtype=torch.bool))
        self.features: list[torch.Tensor | None] = []  # per slot: [B, F] true features, or None (own prediction)

    @property
    def length(self) -> int:
        return self.slots.length

    def append(self, tokens: torch.Tensor, valid: torch.Tensor, features: torch.Tensor | None) -> None:
        self.tokens = torch.cat([self.tokens, tokens.cpu()], 1)
        self.slots.append(valid)
        self.features += [None] * tokens.shape[1] if features is None else list(features.unbind(1))

    def change_rows(self, change) -> None:
        """Apply ``change`` (e.g. ``t[index]``) to every per-row tensor: tokens, slot mask, features."""
        slots = self.slots
        self.tokens, slots.mask, slots.positions = (change(t) for t in (self.tokens, slots.mask, slots.positions))
        self.features = [None if f is None else change(f) for f in self.features]
        self.batch = self.tokens.shape[0]

    def drop(self, n: torch.Tensor) -> torch.Tensor:
        """Forget the last ``min(n[b], length)`` slots of row b. -> ``[B]`` what each row has left to drop."""
        here = n.clamp(max=self.length)
        common = self.slots.drop(here)
        self.tokens = self.tokens[:, : self.length]
        del self.features[len(self.features) - common :]
        return n - here

    def runs(self, reads: bool):
        """``(tokens [B, k], valid [B, k], features [B, k, F] | None)`` in order: consecutive true-feature
        slots (all slots, for a draft that reads no features) together, own-prediction slots alone."""
        start = 0
        for end in range(1, self.length + 1):
            if end < self.length and self.features[end] is not None and self.features[start] is not None:
                continue
            if end < self.length and not reads:
                continue
            features = None if self.features[start] is None else torch.stack(self.features[start:end], 1)
            yield self.tokens[:, start:end], self.slots.mask[:, start:end], features
            start = end
