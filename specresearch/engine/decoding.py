"""The classic decoding methods of the decoding survey on any next-token logits function.

Methods (the decoding survey, "Decoding From Language Models"):

* greedy -- argmax at each step ("Greedy Decoding");
* sampling -- ancestral, top-k, top-p, epsilon and temperature from a :class:`~specresearch.config.SamplingConfig`
  ("Sampling Based Decoding", "Temperature Scaling"), in the engine's one autoregressive loop
  (:func:`specresearch.engine.generate.autoregressive_generate`, which greedy and contrastive decoding use too);
* beam search -- width k, optional length normalisation ``score = log P / length^alpha``, EOS handling,
  the k best hypotheses with their scores ("Beam Search Algorithm", steps 1-7);
* n-gram blocking -- a token that would complete an n-gram already present in the sequence (prompt
  included) is banned ("The issue with these approaches"); usable with every method;
* contrastive decoding (Li et al. 2023; the decoding survey, "Contrastive Decoding") -- expert = target,
  amateur = draft: among tokens passing the adaptive plausibility constraint ``p_exp(x) >= alpha * max_w p_exp(w)``,
  pick ``argmax log p_exp(x) - log p_ama(x)``.

Everything runs on a *logits function* ``logits_fn(input_ids [B, T], attention_mask [B, T]) -> [B, V]``
(next-token logits after each full sequence). :func:`lm_logits_fn` adapts any model with the
``prefill``/``score`` interface of :mod:`specresearch.models.causal_lm` (reusing its KV cache when the sequence
grew by one token); a toy Markov table is ``lambda ids, mask: table[ids[:, -1]]``.

One entry point: :func:`decode` with a frozen :class:`DecodingConfig` (named presets via ``from_name``).
Randomness comes only from the ``torch.Generator`` passed in. The returned ``log_probs`` are always the
model's own (untransformed, unblocked) log-probabilities of the generated tokens, so methods can be
compared on likelihood.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

from specresearch.checks import check_int, check_real
from specresearch.config import SamplingConfig
from specresearch.core.draws import wide
from specresearch.core.sampling import check_logits
from specresearch.engine.generate import autoregressive_generate
from specresearch.engine.results import eos_ids
from specresearch.models.protocols import PlansContext

__all__ = [
    "LogitsFn",
    "METHODS",
    "DecodingConfig",
    "DECODING_PRESETS",
    "DecodeResult",
    "decode",
    "sample",
    "greedy",
    "beam_search",
    "contrastive",
    "contrastive_scores",
    "block_repeated_ngrams",
    "lm_logits_fn",
    "truncated_context",
    "sequence_log_probs",
    "repeated_ngrams",
    "phrase_repetition_log_probs",
]

LogitsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids [B, T], mask [B, T]) -> logits [B, V]
METHODS = ("greedy", "sample", "beam", "contrastive")




@dataclass(frozen=True)
class DecodingConfig:
    """What :func:`decode` does.

    Attributes:
        method: ``"greedy"``, ``"sample"`` (uses ``sampling``), ``"beam"`` or ``"contrastive"``.
        sampling: the transform for ``"sample"`` (ancestral, top-k, top-p, epsilon, temperature).
        max_new_tokens: tokens to generate per sequence (fewer if EOS comes first).
        num_beams: beam width k for ``"beam"`` (also the number of hypotheses returned).
        length_penalty: alpha of ``log P / length^alpha`` for ``"beam"`` (0 = raw log-probability).
        no_repeat_ngram_size: ban tokens that would repeat an n-gram of this size (None = off).
        contrastive_alpha: plausibility threshold for ``"contrastive"``, in (0, 1] (Li et al. use 0.1).
    """

    method: str = "sample"
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_new_tokens: int = 32
    num_beams: int = 4
    length_penalty: float = 0.0
    no_repeat_ngram_size: int | None = None
    contrastive_alpha: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if not isinstance(self.sampling, SamplingConfig):
            raise ValueError(f"sampling must be a SamplingConfig, got {type(self.sampling).__name__}")
        check_int("max_new_tokens", self.max_new_tokens, 1)
        check_int("num_beams", self.num_beams, 1)
        check_real("length_penalty", self.length_penalty, 0.0, 10.0)
        if self.no_repeat_ngram_size is not None:
            check_int("no_repeat_ngram_size", self.no_repeat_ngram_size, 1)
        check_real("contrastive_alpha", self.contrastive_alpha, 0.0, 1.0)
        if self.contrastive_alpha == 0:
            raise ValueError("contrastive_alpha must be > 0 (0 would let implausible tokens win); Li et al. use 0.1")

    @classmethod
    def from_name(cls, name: str, **changes) -> "DecodingConfig":
        """A named preset (see ``DECODING_PRESETS``), optionally with fields replaced, e.g. ``max_new_tokens=20``."""
        if name not in DECODING_PRESETS:
            raise ValueError(f"name must be one of {sorted(DECODING_PRESETS)}, got {name!r}")
        return dataclasses.replace(DECODING_PRESETS[name], **changes)


DECODING_PRESETS: dict[str, DecodingConfig] = {
    "greedy": DecodingConfig(method="greedy"),
    "greedy_no_repeat_3": DecodingConfig(method="greedy", no_repeat_ngram_size=3),
    "beam": DecodingConfig(method="beam", num_beams=4),
    "beam_normalised": DecodingConfig(method="beam", num_beams=4, length_penalty=1.0),
    "ancestral": DecodingConfig(method="sample"),
    "top_k": DecodingConfig(method="sample", sampling=SamplingConfig(top_k=50)),
    "top_p": DecodingConfig(method="sample", sampling=SamplingConfig(top_p=0.9)),
    "epsilon": DecodingConfig(method="sample", sampling=SamplingConfig(epsilon=3e-4)),
    "temperature_0.5": DecodingConfig(method="sample", sampling=SamplingConfig(temperature=0.5)),
    "temperature_1.5": DecodingConfig(method="sample", sampling=SamplingConfig(temperature=1.5)),
    "contrastive": DecodingConfig(method="contrastive", contrastive_alpha=0.1),
}


@dataclass(frozen=True)
class DecodeResult:
    """Output of a decoding method.

    Attributes:
        sequences: ``[N, T + n]`` prompt followed by generated tokens, right-padded with ``pad_token_id``
            after EOS (N = B, or num_beams hypotheses per prompt for beam search, best first).
        num_generated: ``[N]`` int64, generated tokens per row, EOS included.
        log_probs: ``[N]`` float64, sum of the model's log-probabilities (raw logits, no transform) of
            the generated tokens.
        scores: ``[N]`` float64, what the method ranks by: ``log_probs / num_generated^alpha`` for beam
            search, ``log_probs`` otherwise.
    """

    sequences: torch.Tensor
    num_generated: torch.Tensor
    log_probs: torch.Tensor
    scores: torch.Tensor


# ----------------------------------------------------------------------------- building blocks


def block_repeated_ngrams(input_ids: torch.Tensor, logits: torch.Tensor, ngram_size: int) -> torch.Tensor:
    """Set to -inf every token that would complete an n-gram already in ``input_ids`` (prompt included).

    Uses transformers' ``NoRepeatNGramLogitsProcessor`` as is (it does exactly this on ``[B, T]`` ids and
    ``[B, V]`` scores). Raises ``ValueError`` if a row has every token banned (only possible when the
    vocabulary is tiny compared with the sequence). ``[B, T], [B, V] -> [B, V]``.
    """
    check_int("ngram_size", ngram_size, 1)
    out = NoRepeatNGramLogitsProcessor(int(ngram_size))(input_ids, logits)
    if not torch.isfinite(out).any(dim=-1).all():
        raise ValueError(
            f"no_repeat_ngram_size={ngram_size}: every token is banned for some row (each continuation "
            "repeats an n-gram); use a larger n-gram size or fewer new tokens"
        )
    return out


def contrastive_scores(expert_logits: torch.Tensor, amateur_logits: torch.Tensor, alpha: float) -> torch.Tensor:
    """Contrastive decoding scores (Li et al. 2023, eq. 3 / the decoding survey, "Contrastive Decoding").

    ``score(x) = log p_exp(x) - log p_ama(x)`` for ``x`` in the plausible head
    ``{x : p_exp(x) >= alpha * max_w p_exp(w)}``, ``-inf`` outside. A plausible token the amateur gives
    probability 0 scores ``+inf``. Computed in float64. ``[..., V], [..., V] -> [..., V]``.
    """
    check_logits(expert_logits, "expert_logits")
    check_logits(amateur_logits, "amateur_logits")
    if expert_logits.shape != amateur_logits.shape:
        raise ValueError(f"expert_logits {tuple(expert_logits.shape)} and amateur_logits "
                         f"{tuple(amateur_logits.shape)} must have the same shape (same vocabulary)")
    check_real("alpha", alpha, 0.0, 1.0)
    log_exp = torch.log_softmax(wide(expert_logits), dim=-1)
    log_ama = torch.log_softmax(wide(amateur_logits), dim=-1)
    if alpha > 0:
        plausible = log_exp >= math.log(alpha) + log_exp.max(dim=-1, keepdim=True).values
    else:
        plausible = log_exp > -math.inf
    return torch.where(plausible, log_exp - log_ama, -math.inf)


def sequence_log_probs(logits_fn: LogitsFn, input_ids: torch.Tensor, continuation: torch.Tensor) -> torch.Tensor:
    """Log-probability of each token of ``continuation [B, n]`` after ``input_ids [B, T]`` (teacher forcing,
    one ``logits_fn`` call per token). Returns ``[B, n]`` float64."""
    out, ids = [], input_ids
    for j in range(continuation.shape[1]):
        logp = torch.log_softmax(wide(logits_fn(ids, torch.ones_like(ids))), dim=-1)
        out.append(logp.gather(-1, continuation[:, j : j + 1]))
        ids = torch.cat([ids, continuation[:, j : j + 1]], dim=1)
    return torch.cat(out, dim=1)


def repeated_ngrams(tokens, ngram_size: int) -> int:
    """Number of n-grams of ``tokens`` (a sequence of ints) that already occurred earlier in it."""
    check_int("ngram_size", ngram_size, 1)
    tokens = [int(t) for t in tokens]
    grams = [tuple(tokens[i : i + ngram_size]) for i in range(len(tokens) - ngram_size + 1)]
    return len(grams) - len(set(grams))


def phrase_repetition_log_probs(logits_fn: LogitsFn, prefix_ids: torch.Tensor, phrase_ids: torch.Tensor,
                                repeats: int) -> torch.Tensor:
    """log P(phrase at its k-th repetition | prefix + k - 1 copies), k = 1..repeats (teacher forcing).

    The self-amplification measurement of the decoding survey ("The issue with these approaches"): the
    probability a model gives a phrase rises each time it has already been repeated.
    ``prefix_ids [1, T]``, ``phrase_ids [m]`` -> ``[repeats]`` float64.
    """
    check_int("repeats", repeats, 1)
    _check_prompt(prefix_ids, None)
    phrase = phrase_ids.reshape(1, -1)
    per_token = sequence_log_probs(logits_fn, prefix_ids, phrase.repeat(1, repeats))  # [1, repeats * m]
    return per_token.reshape(repeats, -1).sum(-1)


# ----------------------------------------------------------------------------- model adapters


class _CachedLogitsFn:
    """``logits_fn`` over a prefill/score model: one ``score`` call when the input grew by one token. The engine's
    loop tells it which rows stay when some end (:meth:`select_rows`), so the cache follows instead of re-prefilling."""

    def __init__(self, model):
        self.model = model
        self._ids: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        prev = self._ids
        grew = (prev is not None and input_ids.shape[0] == prev.shape[0] and input_ids.shape[1] == prev.shape[1] + 1
                and torch.equal(input_ids[:, :-1], prev) and bool(attention_mask[:, -1].all()))
        shortest = int(attention_mask.sum(-1).min())
        if isinstance(self.model, PlansContext) and self.model.plan_context(input_ids.shape[1], shortest):
            grew = False  # rotations that follow the sequence's length (models.rotary) changed: the cache is stale
        if grew:
            logits = self.model.score(input_ids[:, -1:])[:, -1]
        else:
            logits = self.model.prefill(input_ids, attention_mask)
        self._ids = input_ids.clone()
        return logits

    def select_rows(self, index: torch.Tensor) -> None:
        if self._ids is not None and callable(getattr(self.model, "select_rows", None)):
            self.model.select_rows(index)
            self._ids = self._ids[index.to(self._ids.device)]


def lm_logits_fn(model) -> LogitsFn:
    """Adapt a model with ``prefill(ids, mask) -> [B, V]`` and ``score(tokens [B, k]) -> [B, k, V]``
    (``specresearch.models.causal_lm.CausalLM`` / ``ToyLM``) to a logits function.

    The KV cache is reused when a call's ``input_ids`` extend the previous call's by exactly one column;
    any other call (new prompt, beam reordering) re-prefills. The adapter owns the model's cache while
    it is used: do not interleave calls to the model from elsewhere.
    """
    for name in ("prefill", "score"):
        if not callable(getattr(model, name, None)):
            raise ValueError(f"model must have a callable {name}() (the specresearch.models.causal_lm interface)")
    return _CachedLogitsFn(model)


def truncated_context(logits_fn: LogitsFn, window: int) -> LogitsFn:
    """A weaker model made from ``logits_fn``: it only sees the last ``window`` tokens.

    Useful as the amateur of contrastive decoding when no smaller model is at hand.
    """
    check_int("window", window, 1)

    def short(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return logits_fn(input_ids[:, -window:], attention_mask[:, -window:])

    return short


# ----------------------------------------------------------------------------- autoregressive loop


def _check_prompt(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a [B, T] tensor with T >= 1, got {getattr(input_ids, 'shape', input_ids)}")
    if input_ids.dtype != torch.long:
        raise ValueError(f"input_ids must be int64 (torch.long), got {input_ids.dtype}")
    if attention_mask is None:
        return torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                         f"got {tuple(attention_mask.shape)}")
    return attention_mask.long()


class _FunctionModel:
    """A logits function as the engine's model, so the classic methods decode in the engine's one autoregressive loop
    (:func:`specresearch.engine.generate.autoregressive_generate`: finished rows leave the batch).

    It hands ``logits_fn`` each row's whole sequence at every step, the caller's prompt columns (padding as given)
    followed by the tokens fed back (``lm_logits_fn`` reuses a KV cache underneath). The loop samples from
    ``transform(ids, mask, logits)`` (n-gram blocking, contrastive scores); ``log_probs`` sums, per prompt, the
    untransformed log-probabilities of the tokens fed back, and :meth:`finish` adds each row's last token's.
    """

    def __init__(self, logits_fn, transform, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        self.logits_fn, self.transform = logits_fn, transform
        self.prompt, self.prompt_mask, self.device = input_ids, attention_mask, input_ids.device
        self.first = logits_fn(input_ids, attention_mask)  # [B, V]: the first step's logits, and the vocabulary's size
        check_logits(self.first)
        self.vocab_size = self.first.shape[-1]
        self.log_probs = wide(torch.zeros(input_ids.shape[0], device=self.device))
        self._last: dict[int, torch.Tensor] = {}  # prompt -> log-probabilities of its final step, once it left

    def reset(self, batch: int) -> None:
        self.prefill(None, None)

    def prefill(self, ids, mask) -> None:
        """Hold the caller's prompt columns but the last (the engine's pending token is that last column)."""
        self.ids, self.mask = self.prompt[:, :-1], self.prompt_mask[:, :-1]
        self.rows = torch.arange(self.prompt.shape[0], device=self.device)  # the prompt of each batch row
        self.logp: torch.Tensor | None = None  # [rows, V] of the last step

    def score(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens [B, 1]`` -> the next token's (transformed) logits ``[B, 1, V]``."""
        if self.logp is not None:  # tokens are the emitted ones: their log-probabilities count
            self.log_probs[self.rows] += self.logp.gather(-1, tokens)[:, 0]
        self.ids = torch.cat([self.ids, tokens], 1)
        self.mask = torch.cat([self.mask, torch.ones_like(tokens)], 1)
        # the prompt was scored (and checked) at load; later logits are checked with the step (the engine's one read)
        logits = self.first if self.logp is None else self.logits_fn(self.ids, self.mask)
        self.logp = torch.log_softmax(wide(logits), dim=-1)
        return self.transform(self.ids, self.mask, logits)[:, None]

    def repeat_rows(self, k: int) -> None:
        raise NotImplementedError("the classic methods decode one path per row")

    def select_rows(self, index: torch.Tensor) -> None:
        for fn in (self.logits_fn, self.transform):  # a cached logits function keeps only these rows too
            if callable(getattr(fn, "select_rows", None)):
                fn.select_rows(index)
        gone = sorted(set(range(len(self.rows))) - set(index.tolist()))
        self._last.update({int(self.rows[i]): self.logp[i] for i in gone})
        self.ids, self.mask, self.rows, self.logp = (t[index] for t in (self.ids, self.mask, self.rows, self.logp))

    def finish(self, last_tokens: list[int | None]) -> torch.Tensor:
        """Add each prompt's last emitted token (None: it emitted nothing) -> ``log_probs [B]``."""
        self._last.update({int(r): self.logp[i] for i, r in enumerate(self.rows.tolist())})
        for b, token in enumerate(last_tokens):
            if token is not None:
                self.log_probs[b] += self._last[b][token]
        return self.log_probs


