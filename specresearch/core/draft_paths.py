"""Draft paths for multi-draft verification: K paths sampled i.i.d. or without replacement, their uniforms and target rows.
"""

from __future__ import annotations

import torch

from specresearch.checks import check_int
from specresearch.core.draws import sample_from_weights, uniforms

__all__ = ["DRAFT_LAWS", "draw_multi_uniforms", "path_target_probs", "sample_draft_paths"]

DRAFT_LAWS = ("iid", "without_replacement")


def check_sizes(**sizes):
    for name, value in sizes.items():
        check_int(name, value)


def draw_multi_uniforms(batch, num_drafts, length, generator=None, device=None, dtype=torch.float64):
    """The ``[batch, length+1, num_drafts]`` uniforms a multi-draft verifier consumes (module docstring).
    With ``num_drafts = 1`` the stream equals ``verify.draw_uniforms(batch, length, generator)``."""
    for name, value in (("batch", batch), ("num_drafts", num_drafts), ("length", length)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1; got {value}")
    return uniforms((batch, length + 1, num_drafts), generator, device, dtype)


def sample_draft_paths(draft_probs_fn, batch, num_drafts, length, draft_law="iid", generator=None, device=None):
    """Draw K draft paths of length L per batch row from a draft model (``exact_multi.draft_paths_law``).

    Args:
        draft_probs_fn: callable ``prefix_tokens [N, t] int64 -> [N, V]`` giving q(. | step start, prefix)
            for t = 0..L-1, with N = B*K rows ordered (b, k) row-major (row n belongs to batch row n // K).
        batch, num_drafts, length: B, K, L (each >= 1).
        draft_law: ``"iid"`` (K independent paths) or ``"without_replacement"`` (the K first tokens drawn
            without replacement, later tokens from q as usual). When a row's q has only m < K tokens of
            positive mass, paths m+1..K are copies of path m, as in the exact twin.
        generator: ``torch.Generator`` (draws on its own device).
        device: where the prefixes handed to ``draft_probs_fn`` live (default: the generator's, else the CPU).
    Returns:
        ``(draft_tokens [B, K, L] int64, draft_probs [B, K, L, V])``: the rows each token was drawn from
        (for a first token without replacement: q itself, before removing the earlier draws).
    """
    check_sizes(batch=batch, num_drafts=num_drafts, length=length)
    if draft_law not in DRAFT_LAWS:
        raise ValueError(f"draft_law must be one of {DRAFT_LAWS}; got {draft_law!r}")
    device = torch.device(device) if device is not None else generator.device if generator is not None else torch.device("cpu")
    tokens = torch.zeros(batch, num_drafts, 0, dtype=torch.int64, device=device)
    source, rows = None, []  # source[b, k]: the path that path k copies (itself unless a copy)
    for t in range(length):
        probs = call_probs_fn(draft_probs_fn, "draft_probs_fn", tokens, rows[0].shape[-1] if rows else None)
        u = uniforms((batch, num_drafts), generator, device)
        if t == 0 and draft_law == "without_replacement":
            drawn, source = first_tokens_without_replacement(probs[:, 0], u)
        else:
            flat = sample_from_weights(probs.reshape(batch * num_drafts, -1), u.reshape(-1).to(probs.dtype))
            drawn = flat.view(batch, num_drafts)
            drawn = drawn if source is None else drawn.gather(1, source)
        tokens = torch.cat([tokens, drawn[..., None]], -1)
        rows.append(probs)
    return tokens, torch.stack(rows, 2)


def path_target_probs(target_probs_fn, draft_tokens):
    """``target_probs [B, K, L+1, V]`` along the paths: row i of path k is p(. | step start, path k[:i]).

    Args:
        target_probs_fn: callable ``prefix_tokens [N, t] -> [N, V]`` as ``draft_probs_fn`` of
            ``sample_draft_paths`` (N = B*K rows ordered (b, k), t = 0..L).
        draft_tokens: ``[B, K, L]`` int64.
    """
    if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dim() != 3:
        raise ValueError("draft_tokens must be a [B, K, L] int64 tensor")
    rows = []
    for t in range(draft_tokens.shape[2] + 1):
        vocab = rows[0].shape[-1] if rows else None
        rows.append(call_probs_fn(target_probs_fn, "target_probs_fn", draft_tokens[:, :, :t], vocab))
    return torch.stack(rows, 2)


def call_probs_fn(probs_fn, name, prefixes, vocab):
    """``probs_fn`` on the ``[B, K, t]`` prefixes flattened to ``[B*K, t]``; returns ``[B, K, V]``."""
    batch, num_drafts, t = prefixes.shape
    probs = probs_fn(prefixes.reshape(batch * num_drafts, t))
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2 or probs.shape[0] != batch * num_drafts:
        shape = list(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__
        raise ValueError(f"{name} must return a [N, V] tensor for N = {batch * num_drafts} prefixes; got {shape}")
    if vocab is not None and probs.shape[1] != vocab:
        raise ValueError(f"{name} returned V = {probs.shape[1]} at prefix length {t}, but V = {vocab} before")
    return probs.view(batch, num_drafts, -1)


def first_tokens_without_replacement(probs, u):
    """K first tokens drawn without replacement from ``probs [B, V]`` with ``u [B, K]``; returns the tokens
    ``[B, K]`` and ``source [B, K]`` (path k copies path source[b, k] once the positive mass ran out)."""
    batch, num_drafts = u.shape
    remaining = probs.clone()
    tokens = torch.empty(batch, num_drafts, dtype=torch.int64, device=probs.device)
    source = torch.empty_like(tokens)
    for k in range(num_drafts):
        has_mass = remaining.sum(-1) > 0
        drawn = sample_from_weights(remaining, u[:, k].to(probs.dtype))
        tokens[:, k] = drawn if k == 0 else torch.where(has_mass, drawn, tokens[:, k - 1])
        source[:, k] = k if k == 0 else torch.where(has_mass, k, source[:, k - 1])
        remaining.scatter_(1, tokens[:, k : k + 1], 0)
    return tokens, source
