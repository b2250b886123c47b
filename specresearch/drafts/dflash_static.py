"""A DFlash block drafter in the engine's captured steps (:mod:`specresearch.engine.static`): the static form of
:class:`specresearch.drafts.dflash.DFlashDraft` (``models.protocols.StaticFeatureModel``), DSpark's Markov head,
DFlash2's candidate selector and XPress's refiner included.

The drafter keeps one thing per slot: the context, each layer's keys and values of the fused target feature of the
slot before it, at the position before it (``models.static_cache.StaticKV`` a layer, written at the slot; none for a
row's first slot). A step of the captured loop feeds it twice:

* the **re-feed** (:meth:`StaticDFlashDraft.refeed`: the last step's accepted tokens and next token with the target's
  features of the slots before them) writes their context and runs a block for every column as its anchor, as the
  growing draft does when it is fed true features: ``[anchor, mask x (B - 1)]`` at the anchor's position onwards over
  the context up to the anchor's slot. It returns block position 1's logits (the first drafted token) of each column,
  and each column's block outputs ``[P, H]`` flattened as its prediction, which the engine gathers at the column it
  keeps (the next token's) and hands to the drafting calls;
* each **drafting call** (:meth:`StaticDFlashDraft.forward`) is fed the drafted tokens at depth d of the step (a chain
  writes them at ``offset = d - 1``, a tree's K nodes at ``offset = (d - 1) K``: d = ``offset // k + 1``) and returns
  block position d + 1's logits from the block it is handed (a tree's siblings share them), plus DSpark's Markov bias
  and DFlash2's rescoring given the token it is fed; it writes nothing (the block does not read drafted tokens) and
  passes the block on.

XPress's refiner reads the block's outputs at every position and the tokens before each position's predicted one
(the token before the anchor, the anchor, the drafted tokens): its block is handed on as all its outputs and that
line of tokens (ids as float32, exact below 2^24), and each drafting call writes its token into the line it hands on,
so a tree's node carries its own path's (the engine gathers a node's from its parent's). The token before the anchor
comes from a static buffer of each slot's token.

So the block is computed once a step, in the re-feed, and nothing reads the host but ``allocate`` and ``prefill``.
Its first drafted token comes from the re-feed's gathered column, as the growing loop drafts it, so both give the
same q (``tests/test_dflash_static.py``).
"""

from __future__ import annotations

import torch

from specresearch.models.static_cache import StaticKV, StaticRows, keep_path, mark_static

__all__ = ["StaticDFlashDraft", "block_mask"]


def block_mask(kind, query_positions, key_positions, key_valid) -> torch.Tensor:
    """Which keys each query sees for a layer ``kind = (causal, window, inclusive)``: ``query_positions [N, m]``,
    ``key_positions [N, S]``, ``key_valid [N, m, S]`` -> ``[N, m, S]``."""
    causal, window, inclusive = kind
    distance = query_positions[:, :, None] - key_positions[:, None, :]  # q - k
    allowed = key_valid
    if causal:
        allowed = allowed & (distance >= 0)
    if window is not None:
        allowed = allowed & ((distance.abs() <= window) if inclusive else (distance < window) & (causal | (-distance < window)))
    return allowed


