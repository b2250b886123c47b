"""Gemma 4's assistants (``Gemma4AssistantForCausalLM``: google/gemma-4-*-assistant; ``Gemma4UnifiedAssistantForCausalLM``
for Gemma 4 unified, the same code), as a draft for their target.

The facts are read from transformers 5.25, which runs these assistants itself (its ``modeling_gemma4_assistant.py`` and
``SinglePositionMultiTokenCandidateGenerator``; our code, their facts), and checked against it
(``tests/test_gemma4_draft.py``):

* inputs: the target's input embedding of the last seen token ``x_p`` beside the target's last hidden state
  (``hidden_states[L]``) at the slot before, the state that predicted ``x_p``, projected to the assistant's width
  (``pre_projection``);
* attention: every layer of the assistant reuses the target's keys and values of the positions before ``p``, those of
  the target's last layer of each type that keeps its own (``kv_sharing_modes`` "store"); it keeps no cache, and its
  query sits at position ``p``. A full layer sees every key; a sliding one the keys at most ``sliding_window + 1``
  positions back (transformers' bidirectional window over the shared states, flipped so it looks back);
* outputs: logits from its head (with ``use_ordered_embeddings``, over the tokens of the ``centroid_intermediate_top_k``
  clusters its centroids pick, every other token given the lowest of those logits less 1: the row's own here, the
  batch's in transformers, so that a row drafts alike in any batch), and its last hidden state projected back to the
  target's width (``post_projection``), which the next drafted token reads in place of the target's state, at the
  same position ``p`` over the same keys;
* so a step drafts its tokens at one position, and the next starts from the target's state at the last accepted slot
  and the token after it. transformers drafts the argmax and hands its logits to its speculative sampling as q, which
  is not lossless (docs/audit.md); here the engine samples each draft token from q, as from any draft, so every
  verifier keeps the target's law.

:class:`Gemma4AssistantDraft` is a feature-reading draft (``models.protocols.FeatureReader``): the engine hands it the
target's last hidden state of the slots it is fed, chains and draft trees alike (a tree's rows map onto the target's
in order: ``repeat_rows`` and ``select_rows`` keep each copy beside its target row). It reads the target's keys from
its cache (``CausalLM.cached_layer``), dead slots and windows masked by position. Its static form
(:class:`StaticGemma4Assistant`) runs in the engine's captured steps, reading the keys of the target's static cache.
"""

from __future__ import annotations

import os

import torch

from specresearch.drafts.feature_draft import FeatureQueue
from specresearch.models.attention import additive_mask
from specresearch.models.causal_lm import check_prompt
from specresearch.models.static_cache import StaticRows, keep_path

__all__ = ["Gemma4AssistantDraft", "StaticGemma4Assistant", "assistant_call", "is_gemma4_assistant_dir",
           "load_gemma4_assistant"]

ASSISTANT_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")  # transformers' model types, the same architecture