def _autoregressive(transform, logits_fn, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id,
                    sampling: SamplingConfig, generator) -> DecodeResult:
    """Decode in the engine's autoregressive loop from ``transform(ids, mask, logits)``; rows end at EOS (then padded
    with ``pad_token_id``) or after ``max_new_tokens``."""
    check_int("max_new_tokens", max_new_tokens, 1)
    mask = _check_prompt(input_ids, attention_mask)
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError("attention_mask must be left-padded (zeros, then ones): pad prompts on the left")
    model = _FunctionModel(logits_fn, transform, input_ids, mask)
    if generator is None:  # the global RNG picks the seed (torch.manual_seed(s) reproduces a call); greedy draws none
        generator = 0 if sampling.greedy else int(torch.randint(2**62, ()))
    prompts = [row[m.bool()].tolist() for row, m in zip(input_ids, mask)]
    out = autoregressive_generate(model, prompts, max_new_tokens=max_new_tokens, sampling=sampling, seed=generator,
                                  eos_token_id=eos_token_id, step_timing=False)
    log_probs = model.finish([row[-1] if row else None for row in out.tokens])
    pad = _pad_id(pad_token_id, eos_token_id)
    width = max(len(row) for row in out.tokens)
    new = torch.tensor([list(row) + [pad] * (width - len(row)) for row in out.tokens], dtype=torch.long)
    generated = torch.tensor([len(row) for row in out.tokens], dtype=torch.long, device=input_ids.device)
    return DecodeResult(torch.cat([input_ids, new.to(input_ids.device)], 1), generated, log_probs, log_probs.clone())


