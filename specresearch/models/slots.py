"""The validity mask over a KV cache's physical slots (:class:`SlotMask`): the one record of a cache's length, each
slot's position and which slots each row keeps, shared by every ``LanguageModel`` that keeps a growing cache
(``CausalLM``, ``ToyLM``, the drafts that hold their own); ragged rollbacks and their packing
(``models.causal_lm``'s docstring)."""

from __future__ import annotations

import torch

__all__ = ["SlotMask", "host_counts", "rollback_counts"]


class SlotMask:
    """Validity mask over the physical cache slots: the one place the cache length is tracked (for
    implementers of ``LanguageModel``: ``CausalLM``, ``ToyLM`` and ``drafts.ngram.NGramDraft`` share it)."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask.bool()  # [B, L]
        self.positions = self.prompt_positions()  # [B, L] each slot's position id (meaningless where not valid)
        self.tree_start: int | None = None  # first slot of the tree being scored (begin_tree .. end_tree)

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def counts(self) -> torch.Tensor:
        """Valid slots per row. -> [B] int64."""
        return self.mask.sum(-1)

    def prompt_positions(self) -> torch.Tensor:
        """Position ids of a left-padded prompt: valid slots count 0, 1, ...; pads get 0. -> [B, L]."""
        return (self.mask.long().cumsum(-1) - 1).clamp(min=0)

    def append(self, valid: torch.Tensor) -> torch.Tensor:
        """Append slots ``valid [B, k]``; return their position ids ``[B, k]`` (valid slots before each)."""
        valid = valid.bool()
        before = self.counts()[:, None] + valid.long().cumsum(-1) - valid.long()  # [B, k]
        self.mask = torch.cat([self.mask, valid], dim=1)
        self.positions = torch.cat([self.positions, before], dim=1)
        return before

    def visible_to_last(self, k: int) -> torch.Tensor:
        """The slots each of the last ``k`` slots sees in a chain call: every valid slot up to itself. -> [B, k, L]."""
        columns = torch.arange(self.length, device=self.mask.device)
        return self.mask[:, None, :] & (columns[None, None, :] <= columns[self.length - k :, None])

    def begin_tree(self) -> None:
        """Start a tree region at the current end: slots appended with :meth:`append_tree` until :meth:`end_tree`."""
        self.tree_start = self.length

    def append_tree(self, visible: torch.Tensor, depth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k`` tree slots (all valid) seen through ``visible [B, k, r + k]`` (which of the region's ``r``
        earlier slots and of the ``k`` new ones each new slot attends to, itself included; ``depth [B, k]`` its
        offset from the region's first slot). Returns (position ids ``[B, k]``, the slots each new one sees
        ``[B, k, length]``: every valid slot before the region, then ``visible``)."""
        start, (batch, k) = self.tree_start, depth.shape
        positions = self.mask[:, :start].sum(-1, keepdim=True) + depth
        before = self.mask[:, :start][:, None, :].expand(batch, k, start)
        region = visible & torch.cat([self.mask[:, start:], torch.ones(batch, k, dtype=torch.bool, device=self.mask.device)], 1)[:, None, :]
        self.mask = torch.cat([self.mask, torch.ones(batch, k, dtype=torch.bool, device=self.mask.device)], 1)
        self.positions = torch.cat([self.positions, positions], 1)
        return positions, torch.cat([before, region], -1)

    def end_tree(self, kept: torch.Tensor) -> int:
        """Keep the region's slots where ``kept [B, r]`` (the accepted path); drop the trailing columns no row keeps.
        Returns how many trailing slots were dropped."""
        start = self.tree_start
        self.mask = torch.cat([self.mask[:, :start], self.mask[:, start:] & kept.bool()], 1)
        self.tree_start = None
        alive = self.mask.any(0).nonzero()
        end = int(alive[-1]) + 1 if len(alive) else 0
        dropped = self.length - end
        self.mask, self.positions = self.mask[:, :end], self.positions[:, :end]
        return dropped

    def compaction(self) -> torch.Tensor | None:
        """Index ``[B, L']`` that packs each row's valid slots to the right (left padding), L' = the most valid
        slots of any row; None when fewer than a quarter of the slots are dead (packing is not worth a copy).
        Updates the mask to the packed layout: the caller gathers its cache with the index."""
        counts = self.counts()
        width = int(counts.max()) if len(counts) else 0
        if self.length - width <= max(4, self.length // 4):
            return None
        order = torch.sort(self.mask.long(), dim=1, stable=True).indices  # invalid slots first, valid ones in order
        index = order[:, self.length - width :]
        self.positions = self.positions.gather(1, index)
        self.mask = torch.arange(width, device=self.mask.device)[None] >= (width - counts)[:, None]
        return index

    def repeat_rows(self, k: int) -> None:
        """Each row becomes ``k`` consecutive copies (``[B, L]`` -> ``[B*k, L]``)."""
        self.mask, self.positions = self.mask.repeat_interleave(k, 0), self.positions.repeat_interleave(k, 0)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index [B']`` (in that order)."""
        self.mask, self.positions = self.mask[index], self.positions[index]

    def rollback(self, n) -> tuple[int, bool]:
        """Forget the last ``n`` slots (``int``, a sequence of per-row ints, or a ``[B]`` tensor). Returns (trailing
        slots every row lost, whether rows dropped different counts, so that dead slots may want packing). Counts given
        as Python ints are validated on the host: nothing is read back from the device."""
        batch = self.mask.shape[0]
        host = host_counts(n, batch)
        common = self.drop(rollback_counts(n, batch, self.mask.device), host)
        return common, host is None or min(host) != max(host)

    def drop(self, n: torch.Tensor, host: list[int] | None = None) -> int:
        """Forget the last ``n[b]`` slots of row b; return how many trailing slots every row lost. ``host``: the same
        counts as Python ints, when the caller has them (then nothing is read back from the device)."""
        if host is None:
            host = n.tolist() if n.shape == (self.mask.shape[0],) else None
        if host is None or len(host) != self.mask.shape[0] or min(host) < 0 or max(host) > self.length:
            raise ValueError(
                f"n must be between 0 and cache_length={self.length} for each of the {self.mask.shape[0]} rows, "
                f"got {host if host is not None else n.tolist()}"
            )
        common = min(host)
        if common != max(host):  # rows drop different counts: mask each row's extra slots
            columns = torch.arange(self.length, device=self.mask.device)
            self.mask = self.mask & (columns[None, :] < self.length - n[:, None])
        end = self.length - common
        self.mask, self.positions = self.mask[:, :end], self.positions[:, :end]
        return common


def rollback_counts(n, batch: int, device) -> torch.Tensor:
    """``int`` or ``[B]`` tensor/sequence of rollback counts -> ``[B]`` int64."""
    counts = torch.as_tensor(n, dtype=torch.long, device=device)
    return counts.expand(batch).clone() if counts.ndim == 0 else counts


def host_counts(n, batch: int) -> list[int] | None:
    """Rollback counts the caller gave as Python ints (``int`` or a sequence) -> ``[B]`` list; a tensor -> None."""
    if isinstance(n, torch.Tensor):
        return None
    return [int(n)] * batch if isinstance(n, int) else [int(c) for c in n]
