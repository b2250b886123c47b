"""The interfaces the engine drives: one narrow language-model interface (prefill, score a block, roll back).

Every model the generation engine drives -- a transformers model (:class:`CausalLM`), a toy table
(:class:`ToyLM`) or an n-gram draft (``drafts.ngram.NGramDraft``) -- exposes the same methods:

* ``prefill(input_ids [B, L], attention_mask [B, L]) -> logits [B, V]``: start a new batch from a
  left-padded prompt; returns the next-token logits after the prompt (``L >= 1``; a row may be all
  padding, i.e. an empty context, and then its returned logits are meaningless).
* ``reset(batch_size)``: start a new batch with an empty context (what ``prefill`` of 0 tokens would be).
* ``score(tokens [B, k], valid=None [B, k] bool) -> logits [B, k, V]``: append ``k`` tokens and return
  the next-token logits after each of them. A slot with ``valid[b, j] = False`` is appended but masked
  out, as if it were never there (its logits row is meaningless).
* ``rollback(n)``: forget the last ``n`` appended slots (``int``, or ``[B]`` int for per-row counts).
* ``CausalLM`` (``returns_hidden_states = True``): ``prefill`` / ``score`` with ``hidden_layers=(i, ...)``
  also return the hidden states ``[B, k, len(hidden_layers) * H]`` of the slots just fed (``hidden_states``
  indices, concatenated), for drafts that read the target's features (``feature_drafts``); the wrapper
  does not know what reads them.
* ``cache_length`` (physical slots, shared by all rows), ``valid_lengths [B]``, ``vocab_size``, ``device``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["LanguageModel", "PlansLength", "PlansContext", "check_language_model", "check_same_vocab", "check_same_tokenizer",
           "FeatureReader", "TreeScorer", "RowExpander", "StaticModel", "StaticFeatureModel", "HasStaticForm"]


@runtime_checkable
class LanguageModel(Protocol):
    """The narrow interface the generation engine uses (see the module docstring)."""

    vocab_size: int
    device: torch.device

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor: ...
    def reset(self, batch_size: int) -> None: ...
    def score(self, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor: ...
    def rollback(self, n) -> None: ...

def check_language_model(model, role: str, methods: tuple[str, ...] = ("prefill", "score", "rollback"),
                         takes: str = "a language model the engine drives") -> None:
    """Raise ``TypeError`` unless ``model`` has :class:`LanguageModel`'s ``methods`` (``role``: its name in the
    message, ``takes``: what the caller accepts there); a transformers model is told how to wrap it
    (``models.causal_lm.CausalLM``)."""
    missing = [name for name in methods if not callable(getattr(model, name, None))]
    if missing:
        wrap = (": wrap a transformers model in models.causal_lm.CausalLM(model)"
                if isinstance(model, torch.nn.Module) and hasattr(model, "config") else "")
        raise TypeError(f"{role} must be {takes} ({', '.join(missing)} missing: models.protocols.LanguageModel), "
                        f"got {type(model).__name__}{wrap}")


def check_same_vocab(target, draft) -> None:
    """Raise ``ValueError`` unless ``target.vocab_size == draft.vocab_size``."""
    if target.vocab_size != draft.vocab_size:
        raise ValueError(
            f"draft vocab_size {draft.vocab_size} != target vocab_size {target.vocab_size}: the draft must "
            "produce logits over the target's vocabulary (same tokenizer, same logits size); a transformers draft "
            "with the target's tokenizer and another number of output rows (Qwen2.5-0.5B for Qwen2.5-7B) runs as "
            f"CausalLM(model, vocab_size={target.vocab_size})"
        )


def check_same_tokenizer(target_tokenizer, draft_tokenizer) -> None:
    """Raise ``ValueError`` unless both tokenizers map every token string to the same id.

    The engine only sees ids, so a draft with another tokenizer of the same size would run (and stay
    lossless: verification is over the target's ids) but draft nonsense; where both tokenizers are
    known (loading a draft checkpoint) this catches it.
    """
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target_vocab == draft_vocab:
        return
    differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda item: (item[1], item[0]))
    token = differing[0][0]
    raise ValueError(
        f"draft tokenizer differs from the target's ({len(draft_vocab)} vs {len(target_vocab)} tokens; e.g. "
        f"{token!r} is id {draft_vocab.get(token)} in the draft and {target_vocab.get(token)} in the target): "
        "use a draft trained with the target's tokenizer"
    )


@runtime_checkable
class PlansLength(Protocol):
    """A draft that chooses how many tokens to draft in each step (the engine checks for this interface).

    ``plan_length(gamma)`` is asked once per step, after the draft has scored its pending block and
    before any token of the step is sampled; it returns the step's draft length in ``1..gamma``. Since it
    is a function of the context (never of the step's own drafts), every verifier stays lossless: given
    the context, the step is an ordinary step with that length. Optional ``fixed_length(gamma)``: the length every
    step drafts, or None where the plan decides it per step (captured steps, which cannot ask, refuse that).
    """

    def plan_length(self, gamma: int) -> int: ...


@runtime_checkable
class PlansContext(Protocol):
    """A model whose calls depend on the run's length (the engine checks for this interface): ``plan_context(n,
    shortest)`` is told, before a run, the positions its tokens may reach and its shortest prompt (``CausalLM``: rotary
    frequencies that transformers picks per call, fixed for the run, ``models.rotary``, or one set per prefix where
    the run passes Phi-3's original length, ``models.prefix_sets``), and returns whether its rotations changed."""

    def plan_context(self, positions: int, shortest: int | None = None) -> bool: ...


@runtime_checkable
class FeatureReader(Protocol):
    """A draft that reads the target's hidden states (the engine checks for this interface).

    ``feature_layers``: the target ``hidden_states`` indices the draft reads (concatenated in that order).
    ``observe(features [B, k, F])``: the target's features of the slots BEFORE the next ``k`` slots the
    draft will be fed (slot j of the next ``score`` call gets ``features[:, j]``).
    """

    feature_layers: tuple[int, ...]
    feature_size: int  # F = len(feature_layers) * hidden size

    def observe(self, features: torch.Tensor) -> None: ...


@runtime_checkable
class BindsTarget(Protocol):
    """A draft that reads its target's cache (``drafts.gemma4``): the engine binds it to each run's target before the
    run (``bind(target)``, raising where it cannot draft for that target)."""

    def bind(self, target) -> None: ...


@runtime_checkable
class TreeScorer(Protocol):
    """A model that scores a draft tree in one call (the engine's target for ``num_drafts > 1``).

    ``begin_tree()`` opens a region at the end of the cache; ``score_tree(tokens [B, k], depth [B, k], visible
    [B, k, r + k])`` appends k nodes, node i at position (valid slots before the region) + depth and attending
    to every valid slot before the region and to the region slots / new nodes marked in ``visible`` (its
    ancestors and itself); ``end_tree(kept [B, r])`` keeps the accepted path and forgets the rest of the region.
    """

    def begin_tree(self) -> None: ...
    def score_tree(self, tokens: torch.Tensor, depth: torch.Tensor, visible: torch.Tensor) -> torch.Tensor: ...
    def end_tree(self, kept: torch.Tensor) -> None: ...


@runtime_checkable
class RowExpander(Protocol):
    """A draft whose rows can be copied and selected (the engine drafts K paths per row as K rows each)."""

    def repeat_rows(self, k: int) -> None: ...
    def select_rows(self, index: torch.Tensor) -> None: ...


@runtime_checkable
class StaticModel(Protocol):
    """A model over a static KV cache (``models.static_cache``): what the engine's captured steps drive
    (``engine.static``). Nothing but ``allocate`` and ``prefill`` may read the host or allocate.

    ``allocate(batch, capacity)``; ``prefill(input_ids [B, L], attention_mask [B, L], *, leave=0)`` writes and keeps
    all but the last ``leave`` columns and returns (logits ``[B, V]`` or None, hidden states or None);
    ``forward(tokens [B, k], *, offset=0, depth=None, visible=None)`` writes ``tokens`` past each row's length
    (a chain, or a tree: ``models.static_cache.StaticRows.call``) and returns (logits ``[B, k, V]``, extra);
    ``commit(n [B])`` keeps the first ``n`` slots written; ``keep_path(source [B, m], n [B])`` keeps a tree's path.
    A draft may define ``refeed(tokens, *, inputs)``: the engine re-feeds it the step's accepted tokens and next token
    through it (a block drafter runs its block there), its drafting calls then at ``offset = (d - 1) k`` for depth d.
    ``rows`` (``models.static_cache.StaticRows``): its extents, which a captured step's warm-up gives back; a model that
    wraps others lists every one it changes as ``held_rows``. A model with recurrent layers (``models.static_states``)
    says ``recurrent`` (True: chains only, ``allocate(batch, capacity, span=)`` with the most tokens written between
    two commits) and lists its kept states as ``held_states``, which the warm-up gives back too.
    """

    vocab_size: int
    device: torch.device

    def allocate(self, batch: int, capacity: int) -> None: ...
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, leave: int = 0): ...
    def forward(self, tokens: torch.Tensor, *, offset: int = 0, depth=None, visible=None): ...
    def commit(self, n) -> None: ...
    def keep_path(self, source: torch.Tensor, n: torch.Tensor) -> None: ...


@runtime_checkable
class StaticFeatureModel(StaticModel, Protocol):
    """A static draft that reads the target's hidden states (``FeatureReader``'s static form): ``forward`` and
    ``prefill`` take ``inputs=`` (``fuse(features)``, or its own predictions ``[B, k, H]`` returned by the last
    ``forward`` as its extra) for each slot."""

    feature_layers: tuple[int, ...]
    feature_size: int

    def fuse(self, features: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class HasStaticForm(Protocol):
    """A model with a static form sharing its weights (``static_form()`` -> a ``StaticModel``)."""

    def static_form(self): ...
