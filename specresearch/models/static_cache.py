"""A static KV cache: preallocated to a run's length, each row's length kept on the device, rollback and tree
compaction done by index. It is the cache a captured step needs (a CUDA graph or ``torch.compile``): no tensor
changes shape or address from one step to the next, and no step reads the host to know where it writes.

Layout. Every layer holds ``keys / values [B, heads, capacity, d]`` (a target's layers as slices of one
:class:`KVStack`, so that a kept path is copied for all of them at once). Row b's context is slots ``start[b] ..
length[b] - 1`` of its own row (``start[b]``: its prompt's left padding), slot s at position ``s - start[b]``. A
call of k tokens writes slots ``length[b] + offset .. + k - 1`` of each row with one scatter (``offset``: a Python
int, the tokens a draft has already fed this step), so rows of different lengths write at different slots and no
slot inside a row's context is ever dead: a rejected draft's slots lie past the row's length, where no query looks
and the next call overwrites them. :meth:`StaticRows.advance` (a chain: keep the pending token and the accepted
drafts) and :func:`keep_path` (a tree: copy the accepted path's slots to the front of the tree region first) are the
only ways a length changes, both device operations.

DeepSeek Sparse Attention's layers keep their indexer's keys beside K and V (``update_indexer``: a buffer of their own,
written at the same slots, copied with a kept path); its top-k runs over every slot, the masked ones at the mask's
lowest value, so it keeps the valid keys a growing cache would (a masked key it picks is masked in attention too).

Masks. Each call's mask is built from ``start``, ``length`` and the slot index (:meth:`StaticRows.call`): a chain
query at slot s sees slots ``start .. s``; a tree node sees the context before the tree and its ancestors in the
call (``visible``). Sliding windows are applied from positions (``models.attention.AttentionLayout.masks``), as the
growing cache of :class:`~specresearch.models.causal_lm.CausalLM` applies them, so every family and kernel that
wrapper makes exact is exact here, and the same additive mask reaches the kernel (0 / the dtype's lowest value).
Every call attends over all ``capacity`` slots: a captured step's cost does not grow with the context, and the
masked tail costs what it costs (gpt-fast's static cache does the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specresearch.models.static_states import SPAN, StateCall, StaticStateLayer, mark_static, state_layer_class

__all__ = ["StaticRows", "StaticCall", "StaticKV", "StackedKV", "KVStack", "StaticPast", "static_kv_cache", "keep_path",
           "mark_static"]


@dataclass(frozen=True)
class StaticCall:
    """Where one call's tokens go and what they see."""

    slots: torch.Tensor  # [B, k] int64: the slot each token is written to
    positions: torch.Tensor  # [B, k] int64: its position id
    allowed: torch.Tensor  # [B, k, capacity] bool: the slots it attends to (windows aside)
    key_positions: torch.Tensor  # [B, capacity] int64: every slot's position, this call's written (for windows)