def _blocking(ngram_size):
    """The transform for n-gram blocking (none: the logits as they are)."""
    if ngram_size is None:
        return lambda ids, mask, logits: logits
    return lambda ids, mask, logits: block_repeated_ngrams(ids, logits, ngram_size)


def sample(logits_fn: LogitsFn, input_ids: torch.Tensor, sampling: SamplingConfig, max_new_tokens: int, *,
           generator: torch.Generator | None = None, attention_mask: torch.Tensor | None = None,
           eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
           no_repeat_ngram_size: int | None = None) -> DecodeResult:
    """Sample ``max_new_tokens`` tokens per row from ``logits_to_probs(logits, sampling)`` (the decoding survey,
    "Sampling").

    Greedy configs take the argmax (first maximum) without drawing random numbers. n-gram blocking, if on,
    is applied to the logits before the transform. ``input_ids [B, T]`` -> ``sequences [B, T + n]``.
    """
    if not isinstance(sampling, SamplingConfig):
        raise ValueError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")

    return _autoregressive(_blocking(no_repeat_ngram_size), logits_fn, input_ids, attention_mask, max_new_tokens,
                           eos_token_id, pad_token_id, sampling, generator)


def greedy(logits_fn: LogitsFn, input_ids: torch.Tensor, max_new_tokens: int, **kwargs) -> DecodeResult:
    """Greedy decoding (the decoding survey, "Greedy Decoding"): ``sample`` with temperature 0 (first argmax)."""
    return sample(logits_fn, input_ids, SamplingConfig(temperature=0.0), max_new_tokens, **kwargs)


