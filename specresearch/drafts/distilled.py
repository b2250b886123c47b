"""Draft models behind the same interface as the target (``models.LanguageModel``).

* :class:`NGramDraft`: prompt lookup with a proper distribution. The next-token law q is the
  continuation counts of the longest n-gram (n <= ``max_ngram``) that ends the context and occurred
  before in it (falling back to the unigram counts of the context), mixed with a uniform floor:
  ``q = (1 - floor) * counts / sum(counts) + floor / V``. Every token has ``q > 0``, so the draft can
  be verified stochastically (token or block verification), not only greedily.
* Any transformers model with the target's tokenizer, wrapped in ``models.CausalLM``.
* :func:`truncated_draft`: the first few decoder layers of the target plus its embeddings, final norm
  and head -- an untrained stand-in.
* Trained (distilled) drafts shipped under ``data/drafts/<name>/`` (:func:`load_trained_draft`): a few
  decoder layers of the target's architecture, the target's input embedding (frozen, rebuilt from the
  target at load time, never stored) and either the target's head or a trained :class:`SubsetHead`
  over the K tokens that carry most of the target's probability. ``specresearch.training.distill`` trains them.

:func:`check_same_vocab` is the guard the engine applies: target and draft logits must have the same
size (compare logits, not ``len(tokenizer)``: a model's head can be padded beyond the tokenizer).
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from safetensors.torch import load_file, save_file

from specresearch.checks import check_int
from specresearch.paths import data_dir
from specresearch.models.causal_lm import (
    SKINNY_ROWS,
    CausalLM,
    SlotMask,
    check_prompt,
    rollback_counts,
    skinny_linear,
    use_half_weights,
)

__all__ = [
    "NGramDraft",
    "ngram_probs",
    "ngram_match_length",
    "LookupOrDraft",
    "PlansLength",
    "truncated_draft",
    "check_same_vocab",
    "check_same_tokenizer",
    "draft_from_name",
    "combined_draft",
    "half_weight_draft",
    "HALF_PREFIX",
    "without_half_prefix",
    "DraftConfig",
    "DRAFT_PRESETS",
    "SubsetHead",
    "build_draft",
    "trainable_state",
    "drafts_dir",
    "save_draft",
    "round_to_storage",
    "load_draft",
    "load_trained_draft",
    "shipped_drafts",
    "check_field",
    "embedding_fingerprint",
    "manifest_path",
    "read_manifest",
    "write_manifest",
]

_STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_WEIGHTS_FILE = "draft.safetensors"
_MANIFEST_FILE = "manifest.json"
_HEAD_IDS = "lm_head.token_ids"


def check_same_vocab(target, draft) -> None:
    """Raise ``ValueError`` unless ``target.vocab_size == draft.vocab_size``."""
    if target.vocab_size != draft.vocab_size:
        raise ValueError(
            f"draft vocab_size {draft.vocab_size} != target vocab_size {target.vocab_size}: the draft must "
            "produce logits over the target's vocabulary (same tokenizer, same logits size)"
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
        common = self._slots.drop(rollback_counts(n, self._tokens.shape[0], "cpu"))
        self._tokens = self._tokens[:, : self._tokens.shape[1] - common]
        self._matches = None

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

    def match_lengths(self) -> torch.Tensor:
        """Longest suffix (<= ``max_ngram`` tokens) of each row's context that occurred earlier in it. -> [B] int64."""
        if self._matches is None:
            self._matches = torch.tensor([ngram_match_length(r, self.max_ngram) for r in self._rows()], dtype=torch.long)
        return self._matches


def ngram_match_length(context: torch.Tensor, max_ngram: int = 3) -> int:
    """The longest n <= ``max_ngram`` whose last-n-token suffix of ``context [L]`` occurred earlier in it; 0 if none."""
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        if bool((context[:-1].unfold(0, n, 1) == context[-n:]).all(-1).any()):
            return n
    return 0


@runtime_checkable
class PlansLength(Protocol):
    """A draft that chooses how many tokens to draft in each step (the engine checks for this interface).

    ``plan_length(gamma)`` is asked once per step, after the draft has scored its pending block and
    before any token of the step is sampled; it returns the step's draft length in ``1..gamma``. Since it
    is a function of the context (never of the step's own drafts), every verifier stays lossless: given
    the context, the step is an ordinary step with that length.
    """

    def plan_length(self, gamma: int) -> int: ...


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


