"""Dial drafts: the target's own distribution, perturbed by a controlled amount, as a draft.

They put the acceptance rate alpha = E[sum_x min(p, q)] where we want it (about 0.3 to 1) on the real
target and the same prompts, to see the regime of Sun et al. 2025 (arXiv 2403.10444: Vicuna-7B/68M, alpha ~ 0.65-0.7) on a
small model. Every draft token costs a full forward pass of the target, so with them ONLY the block
efficiency (BE, tokens per target call) is meaningful; wall-clock speed-ups are not (label them so
wherever they appear: ``COSTS_TARGET_FORWARD``).

A :class:`DialDraft` returns logits ``log r`` where r is the perturbed RAW (temperature 1) next-token law:

* ``"mix"``:      r = lam * p_raw + (1 - lam) * d_raw, with d the shipped draft (``other``);
* ``"uniform"``:  r = lam * p_raw + (1 - lam) / V;
* ``"temperature"``: r = softmax(target logits / s), the target at temperature s.

The engine then applies the run's sampling transform (``sampling.logits_to_probs``) to these logits, as to
any draft's, so the q actually sampled from and verified is r transformed (r^(1/T), normalised, at
temperature T). alpha therefore depends on T as well as on the setting; measure it per run
(``speculative_generate(expectations=...)`` records the per-step overlap).

Names (``dial_draft_from_name``, also accepted by ``drafts.registry.draft_from_name``): ``dial-mix:LAM`` (or
``dial-mix:LAM:DRAFT`` for another shipped draft than ``v8k-4l``), ``dial-uniform:LAM``, ``dial-temp:S``.
"""

from __future__ import annotations

import math

import torch

from specresearch.models.causal_lm import CausalLM
from specresearch.models.static_states import allocate_form

__all__ = ["COSTS_TARGET_FORWARD", "DIAL_KINDS", "DialDraft", "StaticDialDraft", "dial_draft_from_name", "is_dial_name"]

COSTS_TARGET_FORWARD = "draft runs the target (only BE is meaningful, not wall-clock)"
DIAL_KINDS = ("mix", "uniform", "temperature")
_PREFIXES = {"dial-mix": "mix", "dial-uniform": "uniform", "dial-temp": "temperature"}


class DialDraft:
    """A draft whose raw next-token law is the target's, perturbed (module docstring); ``LanguageModel``.

    Args:
        base: a ``LanguageModel`` computing the TARGET's logits with its own cache (e.g. ``CausalLM(target.model)``;
            not the target object itself, whose cache the engine drives).
        kind: ``"mix"``, ``"uniform"`` or ``"temperature"``.
        amount: lam in [0, 1] for the mixtures (1 = the target itself); s > 0 for ``"temperature"``.
        other: the ``LanguageModel`` mixed in by ``"mix"`` (its own cache; same vocabulary); None otherwise.
    """

    def __init__(self, base, kind: str, amount: float, other=None):
        if kind not in DIAL_KINDS:
            raise ValueError(f"kind must be one of {DIAL_KINDS}, got {kind!r}")
        if kind == "temperature" and not (isinstance(amount, (int, float)) and amount > 0):
            raise ValueError(f"amount must be a temperature s > 0 for kind 'temperature', got {amount!r}")
        if kind != "temperature" and not (isinstance(amount, (int, float)) and 0 <= amount <= 1):
            raise ValueError(f"amount must be a mixture weight in [0, 1] for kind {kind!r}, got {amount!r}")
        if (kind == "mix") != (other is not None):
            raise ValueError("other must be given for kind 'mix' (the model mixed in) and only for it")
        if other is not None and other.vocab_size != base.vocab_size:
            raise ValueError(f"other has vocab_size {other.vocab_size} but base {base.vocab_size}; they must match")
        self.base, self.kind, self.amount, self.other = base, kind, float(amount), other
        self.vocab_size, self.device = base.vocab_size, base.device
        self.max_context = getattr(base, "max_context", None)

    @property
    def cache_length(self) -> int:
        return self.base.cache_length

    def reset(self, batch_size: int) -> None:
        for model in self._models():
            model.reset(batch_size)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Prefill both models; the perturbed logits after the prompt ``[B, V]``."""
        return self._combine(*(m.prefill(input_ids, attention_mask) for m in self._models()))

    def score(self, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Append ``tokens [B, k]`` to both models; the perturbed logits ``[B, k, V]``."""
        return self._combine(*(m.score(tokens, valid) for m in self._models()))

    def plan_context(self, positions: int, shortest: int | None = None) -> bool:
        """Both models' plans of the run's context (``models.protocols.PlansContext``), where they have one."""
        return any([bool(model.plan_context(positions, shortest)) for model in self._models()
                    if hasattr(model, "plan_context")])

    def rollback(self, n) -> None:
        for model in self._models():
            model.rollback(n)

    def repeat_rows(self, k: int) -> None:
        for model in self._models():
            model.repeat_rows(k)

    def select_rows(self, index: torch.Tensor) -> None:
        for model in self._models():
            model.select_rows(index)

    def _models(self) -> list:
        return [self.base] if self.other is None else [self.base, self.other]

    @property
    def static_refusal(self) -> str | None:
        """Why this draft has no static form (a model mixed in that has none, or reads the target's features), or
        None."""
        if self.other is not None and (not hasattr(self.other, "static_form") or hasattr(self.other, "feature_layers")):
            return f"a dial mix with {type(self.other).__name__}, which has no whole-model static form"
        return getattr(self.base, "static_refusal", None) or getattr(self.other, "static_refusal", None)

    @property
    def recurrent(self) -> bool:
        """Whether a model it mixes has recurrent layers (its captured steps then draft chains only)."""
        return any(getattr(model, "recurrent", False) for model in self._models())

    def static_form(self) -> "StaticDialDraft":
        """This draft in the engine's captured steps (:class:`StaticDialDraft`)."""
        if self.static_refusal:
            raise ValueError(f"{self.static_refusal}: run the growing loop (compile='off')")
        return StaticDialDraft(self)

    def _combine(self, base_logits: torch.Tensor, other_logits: torch.Tensor | None = None) -> torch.Tensor:
        """log r from the target's logits (and the mixed-in model's), ``[..., V]`` -> ``[..., V]`` float32."""
        base_logits = base_logits.float()
        if self.kind == "temperature":
            return base_logits / self.amount
        if self.kind == "uniform":
            other = torch.full_like(base_logits, -math.log(self.vocab_size))
        else:
            other = torch.log_softmax(other_logits.float().to(base_logits.device), -1)
        return torch.logaddexp(_log_weight(self.amount) + torch.log_softmax(base_logits, -1),
                               _log_weight(1 - self.amount) + other)


