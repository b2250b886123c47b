"""Bring your own rule: both forms of a single-draft rule from a per-candidate acceptance probability.

A researcher's rule "accept draft token x with probability a(p(x), q(x)); on rejection sample a residual"
becomes, with :func:`rule_from_acceptance`, an exact rule for :func:`specresearch.audit.audit` and a batched
torch verifier with the signature of :func:`specresearch.core.verify.token_verify` (for the statistical test
through the engine), from one function::

    rule = rule_from_acceptance(lambda p_x, q_x: min(1, p_x / q_x) ** 0.5, name="sqrt-ratio")
    print(audit(rule))

Numbers. The exact form calls ``accept`` with :class:`fractions.Fraction` s. If it returns a rational, the laws
are exact Fractions. If it returns a float (``** 0.5`` above), the rule is evaluated again with 60-digit
:mod:`mpmath` numbers, and a deviation below ``rules.TOLERANCE`` (1e-40) counts as zero: the verdict is then
numerical, at a precision no float computation reaches, and the report says so.

The torch form calls ``accept`` on whole ``[B]`` float64 tensors when it can (write ``torch.clamp`` /
``torch.minimum`` for that), and otherwise on Python floats, one call per candidate: fine for auditing,
not for speed.
"""

from __future__ import annotations

import numbers
from collections import defaultdict
from collections.abc import Callable
from fractions import Fraction

import mpmath
import torch

from specresearch.audit.rules import DIGITS, Rule
from specresearch.core.draws import draw_uniforms, sample_from_weights
from specresearch.core.verify import VerifyResult, validate_inputs

__all__ = ["RESIDUALS", "rule_from_acceptance"]

RESIDUALS = ("ratio", "target", "lossless")


def _residual_row(residual, p_row, q_row, accept) -> list:
    """Weights of the token emitted after a rejection (normalised by the caller)."""
    if residual == "ratio":  # Leviathan et al.: max(p - q, 0)
        return [max(p - q, 0) for p, q in zip(p_row, q_row)]
    if residual == "target":  # a fresh sample from p
        return list(p_row)
    if residual == "lossless":  # max(p - q a, 0): lossless exactly when a <= p / q wherever q > 0
        return [max(p - q * (accept(p, q) if q else 0), 0) for p, q in zip(p_row, q_row)]
    return list(residual(p_row, q_row))


def _exact_law(accept: Callable, residual, numeric: bool) -> Callable:
    def convert(row):
        return [mpmath.mpf(v.numerator) / v.denominator for v in row] if numeric else list(row)

    def law(target, draft, paths, prefix):
        (path,) = paths
        out, mass = defaultdict(Fraction), Fraction(1)
        with mpmath.workdps(DIGITS):
            for d, x in enumerate(path):
                p_row, q_row = convert(target(prefix + path[:d])), convert(draft(prefix + path[:d]))
                a = _probability(accept(p_row[x], q_row[x]), p_row[x], q_row[x]) if q_row[x] else 0
                weights = _residual_row(residual, p_row, q_row, accept)
                total = sum(weights)
                row = [w / total for w in weights] if total else p_row
                for t, v in enumerate(row):
                    if v:
                        out[path[:d] + (t,)] += mass * (1 - a) * v
                mass *= a
            for t, v in enumerate(convert(target(prefix + path))):
                if v:
                    out[path + (t,)] += mass * v
        return out

    return law


def _probability(a, p_x, q_x):
    """``a`` when it is a number in [0, 1]; else a ValueError naming the point (None, a string and a complex
    number included, which ``0 <= a`` would meet with a TypeError that names neither the rule nor the point)."""
    try:
        if 0 <= a <= 1:
            return a
    except TypeError:
        pass
    shown = repr(a) if isinstance(a, str) else a
    raise ValueError(f"accept returned {shown} at p(x) = {p_x}, q(x) = {q_x}: not a probability")


def _is_exact(accept: Callable) -> bool:
    """Does ``accept`` return rationals for rational input? (probed at a few points)."""
    probes = [(Fraction(1, 3), Fraction(2, 3)), (Fraction(2, 3), Fraction(1, 3)), (Fraction(1, 2), Fraction(1, 2))]
    return all(isinstance(accept(p, q), numbers.Rational) for p, q in probes)