def truncated_draft(target: CausalLM, num_layers: int) -> CausalLM:
    """A draft made of the target's first ``num_layers`` decoder layers + its embeddings, final norm and head.

    A cheap stand-in for a trained draft (same tokenizer, no training). Built generically: a copy of the
    target's config with fewer layers, loaded with the matching subset of the target's weights (any
    weight that does not fit raises). Per-layer config lists (``layer_types``) are truncated too.
    """
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(target.model.config)
    text = config.get_text_config()
    if not 1 <= num_layers <= text.num_hidden_layers:
        raise ValueError(f"num_layers must be in 1..{text.num_hidden_layers}, got {num_layers}")
    text.num_hidden_layers = num_layers
    if isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = text.layer_types[:num_layers]
    draft = AutoModelForCausalLM.from_config(config, dtype=target.model.dtype)
    missing, _unexpected = draft.load_state_dict(target.model.state_dict(), strict=False)
    if missing:
        raise ValueError(f"target weights do not cover the truncated model: missing {missing[:5]}")
    draft.generation_config = copy.deepcopy(target.model.generation_config)
    return CausalLM(draft, device=target.device)


HALF_PREFIX = "fp16:"


def without_half_prefix(name: str) -> str:
    """``name`` without its ``"fp16:"`` prefix (the draft whose weights :func:`half_weight_draft` halves)."""
    return name[len(HALF_PREFIX) :] if name.startswith(HALF_PREFIX) else name


def draft_from_name(name: str, target: CausalLM, tokenizer=None):
    """A draft from a short description: ``"ngram"``, ``"ngram+<name>"`` (:class:`LookupOrDraft`: prompt lookup
    where the context matches, draft ``<name>`` elsewhere; see :func:`combined_draft` for its ``@`` options),
    ``"truncated:N"`` (first N target layers), the name of a shipped trained draft (:func:`shipped_drafts`, e.g.
    ``"v8k-4l"``; a shipped feature head gives a ``feature_drafts.FeatureDraft``), the directory of a trained
    draft or feature head (what ``specresearch distill`` / ``feature-distill --out`` write) or a model path;
    ``"fp16:<name>"``: draft ``<name>`` with float16 weights (:func:`half_weight_draft`).

    ``tokenizer``: the target's; when given, a checkpoint draft's own tokenizer must equal it
    (``check_same_tokenizer``).
    """
    if name == "ngram":
        return NGramDraft(target.vocab_size, device=target.device)
    if name.startswith("dial-"):  # the target perturbed (dial_drafts): dial-mix:LAM, dial-uniform:LAM, dial-temp:S
        from specresearch.drafts.dial import dial_draft_from_name

        return dial_draft_from_name(name, target)
    if name.startswith("ngram+"):
        return combined_draft(name, target, tokenizer)
    if name.startswith(HALF_PREFIX):
        return half_weight_draft(draft_from_name(without_half_prefix(name), target, tokenizer), target)
    if name.startswith("truncated:"):
        return truncated_draft(target, int(name.split(":", 1)[1]))
    trained = drafts_dir() / name if name in shipped_drafts() else Path(name)
    if manifest_path(trained).exists():
        from specresearch.drafts.feature import is_feature_draft_dir, load_feature_draft  # imports this module

        if is_feature_draft_dir(trained):
            return load_feature_draft(target, trained)
        return CausalLM(load_draft(target.model, trained), device=target.device)
    if tokenizer is not None:
        from transformers import AutoTokenizer

        check_same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(name, local_files_only=True))
    return CausalLM(name, device=target.device)


def half_weight_draft(draft, target: CausalLM):
    """``draft`` (a trained ``FeatureDraft`` or a ``CausalLM`` that owns its weights) with its linear layers'
    and output head's weights stored in float16, in place (``models.use_half_weights``); returns it.

    On this CPU a drafting step of the shipped feature head (sampling included) takes 3.5 ms against 4.9
    with float32 weights, at the same held-out alpha to three decimals (``docs/feature_drafts.md``). The
    target is never changed (a layer the draft shares with it is refused); drafts without weights
    (``ngram``, ``dial-...``) are refused.
    """
    from specresearch.drafts.feature import FeatureDraft  # imports this module

    if isinstance(draft, FeatureDraft):
        module = draft.head
    elif isinstance(draft, CausalLM):
        module = draft.model
    else:
        raise ValueError(f"fp16: needs a trained draft (a feature head or a distilled / checkpoint LM), got {type(draft).__name__}")
    use_half_weights(module, (SubsetHead,), shared_with=target.model)
    return draft