class StaticDFlashDraft:
    """A DFlash drafter over a static context cache (module docstring), sharing ``draft``'s block and target head."""

    def __init__(self, draft) -> None:
        self.draft, self.block = draft, draft.block
        self.vocab_size, self.device = draft.vocab_size, draft.device
        self.feature_layers, self.feature_size = draft.feature_layers, draft.feature_size
        self.rows: StaticRows | None = None
        self._kvs: list[StaticKV] = []
        self._tokens: torch.Tensor | None = None  # [B, capacity] each slot's token

    def allocate(self, batch: int, capacity: int) -> None:
        self.rows = StaticRows(batch, capacity, self.device)
        self._tokens = torch.zeros(batch, capacity, dtype=torch.long, device=self.device)  # XPress: the token before
        mark_static(self._tokens)
        layer, dtype = self.block.layers[0], self.block.fc.weight.dtype
        shape = (batch, layer.kv_heads, capacity, layer.head_dim)
        self._kvs = [StaticKV(torch.zeros(shape, dtype=dtype, device=self.device),
                              torch.zeros(shape, dtype=dtype, device=self.device)) for _ in self.block.layers]

    @torch.no_grad()
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features ``[B, k, F]`` -> the context's inputs ``[B, k, H]`` (``fc``, then ``hidden_norm``)."""
        return self.block.fuse(features.to(self.device).float())

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, leave: int = 0, inputs=None):
        """Start a batch: write and keep the context of the prompt's first ``L - leave`` slots, slot j read with
        ``inputs[:, j]`` (the fused feature of the slot before it). -> (None, None): the first drafted token comes
        from the first step's re-feed."""
        self.rows.begin(attention_mask.to(self.device))
        fed = input_ids.shape[1] - leave
        if fed > 0:
            self._write(input_ids[:, :fed].to(self.device), inputs[:, :fed])
            self.rows.advance(fed)
        return None, None

    def _write(self, tokens: torch.Tensor, inputs: torch.Tensor):
        """Each layer's context keys and values of ``inputs [B, k, H]`` at the next ``k`` slots (positions - 1), and
        the slots' ``tokens [B, k]``."""
        call = self.rows.call(inputs.shape[1])
        self._tokens.scatter_(1, call.slots, tokens)
        cos, sin = self.block.rope((call.positions - 1).clamp(min=0))
        for layer, kv in zip(self.block.layers, self._kvs):
            keys, values = layer.context(inputs, cos, sin)
            kv.write(call.slots, keys, values)
        return call

    @torch.no_grad()
    def refeed(self, tokens: torch.Tensor, *, inputs: torch.Tensor):
        """Write the context of ``tokens [B, k]`` (read with ``inputs [B, k, H]``) and run each column's block as
        anchor; keeps nothing. -> (block position 1's logits ``[B, k, V]``, each column's block ``[B, k, P H]``)."""
        call, rows, block = self._write(tokens, inputs), self.rows, self.block
        (batch, k), size = tokens.shape, block.block_size
        query_positions = call.positions.reshape(-1)[:, None] + torch.arange(size, device=self.device)  # [B k, size]
        context = (rows.columns[None] >= rows.start[:, None]) & (rows.positions > 0)  # [B, C]: a row's first has none
        seen = context[:, None, :] & (rows.columns[None, None, :] <= call.slots[:, :, None])  # up to each anchor
        seen = seen.reshape(batch * k, 1, -1).expand(-1, size, -1)
        key_positions = torch.cat([(rows.positions - 1).repeat_interleave(k, 0), query_positions], 1)
        key_valid = torch.cat([seen, seen.new_ones(batch * k, size, size)], -1)
        masks = {kind: block_mask(kind, query_positions, key_positions, key_valid) for kind in set(block.kinds)}
        keys = [kv.keys.repeat_interleave(k, 0) for kv in self._kvs]
        values = [kv.values.repeat_interleave(k, 0) for kv in self._kvs]
        out = block.run(self.draft.embed_block(tokens.reshape(-1)), query_positions, keys, values, masks)
        hidden = out[:, size - block.predictions:].reshape(batch, k, block.predictions, -1)  # [B, k, P, H]
        first = hidden[:, :, 0]
        if block.refiner_head is None:
            return self.draft.position_logits(self.draft.base_logits(first), tokens, first), hidden.reshape(batch, k, -1)
        line = tokens.new_zeros(batch, k, size)  # XPress: the token before each position's predicted one
        at = size - block.predictions  # the first drafted token's position (1 in the fill-in layout)
        if at:  # the token before the anchor, the anchor where its row has none
            before = self._tokens.gather(1, (call.slots - 1).clamp(min=0))
            line[..., 0] = torch.where(call.slots - 1 >= rows.start[:, None], before, tokens)
        line[..., at] = tokens
        bias = block.refiner_head(out, line.view(batch * k, size), torch.full((batch * k,), at, device=self.device))
        logits = self.draft.position_logits(self.draft.base_logits(first), tokens, first, bias.view(batch, k, -1))
        return logits, torch.cat([out.reshape(batch, k, -1).float(), line.float()], -1)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, *, inputs: torch.Tensor, offset: int = 0, depth=None, visible=None):
        """A drafting call: ``tokens [B, k]`` at depth ``offset // k + 1`` of the step, ``inputs [B, k, P H]`` their
        anchor's block (module docstring). -> (the next block position's logits ``[B, k, V]``, the block)."""
        block, (batch, k), index = self.block, tokens.shape, offset // tokens.shape[1] + 1
        if index >= block.predictions:
            raise ValueError(f"a DFlash block of {block.block_size} drafts at most {block.predictions} tokens a step "
                             "(gamma, or a tree's depth)")
        if block.refiner_head is None:
            hidden = inputs.view(batch, k, block.predictions, -1)[:, :, index]
            return self.draft.position_logits(self.draft.base_logits(hidden), tokens, hidden), inputs
        size = block.block_size  # XPress: the block's outputs and its line of tokens, the fed one written at its place
        at = index + size - block.predictions
        full = inputs[..., : -size].reshape(batch * k, size, -1)
        line = inputs[..., -size:].round().long().view(batch * k, size).clone()
        line[:, at] = tokens.reshape(-1)
        bias = block.refiner_head(full, line, torch.full((batch * k,), at, device=self.device)).view(batch, k, -1)
        hidden = full.view(batch, k, size, -1)[:, :, at]
        logits = self.draft.position_logits(self.draft.base_logits(hidden), tokens, hidden, bias)
        return logits, torch.cat([inputs[..., : -size], line.view(batch, k, size).float()], -1)

    def commit(self, n) -> None:
        self.rows.advance(n)

    def keep_path(self, source: torch.Tensor, n: torch.Tensor) -> None:
        keep_path(self._kvs, self.rows, source, n)
