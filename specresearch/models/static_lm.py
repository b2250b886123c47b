"""A transformers causal LM over a static KV cache (:mod:`specresearch.models.static_cache`): the target (or a
whole-model draft) of the engine's captured steps (:mod:`specresearch.engine.static`).

Its interface is the static protocol (``models.protocols.StaticModel``): ``allocate(batch, capacity)``,
``prefill(input_ids, attention_mask)``, ``forward(tokens, offset=, depth=, visible=)`` (writes its tokens past each
row's length, keeps nothing), ``commit(n)`` (keep the first ``n [B]`` slots written) and ``keep_path(source, n)``
(keep a tree's accepted path). Nothing in ``forward`` / ``commit`` / ``keep_path`` reads the host, so a step made of
them can be compiled whole (``torch.compile(fullgraph=True)``) or captured as one CUDA graph.

It shares the model of a :class:`~specresearch.models.causal_lm.CausalLM` (:meth:`CausalLM.static_form`): the same
weights, the kernel that wrapper chose (switched to an exact one where needed) and its attention layout, whose masks
it builds from each slot's position, so every family and kernel ``CausalLM`` is exact on is exact here
(``tests/test_static.py`` holds both against transformers' ``generate``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from specresearch.models import fused
from specresearch.models.attention import additive_mask
from specresearch.models.recurrent import piece_size, recurrent_kinds, static_cache_base
from specresearch.models.static_cache import StaticRows, keep_path, static_kv_cache
from specresearch.models.static_states import SPAN, StaticStateLayer
from specresearch.models.widths import fit_width, readable

__all__ = ["StaticCausalLM", "HOST_READS", "GRAPH_BREAKS", "capture_refusal"]

# model types whose forward reads the host inside a step (data-dependent shapes): no mode captures it whole
HOST_READS = {"dbrx": "its experts' loop asks the host which experts the tokens chose (nonzero)",
              "jetmoe": "its experts' gating reads each expert's token count on the host (tolist)"}
# model types whose forward torch.compile's tracer cannot hold in one graph, though it reads nothing from the host: a
# CUDA graph captures its eager step, torch.compile's modes do not
GRAPH_BREAKS = {"ctrl": "its forward re-registers its position table as a buffer at every call"}
COMPILED_MODES = ("inductor", "reduce-overhead")  # the engine.captured modes that run torch.compile


def capture_refusal(model, mode: str) -> str | None:
    """Why a step of ``model`` (a transformers model) cannot run as ``mode`` (``engine.captured``'s: ``"eager"``,
    ``"inductor"``, ``"reduce-overhead"``, ``"cudagraph"``), a sentence naming it, or None. From
    ``benchmarks/family_sweep.py``'s record: every type it takes traces as one graph but these."""
    kind = getattr(model.config, "model_type", "")
    why = HOST_READS.get(kind) if mode != "eager" else None
    why = why or (GRAPH_BREAKS.get(kind) if mode in COMPILED_MODES else None)
    return f"{type(model).__name__}: {why}" if why else None