def contrastive(expert_fn: LogitsFn, amateur_fn: LogitsFn, input_ids: torch.Tensor, max_new_tokens: int, *,
                alpha: float = 0.1, attention_mask: torch.Tensor | None = None,
                eos_token_id: int | Sequence[int] | None = None,
                pad_token_id: int | None = None, no_repeat_ngram_size: int | None = None) -> DecodeResult:
    """Greedy contrastive decoding (Li et al. 2023): next token = argmax of :func:`contrastive_scores`.

    ``expert_fn`` is the target model, ``amateur_fn`` the draft (same vocabulary). n-gram blocking, if on,
    bans tokens in the expert's logits before the plausibility constraint. ``log_probs`` are the expert's.
    """

    blocked = _blocking(no_repeat_ngram_size)

    def scores(ids, mask, logits):  # a plausible token the amateur rules out scores +inf: the largest finite score
        out = contrastive_scores(blocked(ids, mask, logits), amateur_fn(ids, mask), alpha)
        return out.nan_to_num(nan=math.nan, posinf=torch.finfo(out.dtype).max, neginf=-math.inf)

    if callable(getattr(amateur_fn, "select_rows", None)):
        scores.select_rows = amateur_fn.select_rows

    return _autoregressive(scores, expert_fn, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id,
                           SamplingConfig(temperature=0.0), None)