class StaticRows:
    """Each row's extent in a static cache, on the device: ``start [B]`` (first slot of its context) and ``length
    [B]`` (slots written and kept). ``capacity``: slots per row. Shared by every layer of one model."""

    def __init__(self, batch: int, capacity: int, device):
        self.capacity = capacity
        self.start = torch.zeros(batch, dtype=torch.long, device=device)
        self.length = torch.zeros(batch, dtype=torch.long, device=device)
        self.columns = torch.arange(capacity, device=device)
        self.positions = torch.zeros(batch, capacity, dtype=torch.long, device=device)  # each slot's, as last written
        mark_static(self.start, self.length, self.positions)

    @property
    def batch(self) -> int:
        return self.length.shape[0]

    def begin(self, attention_mask: torch.Tensor, skip: int = 0) -> None:
        """A new batch for the left-padded prompt ``attention_mask [B, L]`` (all of it, whatever part of it is written
        first): ``start`` = each row's padding (+ ``skip`` slots a model leaves out of every row's context, such as
        EAGLE's first prompt slot), ``length`` = 0."""
        if attention_mask.shape[1] > self.capacity:
            raise ValueError(f"a prompt of {attention_mask.shape[1]} slots does not fit a static cache of "
                             f"{self.capacity}: allocate a larger capacity")
        self.start.copy_(attention_mask.shape[1] - attention_mask.long().sum(1) + skip)
        self.length.zero_()
        self.positions.copy_(self.columns[None] - self.start[:, None])

    def call(self, k: int, offset: int = 0, depth: torch.Tensor | None = None,
             visible: torch.Tensor | None = None) -> StaticCall:
        """The slots, positions and mask of a call of ``k`` tokens at ``length + offset``.

        A chain (no ``depth``): each token sees the context and every slot after it up to itself. A tree: the region
        starts at ``length`` (slots written since the last :meth:`advance`; ``offset`` of them written by earlier
        calls), ``visible [B, k, offset + k]`` says which region slots each token sees (its ancestors and itself), and
        ``depth [B, k]`` puts it at position (context before the region) + depth. Every token sees its own slot, so no
        query (a padding slot's) sees nothing."""
        base = self.length + offset  # [B]
        slots = base[:, None] + torch.arange(k, device=base.device)  # [B, k]
        own = self.columns[None, None] == slots[:, :, None]  # [B, k, C]
        if depth is None:
            positions = (slots - self.start[:, None]).clamp(min=0)  # a pad slot (a prompt's padding) takes 0
            allowed = (self.columns[None, None] >= self.start[:, None, None]) & (self.columns[None, None] <= slots[:, :, None])
        else:
            width = offset + k
            positions = (self.length - self.start)[:, None] + depth
            region = self.columns[None] - self.length[:, None]  # [B, C]: index in the region, negative before it
            inside = (region >= 0) & (region < width)
            seen = visible.gather(2, region.clamp(0, width - 1)[:, None, :].expand(-1, k, -1)) & inside[:, None, :]
            before = (self.columns[None] >= self.start[:, None]) & (region < 0)  # [B, C]
            allowed = before[:, None, :] | seen
        self.positions.scatter_(1, slots, positions)  # windows measure from them (the tree's region slots differ)
        return StaticCall(slots, positions, allowed | own, self.positions)

    def advance(self, n: torch.Tensor | int) -> None:
        """Keep ``n`` more slots of each row (``[B]`` or an int): the first ``n`` the last calls wrote."""
        self.length.add_(n)


class StaticKV:
    """One layer's preallocated keys and values ``[B, heads, capacity, d]``, written at per-row slots."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values
        mark_static(keys, values)

    @classmethod
    def like(cls, batch: int, capacity: int, keys: torch.Tensor, values: torch.Tensor) -> "StaticKV":
        """Empty buffers with the heads, head size, dtype and device of a call's ``keys / values [B, h, k, d]``."""
        shape = lambda t: (batch, t.shape[1], capacity, t.shape[-1])  # noqa: E731
        return cls(keys.new_zeros(shape(keys)), values.new_zeros(shape(values)))

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``keys / values [B, h, k, d]`` at ``slots [B, k]``; -> the whole buffers (what attention reads)."""
        buffers = self.keys, self.values  # once a call: a stacked layer's are views of its stack, made on each read
        index = slots[:, None, :, None]
        for buffer, new in zip(buffers, (keys, values)):
            buffer.scatter_(2, index.expand(-1, new.shape[1], -1, new.shape[-1]), new.to(buffer.dtype))
        return buffers

    def copy_slots(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        """Copy each row's slots ``source [B, m]`` to ``destination [B, m]`` (gathered first, so they may overlap)."""
        _copy_slots((self.keys, self.values), source, destination, dim=2)


