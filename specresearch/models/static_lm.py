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
from specresearch.models.static_cache import StaticRows, keep_path, static_kv_cache
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

    def allocate(self, batch: int, capacity: int) -> None:
        """Preallocate ``capacity`` slots for ``batch`` rows (the buffers appear with the first call, the prefill)."""
        layers = self.model.config.get_text_config(decoder=True).num_hidden_layers
        self.rows = StaticRows(batch, capacity, self.device)
        self._cache, self._kvs = static_kv_cache(layers, batch, capacity)

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
        call = self.rows.call(tokens.shape[1], offset, depth, visible)
        self._cache.writes.slots = call.slots
        mask = self._attention.masks(call.allowed, call.positions, call.key_positions, self.model.dtype)
        with torch.no_grad():
            out = self.model(input_ids=readable(tokens, self.lm), attention_mask=mask, position_ids=call.positions,
                             use_cache=True, **{self._cache_argument: self._cache}, logits_to_keep=logits_to_keep,
                             output_hidden_states=hidden_layers is not None)
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

    def commit(self, n: torch.Tensor | int) -> None:
        """Keep the first ``n [B]`` slots the last calls wrote past each row's length."""
        self.rows.advance(n)

    def keep_path(self, source: torch.Tensor, n: torch.Tensor) -> None:
        """Keep a tree call's path: ``source [B, m]`` its call indices in order, the first ``n [B]`` kept."""
        keep_path(self._kvs, self.rows, source, n)