def combined_draft(name: str, target: CausalLM, tokenizer=None) -> LookupOrDraft:
    """``"ngram+<name>[@option]..."`` -> ``LookupOrDraft(draft_from_name(<name>), ...)``.

    By default a step that starts without a lookup match drafts one token (``draft_gamma=1``: the trained
    drafts' best length on this CPU, ``docs/feature_drafts.md``) and the wrapped draft is fed lazily.
    Options: ``@draft-gamma=N`` (at most N tokens in such a step), ``@draft-gamma=none`` (always the
    engine's gamma), ``@every-slot`` (feed the wrapped draft every slot, ``lazy=False``), ``@min-match=N``
    (lookup proposes a token after a match of N or more tokens; default 2) and ``@plan-match=N`` (such a
    match plans a full step; default: min-match). Values out of range raise from :class:`LookupOrDraft`.
    """
    base, *options = name.split("@")
    settings = {"draft_gamma": 1, "lazy": True}
    counts = {"min-match": "min_match", "plan-match": "plan_match"}
    for option in options:
        key, _, value = option.partition("=")
        if option == "every-slot":
            settings["lazy"] = False
        elif key == "draft-gamma" and (value == "none" or value.isdigit() and int(value) >= 1):
            settings["draft_gamma"] = None if value == "none" else int(value)
        elif key in counts and value.isdigit():
            settings[counts[key]] = int(value)
        else:
            raise ValueError(f"draft {name!r}: unknown option @{option} "
                             "(@draft-gamma=N, @draft-gamma=none, @every-slot, @min-match=N, @plan-match=N)")
    return LookupOrDraft(draft_from_name(base[len("ngram+") :], target, tokenizer), **settings)


# --------------------------------------------------------------------------------------------------
# Trained drafts: configuration, construction, the on-disk format (save, load); training lives in specresearch.training.distill


def check_field(condition: bool, field: str, message: str) -> None:
    """Raise ``ValueError("<field> <message>")`` unless ``condition``: config validation that names the field."""
    if not condition:
        raise ValueError(f"{field} {message}")


def shipped_drafts(root: str | os.PathLike | None = None) -> list[str]:
    """Names of the trained drafts under ``root`` (default :func:`drafts_dir`), sorted."""
    directory = Path(root) if root is not None else drafts_dir()
    return sorted(p.name for p in directory.glob("*") if manifest_path(p).exists())


@dataclass(frozen=True)
class DraftConfig:
    """Shape of a distilled draft; everything not listed here is the target's config.

    Attributes:
        name: the preset / directory name under ``data/drafts/``.
        num_layers: decoder layers of the draft (>= 1).
        intermediate_size: MLP width; ``None`` keeps the target's.
        init_layers: target layer indices copied into the draft's layers before training (one per draft
            layer), or ``None`` for a seeded random initialisation.
        storage_dtype: dtype of the shipped tensors, one of ``float32``, ``bfloat16``, ``float16``.
        head_tokens: ``None`` keeps the target's full output head; an int K gives the draft a
            :class:`SubsetHead` over the K tokens with the most teacher probability on the corpus
            (:func:`head_token_ids`), so q(x) = 0 off those K tokens. On CPU the head dominates a
            small draft's cost (SmolLM2: 49152 x 576 = 28 M of a 1-layer draft's 32 M multiply-adds).
        train_head: train (and ship) the output head's rows too; the input embedding stays frozen.
    """

    name: str
    num_layers: int = 1
    intermediate_size: int | None = None
    init_layers: tuple[int, ...] | None = None
    storage_dtype: str = "float32"
    head_tokens: int | None = None
    train_head: bool = False

    def __post_init__(self) -> None:
        check_field(bool(self.name) and "/" not in self.name, "name", f"must be a bare directory name, got {self.name!r}")
        check_field(isinstance(self.num_layers, int) and self.num_layers >= 1, "num_layers", f"must be an int >= 1, got {self.num_layers!r}")
        check_field(self.intermediate_size is None or self.intermediate_size >= 1, "intermediate_size", f"must be None or >= 1, got {self.intermediate_size!r}")
        if self.init_layers is not None:
            object.__setattr__(self, "init_layers", tuple(int(i) for i in self.init_layers))
            check_field(len(self.init_layers) == self.num_layers, "init_layers",
                        f"must list one target layer per draft layer ({self.num_layers}), got {self.init_layers!r}")
            check_field(min(self.init_layers) >= 0, "init_layers", f"must be non-negative layer indices, got {self.init_layers!r}")
        check_field(self.storage_dtype in _STORAGE_DTYPES, "storage_dtype", f"must be one of {sorted(_STORAGE_DTYPES)}, got {self.storage_dtype!r}")
        check_field(self.head_tokens is None or (isinstance(self.head_tokens, int) and self.head_tokens >= 1), "head_tokens",
                    f"must be None or an int >= 1, got {self.head_tokens!r}")
        check_field(isinstance(self.train_head, bool), "train_head", f"must be a bool, got {self.train_head!r}")

    @classmethod
    def from_name(cls, name: str) -> "DraftConfig":
        """A named preset (``DRAFT_PRESETS``), like gpt-fast's ``ModelArgs.from_name``."""
        if name not in DRAFT_PRESETS:
            raise ValueError(f"name must be one of {sorted(DRAFT_PRESETS)}, got {name!r}")
        return DRAFT_PRESETS[name]