# ----------------------------------------------------------------------------- beam search


@dataclass
class _Hypotheses:
    """The best ``size`` finished hypotheses: (score, log_prob, tokens), kept sorted best first."""

    size: int
    items: list = field(default_factory=list)

    def add(self, score: float, log_prob: float, tokens: list[int]) -> None:
        self.items.append((score, log_prob, tokens))
        self.items.sort(key=lambda item: -item[0])  # stable: earlier hypotheses win ties
        del self.items[self.size :]

    def worst(self) -> float:
        return self.items[-1][0] if len(self.items) == self.size else -math.inf


def _normalised(log_prob: float, length: int, alpha: float) -> float:
    return log_prob / length**alpha if alpha else log_prob


def beam_search(logits_fn: LogitsFn, input_ids: torch.Tensor, num_beams: int, max_new_tokens: int, *,
                length_penalty: float = 0.0, eos_token_id: int | Sequence[int] | None = None,
                pad_token_id: int | None = None,
                no_repeat_ngram_size: int | None = None) -> DecodeResult:
    """Beam search (the decoding survey, "Beam Search Algorithm") for ONE prompt ``input_ids [1, T]``.

    Each step extends every alive beam by every token, ranks candidates by cumulative log-probability and
    walks them best first: a candidate ending in EOS becomes a finished hypothesis (scored
    ``log P / length^alpha``, length = generated tokens incl. EOS), any other fills the next beam until
    ``num_beams`` are alive. At ``max_new_tokens`` the alive beams finish too. Stops early only when no
    alive beam can still beat the worst of ``num_beams`` finished hypotheses (log P never increases, so
    ``log P / max_new_tokens^alpha`` bounds its future score): with ``num_beams >= V^(n-1)`` nothing is
    ever pruned and the result is the exact top list. Returns ``num_beams`` hypotheses, best first.
    """
    check_int("num_beams", num_beams, 1)
    check_int("max_new_tokens", max_new_tokens, 1)
    check_real("length_penalty", length_penalty, 0.0, 10.0)
    _check_prompt(input_ids, None)
    if input_ids.shape[0] != 1:
        raise ValueError(f"beam_search takes one prompt, input_ids [1, T]; got batch {input_ids.shape[0]} "
                         "(call decode(), which loops over prompts)")
    prompt = input_ids[0].tolist()
    alive, alive_logp = [[]], [0.0]  # generated tokens of each alive beam, their log P
    finished = _Hypotheses(num_beams)
    for step in range(1, max_new_tokens + 1):
        bound = max(alive_logp) / (max_new_tokens**length_penalty if length_penalty else 1)
        if len(finished.items) == num_beams and bound <= finished.worst():
            break
        alive, alive_logp = _beam_step(logits_fn, prompt, alive, alive_logp, finished, step, num_beams,
                                       length_penalty, eos_ids(eos_token_id, None), no_repeat_ngram_size,
                                       last=step == max_new_tokens)
        if not alive:
            break
    return _hypotheses_result(prompt, finished, _pad_id(pad_token_id, eos_token_id))


