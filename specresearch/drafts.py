"""Draft models behind the same interface as the target (``models.LanguageModel``).

* :class:`NGramDraft`: prompt lookup with a proper distribution. The next-token law q is the
  continuation counts of the longest n-gram (n <= ``max_ngram``) that ends the context and occurred
  before in it (falling back to the unigram counts of the context), mixed with a uniform floor:
  ``q = (1 - floor) * counts / sum(counts) + floor / V``. Every token has ``q > 0``, so the draft can
  be verified stochastically (token or block verification), not only greedily.
* Any transformers model with the target's tokenizer, wrapped in ``models.CausalLM``.
* :func:`truncated_draft`: the first few decoder layers of the target plus its embeddings, final norm
  and head -- a cheap stand-in until a distilled draft exists.

:func:`check_same_vocab` is the guard the engine applies: target and draft logits must have the same
size (compare logits, not ``len(tokenizer)``: a model's head can be padded beyond the tokenizer).
"""

from __future__ import annotations

import copy

import torch

from specresearch.models import CausalLM, _as_counts, _check_prompt, _Slots

__all__ = [
    "NGramDraft",
    "ngram_probs",
    "truncated_draft",
    "check_same_vocab",
    "check_same_tokenizer",
    "draft_from_name",
]


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
    counts = torch.zeros(vocab_size)
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        windows = context[:-1].unfold(0, n, 1)  # [L-n, n]: window i is followed by context[i+n]
        hits = (windows == context[-n:]).all(-1)
        if bool(hits.any()):
            counts = torch.bincount(context[n:][hits], minlength=vocab_size).float()
            break
    else:
        if len(context):
            counts = torch.bincount(context, minlength=vocab_size).float()
    lookup = counts / counts.sum() if counts.sum() > 0 else torch.full((vocab_size,), 1.0 / vocab_size)
    return (1 - floor) * lookup + floor / vocab_size


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
        self._slots: _Slots | None = None

    @property
    def cache_length(self) -> int:
        return 0 if self._slots is None else self._slots.length

    def reset(self, batch_size: int) -> None:
        self._tokens = torch.zeros(batch_size, 0, dtype=torch.long)
        self._slots = _Slots(torch.zeros(batch_size, 0, dtype=torch.bool))

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        _check_prompt(input_ids, attention_mask)
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
        common = self._slots.drop(_as_counts(n, self._tokens.shape[0], "cpu"))
        self._tokens = self._tokens[:, : self._tokens.shape[1] - common]

    def _append(self, tokens: torch.Tensor, valid: torch.Tensor) -> None:
        self._slots.append(valid)
        self._tokens = torch.cat([self._tokens, tokens], dim=1)

    def _row_logits(self) -> torch.Tensor:
        """log q after the current context of each row. -> [B, V]."""
        rows = [self._tokens[b][self._slots.mask[b]] for b in range(self._tokens.shape[0])]
        probs = torch.stack([ngram_probs(r, self.vocab_size, self.max_ngram, self.floor) for r in rows])
        return probs.log().to(self.device)


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


def draft_from_name(name: str, target: CausalLM, tokenizer=None):
    """A draft from a short description: ``"ngram"``, ``"truncated:N"`` (first N target layers) or a model path.

    ``tokenizer``: the target's; when given, a checkpoint draft's own tokenizer must equal it
    (``check_same_tokenizer``).
    """
    if name == "ngram":
        return NGramDraft(target.vocab_size, device=target.device)
    if name.startswith("truncated:"):
        return truncated_draft(target, int(name.split(":", 1)[1]))
    if tokenizer is not None:
        from transformers import AutoTokenizer

        check_same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(name, local_files_only=True))
    return CausalLM(name, device=target.device)