DRAFT_PRESETS = {
    # ~3.5 M trained parameters per layer for SmolLM2-135M (hidden 576, MLP 1536): 14 MB per float32 layer.
    "tiny-1l": DraftConfig("tiny-1l", num_layers=1, init_layers=(0,)),
    "small-2l": DraftConfig("small-2l", num_layers=2, init_layers=(0, 29)),
    "base-4l": DraftConfig("base-4l", num_layers=4, init_layers=(0, 10, 20, 29), storage_dtype="bfloat16"),
    # Trained 8192-token heads: the head costs 0.9 ms instead of 11 ms per token on this CPU, which pays
    # for the layers. bfloat16: 4.7 M head + 3.5 M per layer parameters at 2 bytes (v8k-4l: 38 MB).
    "v8k-1l": DraftConfig("v8k-1l", num_layers=1, init_layers=(0,), head_tokens=8192, train_head=True, storage_dtype="bfloat16"),
    "v8k-2l": DraftConfig("v8k-2l", num_layers=2, init_layers=(0, 29), head_tokens=8192, train_head=True, storage_dtype="bfloat16"),
    "v8k-4l": DraftConfig("v8k-4l", num_layers=4, init_layers=(0, 10, 20, 29), head_tokens=8192, train_head=True,
                          storage_dtype="bfloat16"),
    # The capacity end of the alpha-vs-c trade-off (measured: c = 0.27, ~1.2 ms per layer on one thread).
    "v8k-8l": DraftConfig("v8k-8l", num_layers=8, init_layers=(0, 4, 8, 12, 17, 21, 25, 29), head_tokens=8192,
                          train_head=True, storage_dtype="bfloat16"),
}



def drafts_dir() -> Path:
    """``data/drafts`` of the source checkout (the package is installed editable), where drafts ship."""
    return data_dir("drafts")