def _accept_tensor(accept: Callable, p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """accept on [B] tensors, vectorised when ``accept`` allows it, else one Python call per element."""
    try:
        out = accept(p_x, q_x)
        if isinstance(out, torch.Tensor) and out.shape == p_x.shape:
            return out.to(p_x.dtype)
    except (RuntimeError, TypeError):
        pass
    return torch.tensor([float(accept(p, q)) for p, q in zip(p_x.tolist(), q_x.tolist())], dtype=p_x.dtype, device=p_x.device)


def _torch_residual(residual, accept, p_rows, q_rows):
    """[n, V] weights after a rejection, for the rows ``p_rows`` / ``q_rows`` [n, V]."""
    if residual == "ratio":
        weights = (p_rows - q_rows).clamp(min=0)
    elif residual == "target":
        weights = p_rows.clone()
    elif residual == "lossless":
        a = _accept_tensor(accept, p_rows.reshape(-1), q_rows.reshape(-1)).view_as(p_rows)
        weights = (p_rows - q_rows * torch.where(q_rows > 0, a, torch.zeros_like(a))).clamp(min=0)
    else:
        weights = torch.stack([torch.as_tensor(residual(p.tolist(), q.tolist()), dtype=p_rows.dtype) for p, q in zip(p_rows, q_rows)])
    empty = weights.sum(-1, keepdim=True) <= 0
    return torch.where(empty, p_rows, weights)


def _torch_form(accept: Callable, residual) -> Callable:
    def verify(target_probs, draft_probs, draft_tokens, generator=None, *, uniforms=None, validate=True):
        """Batched form: target_probs [B, L+1, V], draft_probs [B, L, V], draft_tokens [B, L] -> VerifyResult."""
        if validate:
            validate_inputs(target_probs, draft_probs, draft_tokens)
        batch, length = draft_tokens.shape
        if uniforms is None:
            uniforms = draw_uniforms(batch, length, generator, device=target_probs.device)
        uniforms = uniforms.to(device=target_probs.device, dtype=torch.float64)
        p_x = target_probs[:, :length].gather(-1, draft_tokens[..., None]).squeeze(-1).double()  # [B, L]
        q_x = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1).double()
        a = torch.stack([_accept_tensor(accept, p_x[:, d], q_x[:, d]) for d in range(length)], 1)  # [B, L]
        a = torch.where(q_x > 0, a, torch.zeros_like(a))
        rejected = uniforms[:, :length] >= a
        num_accepted = torch.where(rejected.any(1), rejected.long().argmax(1), torch.full_like(rejected[:, 0], length, dtype=torch.long))
        rows = torch.arange(batch, device=target_probs.device)
        p_rows = target_probs[rows, num_accepted].double()  # [B, V]
        q_rows = draft_probs[rows, num_accepted.clamp(max=length - 1)].double()
        weights = torch.where((num_accepted < length)[:, None], _torch_residual(residual, accept, p_rows, q_rows), p_rows)
        return VerifyResult(num_accepted, sample_from_weights(weights, uniforms[:, length]))

    return verify


def rule_from_acceptance(accept: Callable, residual="ratio", *, name: str = "custom", gamma: int = 1) -> Rule:
    """A single-draft rule (drafts sampled from q, one chain of ``gamma`` tokens) in both forms.

    Args:
        accept: ``(p_x, q_x) -> probability`` of accepting a draft token with target probability p_x and draft
            probability q_x (never called with q_x = 0: such a token is rejected). Token verification is
            ``lambda p_x, q_x: min(1, p_x / q_x)``.
        residual: the law sampled after the first rejection: ``"ratio"`` (norm(max(p - q, 0)), Leviathan et
            al.), ``"target"`` (a fresh sample from p), ``"lossless"`` (norm(max(p - q a, 0)), the residual that
            makes any a <= p/q lossless), or a callable ``(p_row, q_row) -> weights``. A residual of zero mass
            falls back to p.
        name, gamma: the rule's name in reports and its draft length.
    Returns:
        A :class:`~specresearch.audit.rules.Rule` whose ``torch_rule`` is the batched verifier.
    """
    if not callable(accept):
        raise ValueError(f"accept must be a callable (p_x, q_x) -> probability, got {accept!r}")
    if not (callable(residual) or residual in RESIDUALS):
        raise ValueError(f"residual must be one of {RESIDUALS} or a callable (p_row, q_row) -> weights, got {residual!r}")
    numeric = not _is_exact(accept)
    params = {"residual": residual if isinstance(residual, str) else getattr(residual, "__name__", "custom")}
    if numeric:
        params["arithmetic"] = f"mpmath, {DIGITS} digits"
    return Rule(name, _exact_law(accept, residual, numeric), "iid", 1, gamma, params, "",
                "rule_from_acceptance", torch_rule=_torch_form(accept, residual), numeric=numeric)