class StaticCausalLM:
    """``lm``'s model behind the static interface (module docstring). ``lm``: a ``CausalLM`` on one device."""

    returns_hidden_states = True

    def __init__(self, lm):
        if lm.placement is not None:
            raise ValueError(f"a static cache needs a model on one device; this one is split ({lm.placement}): use the "
                             "growing cache (compile='off')")
        self.lm = lm
        self.model = lm.model
        self._attention = lm._attention
        self._cache_argument = lm._cache_argument
        self.vocab_size = lm.vocab_size
        self.max_context = lm.max_context
        self.rows: StaticRows | None = None
        self._cache = None
        self._kvs: list = []

    @property
    def device(self) -> torch.device:
        return self.lm.device

    @property
    def recurrent(self) -> bool:
        """Whether some layers keep recurrent state (:mod:`specresearch.models.static_states`: chains only)."""
        return self.lm.recurrent

    def allocate(self, batch: int, capacity: int, span: int | None = None) -> None:
        """Preallocate ``capacity`` slots for ``batch`` rows (the buffers appear with the first call, the prefill);
        ``span``: the most tokens written between two commits, for recurrent layers (default ``static_states.SPAN``)."""
        kinds = recurrent_kinds(self.model) if self.recurrent else None
        layers = len(kinds) if kinds else self.model.config.get_text_config(decoder=True).num_hidden_layers
        self.rows = StaticRows(batch, capacity, self.device)
        base = static_cache_base(self.model) if self.recurrent else None
        self._cache, self._kvs = static_kv_cache(layers, batch, capacity, kinds, span or SPAN, base)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, leave: int = 0,
                hidden_layers: Sequence[int] | None = None):
        """Start a batch from the left-padded prompt ``[B, L]``: write its first ``L - leave`` columns at slots 0.. and
        keep them (the last ``leave`` tokens are fed by the first step). -> (the last written slot's next-token logits
        ``[B, V]``, the hidden states ``[B, L - leave, n * H]`` of ``hidden_layers`` or None); (None, None) when
        nothing is written."""
        if self.rows is None or self.rows.batch != input_ids.shape[0]:
            raise ValueError(f"allocate(batch={input_ids.shape[0]}, capacity) before prefill")
        if self.lm.fuses:
            fused.keep_fused(self.model)
        self.rows.begin(attention_mask.to(self.device))
        fed = input_ids.shape[1] - leave
        if self.recurrent:
            return self._prefill_states(input_ids, attention_mask, fed, hidden_layers)
        if fed <= 0:
            return None, None
        logits, hidden = self.forward(input_ids[:, :fed].to(self.device), hidden_layers=hidden_layers, logits_to_keep=1)
        self.rows.advance(fed)
        return logits[:, -1], hidden

    def forward(self, tokens: torch.Tensor, *, offset: int = 0, depth: torch.Tensor | None = None,
                visible: torch.Tensor | None = None, hidden_layers: Sequence[int] | None = None,
                logits_to_keep: int = 0):
        """Write ``tokens [B, k]`` at each row's ``length + offset`` (a chain, or a tree given ``depth [B, k]`` and
        ``visible [B, k, offset + k]``: :meth:`StaticRows.call`); keeps nothing. -> (logits ``[B, k, V]`` float32, the
        hidden states ``[B, k, n * H]`` float32 of ``hidden_layers`` or None)."""
        if self.recurrent:
            if depth is not None:
                raise ValueError(f"{type(self.model).__name__} has recurrent layers: its static form scores chains, "
                                 "not trees (trees run path by path in the growing loop, compile='off')")
            if tokens.shape[1] > 1 and piece_size(self.model) == 1:  # layers that record one state a call
                outs = [self.forward(tokens[:, i:i + 1], offset=offset + i, hidden_layers=hidden_layers,
                                     logits_to_keep=logits_to_keep) for i in range(tokens.shape[1])]
                return (torch.cat([o[0] for o in outs], 1),
                        None if hidden_layers is None else torch.cat([o[1] for o in outs], 1))
            self._cache.writes.call.offset, self._cache.writes.call.width = offset, tokens.shape[1]
            for layer in self._cache.layers:
                if isinstance(layer, StaticStateLayer):
                    layer.begin_call()
        call = self.rows.call(tokens.shape[1], offset, depth, visible)
        self._cache.writes.slots = call.slots
        mask = self._attention.masks(call.allowed, call.positions, call.key_positions, self.model.dtype)
        if self.recurrent:
            mask = _step_mask(self._attention, mask, call.allowed, self.model.dtype)
        with torch.no_grad():
            out = self.model(input_ids=readable(tokens, self.lm), attention_mask=mask, position_ids=call.positions,
                             use_cache=True, **{self._cache_argument: self._cache}, logits_to_keep=logits_to_keep,
                             output_hidden_states=hidden_layers is not None)
        if self.recurrent:
            for layer in self._cache.layers:
                if isinstance(layer, StaticStateLayer):
                    layer.end_call()
        logits = fit_width(out.logits.float(), self.lm.logits_width)
        if hidden_layers is None:
            return logits, None
        return logits, torch.cat([out.hidden_states[i] for i in hidden_layers], dim=-1).float()

    def cached_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s key and value buffers ``[B, H, capacity, D]``, with each slot's validity (inside its row's
        kept context) and position ``[B, capacity]``: ``CausalLM.cached_layer``'s answer, for a draft that attends to
        the target's keys in a captured step (``drafts.gemma4``). Read on the device, no host value."""
        kv = self._cache.layers[layer].kv
        columns = self.rows.columns[None]
        valid = (columns >= self.rows.start[:, None]) & (columns < self.rows.length[:, None])
        return kv.keys, kv.values, valid, self.rows.positions

    @property
    def held_states(self) -> list[torch.Tensor]:
        """The kept states of recurrent layers (each state after the kept tokens, each convolution's window): what a
        commit changes besides ``rows`` (a captured step's warm-up gives them back: ``engine.static``)."""
        layers = [layer for layer in self._cache.layers if isinstance(layer, StaticStateLayer)] if self._cache else []
        return [t for layer in layers for t in layer.kept()]

    def commit(self, n: torch.Tensor | int) -> None:
        """Keep the first ``n [B]`` slots the last calls wrote past each row's length."""
        if self.recurrent:
            kept = torch.as_tensor(n, device=self.device).expand(self.rows.batch)
            for layer in self._cache.layers:
                if isinstance(layer, StaticStateLayer):
                    layer.commit(kept)
        self.rows.advance(n)

    def _prefill_states(self, input_ids, attention_mask, fed: int, hidden_layers):
        """A prompt of a model with recurrent layers: run through the growing cache (``CausalLM.prefill``, with its
        per-family padding rules), its keys, values and states loaded into the static buffers (a prompt that leaves
        nothing before the first step: buffers made from its first token, states cleared, nothing kept)."""
        fed_ids, fed_mask = input_ids[:, :max(fed, 1)].to(self.device), attention_mask[:, :max(fed, 1)].to(self.device)
        if fed <= 0:  # nothing before the first step: the buffers made from a prefill of the first token, then cleared
            fed_mask = torch.ones_like(fed_mask)
        out = self.lm.prefill(fed_ids, fed_mask, hidden_layers=hidden_layers)
        logits, hidden = out if hidden_layers is not None else (out, None)
        slots = self.rows.columns[None, :fed].expand(self.rows.batch, -1)
        grown_layers = self.lm.cache_layers()
        if len(grown_layers) != len(self._cache.layers):
            raise RuntimeError(f"{type(self.model).__name__}'s growing cache holds {len(grown_layers)} layers after a "
                               f"prefill, its static form {len(self._cache.layers)} (models.recurrent.recurrent_kinds)")
        for layer, grown in zip(self._cache.layers, grown_layers):
            if getattr(grown, "keys", None) is not None:
                if not layer.is_initialized:
                    layer.lazy_initialization(grown.keys, grown.values)
                layer.kv.write(slots, grown.keys, grown.values)
            if isinstance(layer, StaticStateLayer):
                layer.load(grown, clear=fed <= 0)  # no token kept: every state its initial zeros
        self.lm.reset(input_ids.shape[0])  # its growing cache's copy of the prompt is not needed past here
        if fed <= 0:
            return None, None
        self.rows.advance(fed)
        return logits, hidden

    def keep_path(self, source: torch.Tensor, n: torch.Tensor) -> None:
        """Keep a tree call's path: ``source [B, m]`` its call indices in order, the first ``n [B]`` kept."""
        keep_path(self._kvs, self.rows, source, n)


def _step_mask(layout, masks, allowed: torch.Tensor, dtype: torch.dtype):
    """The attention mask of a static call of a model with recurrent layers, from the layout's ``masks`` (an additive
    mask, or a mapping by layer type) and the call's ``allowed [B, q, L]``: none where no layer attends (Mamba), the
    additive mask of ``allowed`` where only layers with a recurrent state attend (Falcon-H1's and Zamba2's "hybrid"
    layers, which the layout lists under no attention type), and no padding mask for the recurrent layers (a step's
    tokens are never padding; transformers' ``create_recurrent_attention_mask`` gives a 4-D mask none)."""
    if not layout.attends:
        return None
    if isinstance(masks, dict):
        return {**masks, "linear_attention": None} if masks else additive_mask(allowed, dtype)
    return masks