class SubsetHead(torch.nn.Module):
    """An output head over a subset S of the vocabulary: logits over S, the dtype's lowest value elsewhere.

    ``forward`` returns full-vocabulary logits ``[..., V]`` (so softmax gives q(x) = 0 exactly off S, and
    no ``-inf`` reaches downstream arithmetic); :meth:`subset_logits` returns the ``[..., K]`` logits over
    S in ``token_ids`` order, which training uses. ``token_ids`` is a persistent buffer (shipped with
    the draft); ``index_of`` maps a vocabulary id to its position in S, or -1.
    """

    skinny_rows = SKINNY_ROWS  # the row counts skinny_linear computes its own way (models.use_skinny_linears)

    def __init__(self, weight: torch.Tensor, token_ids: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        token_ids = torch.as_tensor(token_ids, dtype=torch.long)
        check_field(token_ids.ndim == 1 and len(token_ids) == len(weight), "token_ids", f"must be [K] with K = {len(weight)} rows, got {tuple(token_ids.shape)}")
        check_field(len(token_ids) == len(token_ids.unique()), "token_ids", "must not repeat a token")
        check_field(0 <= int(token_ids.min()) and int(token_ids.max()) < vocab_size, "token_ids", f"must lie in [0, {vocab_size})")
        self.vocab_size = self.out_features = vocab_size  # out_features: the logits' size, as for nn.Linear
        self.weight = torch.nn.Parameter(weight.detach().clone())
        self.register_buffer("token_ids", token_ids.clone())
        index_of = torch.full((vocab_size,), -1, dtype=torch.long)
        index_of[token_ids] = torch.arange(len(token_ids))
        self.register_buffer("index_of", index_of, persistent=False)

    def subset_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return skinny_linear(hidden, self.weight, skinny_rows=self.skinny_rows)  # [..., K]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        subset = self.subset_logits(hidden)
        logits = subset.new_full((*subset.shape[:-1], self.vocab_size), torch.finfo(subset.dtype).min)
        return logits.index_copy_(-1, self.token_ids, subset)  # [..., V]


def build_draft(target, config: DraftConfig, seed: int = 0, head_token_ids: torch.Tensor | None = None):
    """A draft with the target's config but ``config.num_layers`` layers, embedding/head copied from the target.

    Args:
        target: a transformers causal LM with ``get_input_embeddings`` / ``get_output_embeddings``.
        config: the draft's shape; ``init_layers`` copies those target layers into the draft's.
        seed: seeds the random init of the layers (a forked RNG: the global RNG is untouched).
        head_token_ids: ``[K]`` token ids of the :class:`SubsetHead`, required iff ``config.head_tokens``
            (K = ``config.head_tokens``); its rows start as the target's head rows.
    Returns:
        a transformers causal LM in the target's dtype whose trainable parameters are its decoder layers,
        final norm and, if ``config.train_head``, its output head (:func:`trainable_state`).
    """
    if (config.head_tokens is None) != (head_token_ids is None):
        raise ValueError(f"head_token_ids must be given iff config.head_tokens is set (head_tokens={config.head_tokens})")
    if head_token_ids is not None and len(head_token_ids) != config.head_tokens:
        raise ValueError(f"head_token_ids must hold head_tokens = {config.head_tokens} ids, got {len(head_token_ids)}")
    from transformers import AutoModelForCausalLM

    hf_config = _draft_hf_config(target, config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        draft = AutoModelForCausalLM.from_config(hf_config)
    draft.to(dtype=target.dtype)
    if head_token_ids is not None:
        rows = target.get_output_embeddings().weight[torch.as_tensor(head_token_ids, dtype=torch.long)]
        draft.set_output_embeddings(SubsetHead(rows, head_token_ids, hf_config.vocab_size))
    _copy_from_target(draft, target, config)
    draft.get_input_embeddings().weight.requires_grad_(False)
    draft.get_output_embeddings().weight.requires_grad_(config.train_head)
    return draft


def _draft_hf_config(target, config: DraftConfig):
    hf_config = target.config.__class__.from_dict(target.config.to_dict())
    layers = hf_config.num_hidden_layers
    if config.init_layers is not None and max(config.init_layers) >= layers:
        raise ValueError(f"init_layers {config.init_layers} must be < the target's {layers} layers")
    hf_config.num_hidden_layers = config.num_layers
    if getattr(hf_config, "layer_types", None) is not None:
        hf_config.layer_types = hf_config.layer_types[: config.num_layers]
    if config.intermediate_size is not None:
        hf_config.intermediate_size = config.intermediate_size
    if config.train_head or config.head_tokens is not None:
        hf_config.tie_word_embeddings = False  # the head is trained or trimmed: it is not the input embedding
    return hf_config


@torch.no_grad()
def _copy_from_target(draft, target, config: DraftConfig) -> None:
    draft.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight)
    if config.head_tokens is None:
        draft.get_output_embeddings().weight.copy_(target.get_output_embeddings().weight)
    draft_decoder, target_decoder = draft.get_decoder(), target.get_decoder()
    draft_decoder.norm.load_state_dict(target_decoder.norm.state_dict())
    for mine, theirs in zip(draft_decoder.layers, config.init_layers or ()):
        mine.load_state_dict(target_decoder.layers[theirs].state_dict())


def trainable_state(draft) -> dict[str, torch.Tensor]:
    """The parameters that are trained and shipped (decoder layers, final norm, a trained head), by name."""
    return {name: p for name, p in draft.named_parameters() if p.requires_grad}



def embedding_fingerprint(model) -> dict:
    """Sizes and float64 moments of the input embedding: identifies the target up to dtype rounding."""
    weight = model.get_input_embeddings().weight.detach().double()
    return {
        "vocab_size": int(weight.shape[0]),
        "hidden_size": int(weight.shape[1]),
        "embedding_sum": float(weight.sum()),
        "embedding_sq_sum": float((weight * weight).sum()),
    }


def _check_fingerprint(target, expected: dict, where: Path) -> None:
    actual = embedding_fingerprint(target)
    same_shape = all(actual[k] == expected[k] for k in ("vocab_size", "hidden_size"))
    close = all(math.isclose(actual[k], expected[k], rel_tol=1e-3, abs_tol=1e-3) for k in ("embedding_sum", "embedding_sq_sum"))
    if not (same_shape and close):
        raise ValueError(f"target does not match the target the draft in {where} was trained on: {actual} vs {expected}")



def save_draft(draft, target, config: DraftConfig, directory: str | os.PathLike, manifest: dict | None = None) -> Path:
    """Write ``draft.safetensors`` (trained tensors only, in ``config.storage_dtype``) and ``manifest.json``.

    The manifest records ``draft_config``, the target's embedding fingerprint and whatever ``manifest``
    adds (command, seed, corpus size, training time, measurements).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = _STORAGE_DTYPES[config.storage_dtype]
    tensors = {name: p.detach().to(dtype).contiguous() for name, p in trainable_state(draft).items()}
    head = draft.get_output_embeddings()
    if isinstance(head, SubsetHead):
        tensors[_HEAD_IDS] = head.token_ids.detach().clone()
    save_file(tensors, str(directory / _WEIGHTS_FILE))
    write_manifest(directory, {"draft_config": asdict(config), "target": embedding_fingerprint(target), **(manifest or {})})
    return directory


def manifest_path(directory: str | os.PathLike) -> Path:
    """The manifest file of a trained draft's directory (distilled or feature head)."""
    return Path(directory) / _MANIFEST_FILE


def read_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of a trained draft's directory (distilled or feature head)."""
    return json.loads(manifest_path(directory).read_text())


def write_manifest(directory: str | os.PathLike, record: dict) -> None:
    """Write ``record`` as the manifest of a trained draft's directory (sorted keys, indented)."""
    manifest_path(directory).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


@torch.no_grad()
def round_to_storage(draft, config: DraftConfig) -> None:
    """Round the trained tensors through ``config.storage_dtype`` in place, so a measurement taken now is
    the measurement of the shipped draft (which :func:`load_draft` rebuilds from the rounded tensors)."""
    dtype = _STORAGE_DTYPES[config.storage_dtype]
    for p in trainable_state(draft).values():
        p.copy_(p.to(dtype).to(p.dtype))


def load_draft(target, directory: str | os.PathLike):
    """Rebuild a shipped draft: target's embedding/head (frozen) + the stored layers and norm.

    Raises ``ValueError`` if ``target`` is not the model the draft was trained against.
    Returns the draft in ``eval`` mode, in the target's dtype.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    _check_fingerprint(target, manifest["target"], directory)
    config = DraftConfig(**{**manifest["draft_config"], "init_layers": None})
    tensors = load_file(str(directory / _WEIGHTS_FILE))
    head_ids = tensors.pop(_HEAD_IDS, None)
    if (head_ids is None) != (config.head_tokens is None):
        raise ValueError(f"directory {directory}: head_tokens {config.head_tokens} but {_HEAD_IDS} is {'missing' if head_ids is None else 'stored'}")
    draft = build_draft(target, config, head_token_ids=head_ids)
    expected = trainable_state(draft)
    if tensors.keys() != expected.keys():
        raise ValueError(f"directory {directory}: stored tensors {sorted(tensors)} do not match the draft's {sorted(expected)}")
    with torch.no_grad():
        for name, p in expected.items():
            p.copy_(tensors[name].to(p.dtype))
    return draft.eval()


def load_trained_draft(target, name: str, root: str | os.PathLike | None = None):
    """The shipped draft ``<root>/<name>`` (default root :func:`drafts_dir`) rebuilt against ``target``."""
    directory = Path(root) if root is not None else drafts_dir()
    if not manifest_path(directory / name).exists():
        available = shipped_drafts(directory)
        raise ValueError(f"name {name!r}: no trained draft in {directory}; available: {available}")
    return load_draft(target, directory / name)