def is_gemma4_assistant_dir(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a Gemma 4 assistant as transformers saves it (``model_type`` "gemma4_assistant" or
    "gemma4_unified_assistant")."""
    import json
    from pathlib import Path

    config = Path(directory) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") in ASSISTANT_TYPES


def load_gemma4_assistant(target, directory: str | os.PathLike) -> Gemma4AssistantDraft:
    """The Gemma 4 assistant saved in ``directory`` as a draft for ``target`` (a ``CausalLM`` over its Gemma 4 model),
    in the target's dtype."""
    from transformers import AutoConfig, Gemma4AssistantForCausalLM, Gemma4UnifiedAssistantForCausalLM

    unified = AutoConfig.from_pretrained(directory).model_type == "gemma4_unified_assistant"
    kind = Gemma4UnifiedAssistantForCausalLM if unified else Gemma4AssistantForCausalLM
    assistant = kind.from_pretrained(directory, dtype=target.model.dtype)
    return Gemma4AssistantDraft(assistant, target)


class Gemma4AssistantDraft(FeatureQueue):
    """A Gemma 4 assistant drafting for its target (module docstring).

    Args:
        assistant: transformers' ``Gemma4AssistantForCausalLM`` (or ``Gemma4UnifiedAssistantForCausalLM``).
        target: the ``models.causal_lm.CausalLM`` it drafts for (a Gemma 4 model whose layers store their keys for
            sharing), or None: it reads the target's cache, and the engine binds it to each run's target
            (``models.protocols.BindsTarget``; ``engine.hf`` to the one it wraps around transformers' model).
    """

    def __init__(self, assistant, target=None) -> None:
        self.assistant = assistant.eval()
        if self.assistant.config.get_text_config()._attn_implementation not in ("eager", "sdpa"):
            self.assistant.set_attn_implementation("sdpa")  # it is handed additive masks
        self.window = getattr(self.assistant.config.get_text_config(), "sliding_window", None)
        self.target, self.max_context = None, None
        self.vocab_size = int(self.assistant.config.get_text_config().vocab_size)  # the target's, once bound
        self.device = self.assistant.pre_projection.weight.device
        self._queued: torch.Tensor | None = None  # [B, k, F] the target's features for the next k slots
        self._last: torch.Tensor | None = None  # [B, F] the assistant's own projected state of its last draft
        if target is not None:
            self.bind(target)

    def bind(self, target) -> None:
        """Draft for ``target`` from now on (its keys, states and device); ``ValueError`` in one line where it cannot:
        a model that stores no keys for sharing, or states of another width."""
        if target is self.target:
            return
        assistant = self.assistant
        if not hasattr(target, "cached_layer"):
            raise ValueError(f"a Gemma 4 assistant reads its target's cache: the target must be a "
                             f"models.causal_lm.CausalLM, got {type(target).__name__}")
        text = target.model.config.get_text_config()
        modes = list(getattr(text, "kv_sharing_modes", None) or [])
        kinds = list(getattr(text, "layer_types", None) or [])
        self._store = {kind: i for i, (kind, mode) in enumerate(zip(kinds, modes)) if mode == "store"}
        wanted = set(assistant.config.get_text_config().layer_types)
        if not self._store or not wanted <= set(self._store):
            raise ValueError(f"a Gemma 4 assistant drafts from the keys its target's layers store for sharing "
                             f"({sorted(wanted)}); {type(target.model).__name__} stores {sorted(self._store) or 'none'}: "
                             "use it with the Gemma 4 model it was trained for")
        if int(assistant.config.backbone_hidden_size) != int(text.hidden_size):
            raise ValueError(f"the assistant reads states of width {assistant.config.backbone_hidden_size}; "
                             f"{type(target.model).__name__}'s are {text.hidden_size} wide")
        self.assistant = assistant.to(target.device)
        self.target = target
        self.feature_layers = (int(text.num_hidden_layers),)
        self.feature_size = int(text.hidden_size)
        self.vocab_size = target.vocab_size
        self.max_context = target.max_context
        self.device = target.device

    def reset(self, batch_size: int) -> None:
        self._queued, self._last = None, None

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Start a batch (needs ``observe`` of ``[B, L, F]`` first); -> the logits after the prompt's last slot
        ``[B, V]``, drafted from the target's keys before it."""
        check_prompt(input_ids, attention_mask)
        queued = self._take_queued(input_ids)
        self.reset(input_ids.shape[0])
        if queued is None:
            raise ValueError("a Gemma 4 assistant needs the target's features (observe) before the prompt")
        position = attention_mask.to(self.device).long().sum(-1) - 1
        return self._draft(input_ids[:, -1], queued[:, -1], position)

    @torch.no_grad()
    def score(self, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, k, V]`` after ``tokens [B, k]``, whose last slot sits where the target's cache ends (the
        engine's pending token): drafted from it with the queued features, else (k = 1) with the assistant's own state
        of its last draft, at the same position. Every slot's logits are the last one's: it drafts from that token."""
        queued = self._take_queued(tokens)
        if queued is not None:
            features = queued[:, -1]
        elif tokens.shape[1] == 1 and self._last is not None:
            features = self._last
        else:
            raise ValueError("a Gemma 4 assistant needs the target's features (observe) before scoring these tokens")
        rows = self._target_rows(tokens.shape[0])
        logits = self._draft(tokens[:, -1], features, self.target.valid_lengths.to(self.device)[rows])
        return logits[:, None].expand(-1, tokens.shape[1], -1)

    def rollback(self, n) -> None:
        """It keeps no slots: the next ``score`` needs freshly observed features."""
        self._last = None

    def repeat_rows(self, k: int) -> None:
        self._rows(lambda t: t.repeat_interleave(k, 0))

    def select_rows(self, index: torch.Tensor) -> None:
        index = index.to(self.device)
        self._rows(lambda t: t[index])

    def _rows(self, change) -> None:
        self._queued = None if self._queued is None else change(self._queued)
        self._last = None if self._last is None else change(self._last)

    def _target_rows(self, rows: int) -> torch.Tensor:
        """The target's row of each of this draft's ``rows``: a tree's copies of a row sit together, in order."""
        batch = int(self.target.valid_lengths.shape[0])
        if rows % batch:
            raise ValueError(f"the assistant drafts {rows} rows for a target of {batch}: rows are copies of the target's")
        return torch.arange(rows, device=self.device) // (rows // batch)

    def _draft(self, tokens: torch.Tensor, features: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """One assistant call: the last seen ``tokens [B]`` at ``position [B]`` with ``features [B, F]`` -> logits
        ``[B, V]`` float32; keeps its projected state for the next draft."""
        rows = self._target_rows(tokens.shape[0])
        logits, last = assistant_call(self, self.target, tokens[:, None].to(self.device), features[:, None],
                                      position[:, None], rows)
        self._last = last[:, 0]
        return logits[:, 0]

    def static_form(self) -> "StaticGemma4Assistant":
        """This assistant for the engine's captured steps (:class:`StaticGemma4Assistant`), bound there to the static
        form of the target it is bound to now."""
        if self.target is None:
            raise ValueError("a Gemma 4 assistant's static form reads its target's static cache: bind it to a target "
                             "first (the engine does, for each run)")
        return StaticGemma4Assistant(self)


class StaticGemma4Assistant:
    """A Gemma 4 assistant in the engine's captured steps (``models.protocols.StaticFeatureModel``): it reads the keys
    of the target's static cache (``models.static_lm.StaticCausalLM.cached_layer``, the run's static target, bound by
    the engine) and keeps no cache of its own, only each row's extent (``StaticRows``), which tells a slot's position.

    The captured loop feeds it as it feeds a feature head: each step re-feeds the last step's accepted tokens and next
    token ``[x_1..x_n, next]`` with the target's states of the slots before them (``inputs``, true features), then each
    drafted token with its own projected state of the token before (its prediction, ``forward``'s extra). Re-fed slot
    j sits at its own position, every slot the target has kept is before it, and the next token's position is where the
    target's cache ends; every drafted token sits at that same position (module docstring). So a slot's position is
    its own, capped at the end of the target's kept context: the re-fed slots' are below it, the drafted ones' past it.
    Nothing reads the host but ``allocate`` and ``prefill``, which writes nothing (no cache) and keeps the prompt's
    slots."""

    def __init__(self, draft: Gemma4AssistantDraft):
        self.assistant, self.window, self._store = draft.assistant, draft.window, draft._store
        self.vocab_size, self.device, self.max_context = draft.vocab_size, draft.device, draft.max_context
        self.feature_layers, self.feature_size = draft.feature_layers, draft.feature_size
        self.target = None
        self.rows: StaticRows | None = None

    def bind(self, target) -> None:
        """Read ``target``'s static cache (the run's static target: ``cached_layer`` and ``rows``)."""
        if not (hasattr(target, "cached_layer") and hasattr(target, "rows")):
            raise ValueError(f"a Gemma 4 assistant's static form reads a static target's cache "
                             f"(models.static_lm.StaticCausalLM), got {type(target).__name__}")
        self.target = target

    def allocate(self, batch: int, capacity: int) -> None:
        self.rows = StaticRows(batch, capacity, self.device)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's states ``[B, k, F]`` are the assistant's inputs as they are."""
        return features.float().to(self.device)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, leave: int = 0, inputs=None):
        """Start a batch: keep the prompt's first ``L - leave`` slots (nothing to write: it drafts from the target's
        keys, not its own). -> (None, None): the first step's re-feed drafts from the prompt's last token."""
        if self.target is None:
            raise ValueError("bind the static assistant to the run's static target before prefill")
        self.rows.begin(attention_mask.to(self.device))
        self.rows.advance(input_ids.shape[1] - leave)
        return None, None

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, *, inputs: torch.Tensor, offset: int = 0, depth=None, visible=None):
        """Draft after each of ``tokens [B, k]``, fed ``inputs [B, k, F]``, at ``length + offset`` of its rows (a tree's
        nodes too: their drafts sit at the same capped position, over the same keys; ``depth`` and ``visible`` change
        nothing). -> (logits ``[B, k, V]`` float32, its projected states ``[B, k, F]``)."""
        rows, target = self.rows, self.target.rows
        slots = rows.length[:, None] + offset + torch.arange(tokens.shape[1], device=tokens.device)
        positions = torch.minimum(slots - rows.start[:, None], (target.length - target.start)[:, None])
        return assistant_call(self, self.target, tokens, inputs, positions)

    def commit(self, n) -> None:
        self.rows.advance(n)

    def keep_path(self, source: torch.Tensor, n: torch.Tensor) -> None:
        keep_path([], self.rows, source, n)


def assistant_call(draft, target, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                   rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One call of ``draft``'s assistant (its ``assistant``, ``window`` and ``_store``): after ``tokens [B, k]``, fed
    ``features [B, k, F]``, each at ``positions [B, k]`` over ``target``'s kept keys before it (``cached_layer``; the
    target's row ``rows [B]`` of each, None: the same). Each slot is a query of its own (the assistant attends to no
    slot of its own). -> (logits ``[B, k, V]`` float32, projected states ``[B, k, F]`` float32)."""
    assistant = draft.assistant
    dtype = assistant.pre_projection.weight.dtype
    embedding = target.model.get_input_embeddings()(tokens)  # Gemma's scaled embedding
    inputs = assistant.pre_projection(torch.cat([embedding.to(dtype), features.to(dtype)], -1))
    shared, masks = {}, {}
    for kind, layer in draft._store.items():
        keys, values, valid, key_positions = target.cached_layer(layer)
        if rows is not None:
            keys, values, valid, key_positions = keys[rows], values[rows], valid[rows], key_positions[rows]
        allowed = valid[:, None, :] & (key_positions[:, None, :] < positions[:, :, None])  # [B, k, S]
        if kind == "sliding_attention" and draft.window is not None:
            allowed = allowed & (key_positions[:, None, :] >= positions[:, :, None] - 1 - int(draft.window))
        shared[kind] = (keys.to(dtype), values.to(dtype))
        masks[kind] = additive_mask(allowed, dtype)
    out = assistant.model(inputs_embeds=inputs, attention_mask=masks, position_ids=positions, shared_kv_states=shared,
                          use_cache=False)
    hidden = out.last_hidden_state  # [B, k, H]
    return _head(assistant, hidden).float(), assistant.post_projection(hidden).float()


def _head(assistant, hidden: torch.Tensor) -> torch.Tensor:
    """The assistant's logits ``[B, k, V]``: its head, over the tokens of the clusters its centroids pick where it
    orders its embeddings (module docstring: the rest at the slot's lowest picked logit less 1)."""
    weight = assistant.lm_head.weight
    if not assistant.config.use_ordered_embeddings:
        return assistant.lm_head(hidden)
    embedder = assistant.masked_embedding
    picked = embedder.centroids(hidden).topk(embedder.centroid_intermediate_top_k, dim=-1).indices  # [B, k, c]
    clusters = embedder.token_ordering.long().view(embedder.num_centroids, embedder.vocab_size_per_centroid)
    chosen = clusters[picked].reshape(*hidden.shape[:2], -1)  # [B, k, c * K] token ids
    logits = (hidden[:, :, None, :] @ weight[chosen].transpose(-1, -2))[:, :, 0]  # [B, k, c * K]
    fill = logits.amin(-1, keepdim=True) - 1.0
    full = fill.expand(*hidden.shape[:2], weight.shape[0]).clone()
    return full.scatter_(-1, chosen, logits)