def _copy_slots(buffers, source: torch.Tensor, destination: torch.Tensor, dim: int) -> None:
    """Within each buffer ``[..., B, heads, capacity, d]`` (the slot dimension ``dim``), copy each row's slots
    ``source [B, m]`` to ``destination [B, m]``: one gather and one scatter a buffer, however many layers it stacks."""
    lead = dim - 2  # stacked layers' dimensions before B
    for buffer in buffers:
        shape = buffer.shape[:lead] + (-1, buffer.shape[dim - 1], -1, buffer.shape[-1])
        index = lambda s: s[(None,) * lead + (slice(None), None, slice(None), None)].expand(*shape)  # noqa: E731
        buffer.scatter_(dim, index(destination), buffer.gather(dim, index(source)))


class StackedKV(StaticKV):
    """One layer's keys and values as layer ``index`` of a :class:`KVStack`: read through the stack on every use, so
    a compiled step sees one buffer a stack (not a view of it a layer, which would alias the stack's input)."""

    def __init__(self, stack: "KVStack", index: int):  # no buffers of its own: StaticKV.__init__ is not called
        self.stack, self.index = stack, index

    @property
    def keys(self) -> torch.Tensor:
        return self.stack.keys[self.index]

    @property
    def values(self) -> torch.Tensor:
        return self.stack.values[self.index]


class KVStack:
    """The keys and values of a model's layers in one pair of buffers ``[layers, B, heads, capacity, d]``, so that
    keeping a tree's path (:func:`keep_path`) copies every layer's slots in one gather and one scatter a buffer
    (4 kernels, where a buffer a layer takes 4 a layer). Layers take their places in order (:meth:`take`)."""

    def __init__(self, layers: int, batch: int, capacity: int, keys: torch.Tensor, values: torch.Tensor):
        shape = lambda t: (layers, batch, t.shape[1], capacity, t.shape[-1])  # noqa: E731
        self.keys, self.values = keys.new_zeros(shape(keys)), values.new_zeros(shape(values))
        mark_static(self.keys, self.values)
        self.taken = 0

    def fits(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Whether a layer with a call's ``keys / values [B, h, k, d]`` has a free place here (same heads, sizes,
        dtype and device)."""
        same = lambda buffer, t: (buffer.shape[2], buffer.shape[-1], buffer.dtype, buffer.device) == (  # noqa: E731
            t.shape[1], t.shape[-1], t.dtype, t.device)
        return self.taken < self.keys.shape[0] and same(self.keys, keys) and same(self.values, values)

    def take(self) -> StackedKV:
        self.taken += 1
        return StackedKV(self, self.taken - 1)

    def copy_slots(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        """Every layer's slots ``source [B, m]`` copied to ``destination [B, m]`` (:meth:`StaticKV.copy_slots`)."""
        _copy_slots((self.keys, self.values), source, destination, dim=3)


class StaticPast:
    """One layer's static keys and values in the form the feature heads' layers take their ``past``
    (``drafts.feature_draft.extend_past``): ``extend(keys, values)`` writes them at ``slots`` (the current call's,
    set by the model) and returns the whole buffers; allocated on the first call."""

    def __init__(self, batch: int, capacity: int):
        self.batch, self.capacity = batch, capacity
        self.kv: StaticKV | None = None
        self.slots: torch.Tensor | None = None

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kv is None:
            self.kv = StaticKV.like(self.batch, self.capacity, keys, values)
        return self.kv.write(self.slots, keys, values)


def keep_path(kvs, rows: StaticRows, source: torch.Tensor, n: torch.Tensor) -> None:
    """After a tree call at ``length``: keep each row's path ``source [B, m]`` (call indices of the kept tokens, in
    order; only the first ``n[b]`` matter) as its next ``n [B]`` slots, copying them to ``length .. length + m - 1``
    in every layer of ``kvs``, then advance. Slots past ``n`` receive copies no query will read."""
    destination = rows.length[:, None] + torch.arange(source.shape[1], device=source.device)
    origin = rows.length[:, None] + source
    stacks = {}
    for kv in kvs:
        if isinstance(kv, StackedKV):
            stacks[id(kv.stack)] = kv.stack
        else:
            kv.copy_slots(origin, destination)
    for stack in stacks.values():  # every layer of a stack at once
        stack.copy_slots(origin, destination)
    rows.positions.scatter_(1, destination, rows.positions.gather(1, origin))
    rows.advance(n)


