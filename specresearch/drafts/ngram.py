"""N-gram prompt lookup as a draft with a proper distribution (:class:`NGramDraft`), and in the engine's captured
steps (:class:`StaticNGramDraft`, the lookup on the device: :func:`lookup_at_slots`).
"""

from __future__ import annotations

import torch

from specresearch.models.causal_lm import check_prompt
from specresearch.models.slots import SlotMask
from specresearch.models.static_cache import StaticRows, keep_path, mark_static

__all__ = ["NGramDraft", "StaticNGramDraft", "ngram_probs", "ngram_match_length", "lookup_at_slots", "lookup_call"]


def ngram_probs(context: torch.Tensor, vocab_size: int, max_ngram: int = 3, floor: float = 0.02) -> torch.Tensor:
    """Prompt-lookup next-token distribution of a context. ``[L]`` int64 -> ``[V]`` float32.

    Longest n in ``max_ngram..1`` whose last-n-token suffix occurred earlier in the context: q puts the
    counts of the tokens that followed those occurrences; no match -> unigram counts of the context;
    empty context -> uniform. Then mixed with ``floor`` uniform mass.
    """
    return _lookup(context, vocab_size, max_ngram, floor)[0]


def _lookup(context: torch.Tensor, vocab_size: int, max_ngram: int, floor: float) -> tuple[torch.Tensor, int]:
    """One scan of ``context [L]``: (:func:`ngram_probs` ``[V]``, :func:`ngram_match_length`)."""
    counts, matched = torch.zeros(vocab_size), 0
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        windows = context[:-1].unfold(0, n, 1)  # [L-n, n]: window i is followed by context[i+n]
        hits = (windows == context[-n:]).all(-1)
        if bool(hits.any()):
            counts, matched = torch.bincount(context[n:][hits], minlength=vocab_size).float(), n
            break
    else:
        if len(context):
            counts = torch.bincount(context, minlength=vocab_size).float()
    lookup = counts / counts.sum() if counts.sum() > 0 else torch.full((vocab_size,), 1.0 / vocab_size)
    return (1 - floor) * lookup + floor / vocab_size, matched