def _beam_step(logits_fn, prompt, alive, alive_logp, finished, step, num_beams, alpha, eos, ngram, last):
    """One expansion + pruning step; returns the new alive beams and their log-probabilities."""
    ids = torch.tensor([prompt + beam for beam in alive], dtype=torch.long)  # [k, T + step - 1]
    logits = logits_fn(ids, torch.ones_like(ids))
    check_logits(logits)
    logp = torch.log_softmax(wide(logits), dim=-1)  # [k, V]
    if ngram is not None:
        logp = block_repeated_ngrams(ids, logp, ngram)
    cand = torch.tensor(alive_logp, dtype=logp.dtype, device=logp.device)[:, None] + logp  # [k, V]
    scores, order = torch.sort(cand.flatten(), descending=True, stable=True)
    vocab = logp.shape[-1]
    new_alive, new_logp, ended = [], [], 0
    for score, flat in zip(scores.tolist(), order.tolist()):
        # in the last step every candidate has the same length, so after num_beams of them the rest lose
        if score == -math.inf or len(new_alive) == num_beams or ended == num_beams and last:
            break
        tokens = alive[flat // vocab] + [flat % vocab]
        if last or flat % vocab in eos:
            finished.add(_normalised(score, step, alpha), score, tokens)
            ended += 1
        else:
            new_alive.append(tokens)
            new_logp.append(score)
    return new_alive, new_logp


def _hypotheses_result(prompt, finished: _Hypotheses, pad: int) -> DecodeResult:
    width = max(len(tokens) for _, _, tokens in finished.items)
    rows = [prompt + tokens + [pad] * (width - len(tokens)) for _, _, tokens in finished.items]
    return DecodeResult(
        sequences=torch.tensor(rows, dtype=torch.long),
        num_generated=torch.tensor([len(t) for _, _, t in finished.items], dtype=torch.long),
        log_probs=torch.tensor([lp for _, lp, _ in finished.items], dtype=torch.float64),
        scores=torch.tensor([s for s, _, _ in finished.items], dtype=torch.float64),
    )


# ----------------------------------------------------------------------------- entry point


def _pad_id(pad_token_id: int | None, eos_token_id) -> int:
    """What pads a finished row: ``pad_token_id``, else the lowest EOS id, else 0."""
    return pad_token_id if pad_token_id is not None else min(eos_ids(eos_token_id, None), default=0)


def _concat(results: list[DecodeResult], pad: int) -> DecodeResult:
    """Stack results of different widths, right-padding the sequences."""
    width = max(r.sequences.shape[1] for r in results)
    seqs = [torch.nn.functional.pad(r.sequences, (0, width - r.sequences.shape[1]), value=pad) for r in results]
    return DecodeResult(torch.cat(seqs), *(torch.cat([getattr(r, f) for r in results])
                                           for f in ("num_generated", "log_probs", "scores")))


def decode(logits_fn: LogitsFn, input_ids: torch.Tensor, config: DecodingConfig, *,
           amateur_fn: LogitsFn | None = None, generator: torch.Generator | None = None,
           attention_mask: torch.Tensor | None = None, eos_token_id: int | Sequence[int] | None = None,
           pad_token_id: int | None = None) -> DecodeResult:
    """Decode ``input_ids [B, T]`` with ``config`` (see :class:`DecodingConfig`); the one entry point.

    ``amateur_fn`` (the draft) is required for ``"contrastive"``. Beam search returns ``num_beams`` rows per
    prompt (prompt-major, best first) and ignores ``attention_mask`` (prompts are run one at a time,
    unpadded: pass unpadded prompts). ``generator`` seeds sampling.
    """
    if not isinstance(config, DecodingConfig):
        raise ValueError(f"config must be a DecodingConfig, got {type(config).__name__}")
    _check_prompt(input_ids, attention_mask)
    common = dict(eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                  no_repeat_ngram_size=config.no_repeat_ngram_size)
    if config.method == "contrastive":
        if amateur_fn is None:
            raise ValueError("amateur_fn is required for method='contrastive' (the draft model's logits function)")
        return contrastive(logits_fn, amateur_fn, input_ids, config.max_new_tokens, alpha=config.contrastive_alpha,
                           attention_mask=attention_mask, **common)
    if config.method == "beam":
        runs = [beam_search(logits_fn, row[None], config.num_beams, config.max_new_tokens,
                            length_penalty=config.length_penalty, **common) for row in input_ids]
        return _concat(runs, _pad_id(pad_token_id, eos_token_id))
    sampling = SamplingConfig(temperature=0.0) if config.method == "greedy" else config.sampling
    return sample(logits_fn, input_ids, sampling, config.max_new_tokens, generator=generator,
                  attention_mask=attention_mask, **common)