class _Writes:
    """The slots the current call writes (set by the model wrapper before each forward; read by every layer)."""

    slots: torch.Tensor | None = None


def static_kv_cache(num_layers: int, batch: int, capacity: int, kinds=None, span: int = SPAN, base=None):
    """A transformers ``Cache`` whose layers write at the slots set in ``cache.writes.slots`` and return whole
    buffers, allocated on the first call from its keys' heads, size, dtype and device: every layer's in one
    :class:`KVStack` (a layer whose shapes differ from the first layer's: a :class:`StaticKV` of its own).
    ``kinds``: per layer ``("attention", 0)``, or ``("states", m)`` / ``("both", m)`` for a layer with ``m`` recurrent
    states (:mod:`specresearch.models.static_states`, ``span`` tokens between commits), without or with attention;
    by default every layer attends; ``base``: a cache class the cache must also be (MiniMax's: ``models.recurrent``).
    -> (cache, its layers' ``StaticKV`` list, filled as they allocate)."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    writes, kvs, stacks = _Writes(), [], []
    writes.call = StateCall()

    class _Layer(CacheLayerMixin):
        is_compileable = True
        is_sliding = False  # windows are masked (module docstring): every layer keeps the whole context

        def lazy_initialization(self, key_states, value_states):
            if not stacks:  # the first layer's shapes: a stack for every layer (a layer of other shapes: its own)
                stacks.append(KVStack(num_layers, batch, capacity, key_states, value_states))
            fits = stacks[0].fits(key_states, value_states)
            self.kv = stacks[0].take() if fits else StaticKV.like(batch, capacity, key_states, value_states)
            self.keys, self.values = self.kv.keys, self.kv.values
            kvs.append(self.kv)
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            return self.kv.write(writes.slots, key_states, value_states)

        indexer: StaticKV | None = None  # DeepSeek Sparse Attention: the indexer's keys [B, 1, capacity, D]

        def update_indexer(self, indexer_key_states):
            """The indexer's keys ``[B, k, D]`` written at the call's slots; -> all of them ``[B, capacity, D]``
            (unwritten and dead slots are masked in its scores, as for attention). Kept paths copy them too."""
            if self.indexer is None:
                buffer = indexer_key_states.new_zeros(batch, 1, capacity, indexer_key_states.shape[-1])
                self.indexer = StaticKV(buffer, buffer)  # one buffer: its keys are its values
                kvs.append(self.indexer)
            keys = indexer_key_states[:, None]
            return self.indexer.write(writes.slots, keys, keys)[0][:, 0]

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return capacity, 0

        def get_seq_length(self) -> int:
            return 0  # positions and masks are always given (StaticRows.call)

        def get_max_length(self) -> int:
            return capacity

    linear = state_layer_class()

    class _States(StaticStateLayer, linear):
        def __init__(self, states: int):
            self.setup(states, batch, span, writes.call)

    class _Both(StaticStateLayer, _Layer, linear):  # a recurrent state and attention in one layer (Falcon-H1, Zamba2)
        def __init__(self, states: int):
            _Layer.__init__(self)
            self.setup(states, batch, span, writes.call)

        def get_max_length(self) -> int:
            return capacity

    made = {"attention": lambda states: _Layer(), "states": _States, "both": _Both}
    kinds = kinds or [("attention", 0)] * num_layers

    class _Static(base or Cache):
        def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
            return capacity, 0  # every layer's, recurrent ones too (a model of recurrent layers only asks them)

    cache = _Static(layers=[made[kind](states) for kind, states in kinds])
    cache.writes = writes
    return cache, kvs