class NGramDraft:
    """Prompt-lookup draft (see :func:`ngram_probs`) with the ``LanguageModel`` interface.

    Logits are ``log q``; with ``SamplingConfig(temperature=1)`` the engine samples from q itself.
    Keeps the token history of each row next to the same slot mask as ``CausalLM``.
    """

    def __init__(self, vocab_size: int, *, max_ngram: int = 3, floor: float = 0.02, device="cpu"):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        if not 0 < floor <= 1:
            raise ValueError(f"floor must be in (0, 1] so that q > 0 everywhere, got {floor}")
        self.vocab_size, self.max_ngram, self.floor = vocab_size, max_ngram, floor
        self.device = torch.device(device)
        self._tokens = torch.zeros(0, 0, dtype=torch.long)
        self._slots: SlotMask | None = None
        self._matches: torch.Tensor | None = None  # [B] match lengths of the current contexts, once scanned

    @property
    def cache_length(self) -> int:
        return 0 if self._slots is None else self._slots.length

    def reset(self, batch_size: int) -> None:
        self._tokens = torch.zeros(batch_size, 0, dtype=torch.long)
        self._slots = SlotMask(torch.zeros(batch_size, 0, dtype=torch.bool))
        self._matches = None

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        check_prompt(input_ids, attention_mask)
        self.reset(input_ids.shape[0])
        self._append(input_ids.cpu(), attention_mask.bool().cpu())
        return self._row_logits()

    def score(self, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        valid = torch.ones(tokens.shape, dtype=torch.bool) if valid is None else valid.bool().cpu()
        steps = []
        for j in range(tokens.shape[1]):
            self._append(tokens[:, j : j + 1].cpu(), valid[:, j : j + 1])
            steps.append(self._row_logits())
        return torch.stack(steps, dim=1).to(self.device)  # [B, k, V]

    def rollback(self, n) -> None:
        common, uneven = self._slots.rollback(n)
        self._tokens = self._tokens[:, : self._tokens.shape[1] - common]
        self._matches = None
        if uneven:
            self._compact()

    def repeat_rows(self, k: int) -> None:
        """Each row becomes ``k`` consecutive copies (drafting k paths per row)."""
        self._tokens = self._tokens.repeat_interleave(k, 0)
        self._slots.repeat_rows(k)
        self._matches = None if self._matches is None else self._matches.repeat_interleave(k, 0)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index [B']``, in that order."""
        index = index.cpu()
        self._tokens = self._tokens[index]
        self._slots.select_rows(index)
        self._matches = None if self._matches is None else self._matches[index]
        self._compact()

    def _compact(self) -> None:
        index = self._slots.compaction()
        if index is not None:
            self._tokens = self._tokens.gather(1, index)

    def _append(self, tokens: torch.Tensor, valid: torch.Tensor) -> None:
        self._slots.append(valid)
        self._tokens = torch.cat([self._tokens, tokens], dim=1)
        self._matches = None

    def _rows(self) -> list[torch.Tensor]:
        return [self._tokens[b][self._slots.mask[b]] for b in range(self._tokens.shape[0])]

    def _row_logits(self) -> torch.Tensor:
        """log q after the current context of each row -> [B, V]; keeps the match lengths of the same scan."""
        looked = [_lookup(r, self.vocab_size, self.max_ngram, self.floor) for r in self._rows()]
        self._matches = torch.tensor([n for _, n in looked], dtype=torch.long)
        return torch.stack([q for q, _ in looked]).log().to(self.device)

    def static_form(self) -> "StaticNGramDraft":
        """Prompt lookup in the engine's captured steps (:class:`StaticNGramDraft`)."""
        return StaticNGramDraft(self)

    def match_lengths(self) -> torch.Tensor:
        """Longest suffix (<= ``max_ngram`` tokens) of each row's context that occurred earlier in it. -> [B] int64."""
        if self._matches is None:
            self._matches = torch.tensor([ngram_match_length(r, self.max_ngram) for r in self._rows()], dtype=torch.long)
        return self._matches


class StaticNGramDraft:
    """Prompt lookup in the engine's captured steps (``models.protocols.StaticModel``): a static buffer of each slot's
    token, and each call's slots looked up on the device (:func:`lookup_call`), chains and draft trees, so nothing
    reads the host but ``allocate`` and ``prefill``. Its logits are :class:`NGramDraft`'s, slot for slot (a tree node's
    over its own path)."""

    def __init__(self, draft: NGramDraft) -> None:
        self.vocab_size, self.device = draft.vocab_size, draft.device
        self.max_ngram, self.floor = draft.max_ngram, draft.floor
        self.rows: StaticRows | None = None
        self._tokens: torch.Tensor | None = None  # [B, capacity] each slot's token

    def allocate(self, batch: int, capacity: int) -> None:
        self.rows = StaticRows(batch, capacity, self.device)
        self._tokens = torch.zeros(batch, capacity, dtype=torch.long, device=self.device)
        mark_static(self._tokens)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, leave: int = 0):
        """Keep the prompt's first ``L - leave`` tokens. -> (None, None): the first step's re-feed looks up after it."""
        self.rows.begin(attention_mask.to(self.device))
        fed = input_ids.shape[1] - leave
        if fed > 0:
            self._tokens[:, :fed] = input_ids[:, :fed].to(self.device)
            self.rows.advance(fed)
        return None, None

    def look(self, tokens: torch.Tensor, offset: int = 0, visible: torch.Tensor | None = None):
        """Write ``tokens [B, k]`` at ``length + offset`` (a chain, or tree nodes seeing ``visible [B, k, offset +
        k]``); -> (lookup's log q after each ``[B, k, V]``, match lengths ``[B, k]``)."""
        return lookup_call(self._tokens, self.rows, tokens.to(self.device), offset, visible, self.vocab_size,
                           self.max_ngram, self.floor)

    def forward(self, tokens: torch.Tensor, *, offset: int = 0, depth=None, visible=None):
        """:meth:`look`'s log q ``[B, k, V]``, and None."""
        return self.look(tokens, offset, visible)[0], None

    def commit(self, n) -> None:
        self.rows.advance(n)

    def keep_path(self, source: torch.Tensor, n: torch.Tensor) -> None:
        keep_path([], self.rows, source, n)  # its tokens are re-fed by the next step's re-feed


def lookup_call(buffer: torch.Tensor, rows, tokens: torch.Tensor, offset: int, visible: torch.Tensor | None,
                vocab_size: int, max_ngram: int, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A captured call's prompt lookup: write ``tokens [B, k]`` into ``buffer [B, C]`` (each slot's token) at
    ``rows.length + offset``, then look up each slot's context (:func:`lookup_at_slots`): a chain's, the kept slots and
    the call's up to it; a tree node's (``visible [B, k, offset + k]`` over the region since ``rows.length``), the
    kept slots then its own path (the region slots it sees, in order), laid out for it in a copy of the buffer. ->
    (log q ``[B, k, V]``, match lengths ``[B, k]``)."""
    (batch, k), device = tokens.shape, tokens.device
    slots = rows.length[:, None] + offset + torch.arange(k, device=device)
    buffer.scatter_(1, slots, tokens)
    if visible is None:
        return lookup_at_slots(buffer, rows.start, slots, vocab_size, max_ngram, floor)
    width = visible.shape[-1]
    region = buffer.gather(1, rows.length[:, None] + torch.arange(width, device=device))  # [B, W]
    order = (~visible).long().argsort(dim=-1, stable=True)  # each node's path first, in slot order
    path = region[:, None, :].expand(-1, k, -1).gather(2, order)  # [B, k, W]
    own = buffer[:, None, :].repeat(1, k, 1)  # [B, k, C]: each node's context laid out
    own.scatter_(2, (rows.length[:, None, None] + torch.arange(width, device=device)).expand(-1, k, -1), path)
    ends = rows.length[:, None] + visible.sum(-1) - 1  # [B, k]: the node's own slot in its layout
    looked, matches = lookup_at_slots(own.reshape(batch * k, -1), rows.start.repeat_interleave(k),
                                      ends.reshape(-1, 1), vocab_size, max_ngram, floor)
    return looked.view(batch, k, -1), matches.view(batch, k)


def ngram_match_length(context: torch.Tensor, max_ngram: int = 3) -> int:
    """The longest n <= ``max_ngram`` whose last-n-token suffix of ``context [L]`` occurred earlier in it; 0 if none."""
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        if bool((context[:-1].unfold(0, n, 1) == context[-n:]).all(-1).any()):
            return n
    return 0


def lookup_at_slots(tokens: torch.Tensor, start: torch.Tensor, slots: torch.Tensor, vocab_size: int, max_ngram: int = 3,
                    floor: float = 0.02) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ngram_probs` and :func:`ngram_match_length` of many contexts at once, on the device and without a host
    read (the captured steps' prompt lookup): row b's context for query j is ``tokens[b, start[b] .. slots[b, j]]``
    (``tokens [B, C]`` a static buffer of each slot's token, ``start [B]``, ``slots [B, k]``). -> (log q ``[B, k,
    V]`` float32, match lengths ``[B, k]``). A window ending at slot c (c < the query's slot) matches n tokens where
    ``tokens[c - j] == tokens[s - j]`` for j < n, both inside the context; the longest n found picks the windows whose
    following tokens are counted, else the context's unigram counts."""
    batch, capacity = tokens.shape
    columns = torch.arange(capacity, device=tokens.device)
    inside = columns[None] >= start[:, None]  # [B, C]
    before = inside[:, None, :] & (columns[None, None, :] < slots[:, :, None])  # [B, k, C]: window ends
    run = torch.zeros(batch, slots.shape[1], capacity, dtype=torch.long, device=tokens.device)
    matching = before
    for j in range(max_ngram):  # matching: the window's last j + 1 tokens equal the context's last j + 1
        shifted = torch.cat([tokens.new_full((batch, j), -1), tokens[:, : capacity - j]], 1)
        shifted = torch.where(torch.cat([inside.new_zeros(batch, j), inside[:, : capacity - j]], 1), shifted, -1)
        query = slots - j
        suffix = torch.where(query >= start[:, None], tokens.gather(1, query.clamp(min=0)), -2)  # [B, k]
        matching = matching & (shifted[:, None, :] == suffix[:, :, None])
        run = run + matching.long()
    longest = run.amax(-1)  # [B, k]
    following = torch.cat([tokens[:, 1:], tokens[:, :1]], 1)[:, None, :].expand(-1, slots.shape[1], -1)
    hits = (run >= longest[:, :, None]) & (longest[:, :, None] > 0) & before
    seen = inside[:, None, :] & (columns[None, None, :] <= slots[:, :, None])
    counts = torch.zeros(batch, slots.shape[1], vocab_size, device=tokens.device)
    counts.scatter_add_(2, following.clamp(0, vocab_size - 1), hits.float())
    unigram = torch.zeros_like(counts).scatter_add_(2, tokens[:, None, :].expand_as(following).clamp(0, vocab_size - 1),
                                                   seen.float())
    counts = torch.where((longest > 0)[:, :, None], counts, unigram)
    q = (1 - floor) * counts / counts.sum(-1, keepdim=True).clamp(min=1e-30) + floor / vocab_size
    return q.log(), longest
