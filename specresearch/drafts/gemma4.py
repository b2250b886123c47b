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
its cache (``CausalLM.cached_layer``), dead slots and windows masked by position.
"""

from __future__ import annotations

import os

import torch

from specresearch.drafts.feature_draft import FeatureQueue
from specresearch.models.attention import additive_mask
from specresearch.models.causal_lm import check_prompt

__all__ = ["Gemma4AssistantDraft", "is_gemma4_assistant_dir", "load_gemma4_assistant"]

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
        assistant = self.assistant
        dtype = assistant.pre_projection.weight.dtype
        rows = self._target_rows(tokens.shape[0])
        embedding = self.target.model.get_input_embeddings()(tokens.to(self.device))  # Gemma's scaled embedding
        inputs = assistant.pre_projection(torch.cat([embedding.to(dtype), features.to(dtype)], -1)[:, None])
        shared, masks = {}, {}
        for kind, layer in self._store.items():
            keys, values, valid, positions = self.target.cached_layer(layer)
            valid, positions = valid[rows], positions[rows]
            allowed = valid & (positions < position[:, None])
            if kind == "sliding_attention" and self.window is not None:
                allowed = allowed & (positions >= position[:, None] - 1 - int(self.window))
            shared[kind] = (keys[rows].to(dtype), values[rows].to(dtype))
            masks[kind] = additive_mask(allowed[:, None, :], dtype)
        out = assistant.model(inputs_embeds=inputs, attention_mask=masks, position_ids=position[:, None],
                              shared_kv_states=shared, use_cache=False)
        hidden = out.last_hidden_state  # [B, 1, H]
        self._last = assistant.post_projection(hidden)[:, 0].float()
        return self._head(hidden)[:, 0].float()

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The assistant's logits ``[B, 1, V]``: its head, over the tokens of the clusters its centroids pick where it
        orders its embeddings (module docstring: the rest at the row's lowest picked logit less 1)."""
        assistant = self.assistant
        weight = assistant.lm_head.weight
        if not assistant.config.use_ordered_embeddings:
            return assistant.lm_head(hidden)
        embedder = assistant.masked_embedding
        picked = embedder.centroids(hidden).topk(embedder.centroid_intermediate_top_k, dim=-1).indices  # [B, 1, c]
        clusters = embedder.token_ordering.long().view(embedder.num_centroids, embedder.vocab_size_per_centroid)
        chosen = clusters[picked].reshape(*hidden.shape[:2], -1)  # [B, 1, c * K] token ids
        logits = (hidden[:, :, None, :] @ weight[chosen].transpose(-1, -2))[:, :, 0]  # [B, 1, c * K]
        fill = logits.amin(-1, keepdim=True) - 1.0
        full = fill.expand(*hidden.shape[:2], weight.shape[0]).clone()
        return full.scatter_(-1, chosen, logits)