class StaticDialDraft:
    """A :class:`DialDraft` in the engine's captured steps: the static forms of its target model and of the model mixed
    in, fed alike, their logits combined as the draft combines them (``models.protocols.StaticModel``)."""

    def __init__(self, draft: DialDraft) -> None:
        self.draft = draft
        self.models = [model.static_form() for model in draft._models()]
        self.vocab_size, self.device, self.max_context = draft.vocab_size, draft.device, draft.max_context

    @property
    def rows(self):
        return self.models[0].rows

    @property
    def held_rows(self) -> list:
        """Each model's rows: every extent a step changes (``engine.static``'s small state)."""
        return [r for model in self.models for r in getattr(model, "held_rows", [model.rows])]

    @property
    def recurrent(self) -> bool:
        return any(getattr(model, "recurrent", False) for model in self.models)

    @property
    def held_states(self) -> list[torch.Tensor]:
        """Each model's kept recurrent states (``models.static_lm.StaticCausalLM.held_states``), if any."""
        return [t for model in self.models for t in getattr(model, "held_states", [])]

    def allocate(self, batch: int, capacity: int, span: int | None = None) -> None:
        """``span``: for models with recurrent layers, the most tokens written between two commits."""
        for model in self.models:
            allocate_form(model, batch, capacity, span)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, leave: int = 0):
        outs = [model.prefill(input_ids, attention_mask, leave=leave)[0] for model in self.models]
        return (None if outs[0] is None else self.draft._combine(*outs)), None

    def forward(self, tokens: torch.Tensor, **where):
        return self.draft._combine(*(model.forward(tokens, **where)[0] for model in self.models)), None

    def commit(self, n) -> None:
        for model in self.models:
            model.commit(n)

    def keep_path(self, source: torch.Tensor, n: torch.Tensor) -> None:
        for model in self.models:
            model.keep_path(source, n)


def _log_weight(weight: float) -> float:
    return math.log(weight) if weight > 0 else float("-inf")


def is_dial_name(name: str) -> bool:
    """Whether ``name`` names a dial draft (``dial-mix:..``, ``dial-uniform:..``, ``dial-temp:..``)."""
    return name.split(":", 1)[0] in _PREFIXES


def dial_draft_from_name(name: str, target: CausalLM, resolve=None) -> DialDraft:
    """A :class:`DialDraft` over ``target``'s HF model (own cache) from its name (module docstring).

    ``resolve``: ``name -> draft``, builds the other draft of ``dial-mix:LAM:DRAFT`` (default ``v8k-4l``);
    :func:`specresearch.drafts.registry.draft_from_name` passes itself.
    """
    parts = name.split(":")
    if parts[0] not in _PREFIXES or len(parts) < 2 or len(parts) > (3 if parts[0] == "dial-mix" else 2):
        raise ValueError(f"name must be dial-mix:LAM[:DRAFT], dial-uniform:LAM or dial-temp:S; got {name!r}")
    try:
        amount = float(parts[1])
    except ValueError:
        raise ValueError(f"name {name!r}: {parts[1]!r} is not a number (e.g. dial-mix:0.5)") from None
    kind = _PREFIXES[parts[0]]
    fuses = getattr(target, "fuses", None)  # the same model object: fused as the target left it
    base = CausalLM(target.model, device=target.device, fuse_projections=fuses)
    other = None
    if kind == "mix":
        if resolve is None:
            raise ValueError(f"name {name!r}: a dial-mix draft needs resolve= to build the draft it mixes in")
        other = resolve(parts[2] if len(parts) == 3 else "v8k-4l")
    return DialDraft(base, kind, amount, other)
