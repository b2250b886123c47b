"""The weights behind K-SEQ and GBV: K-SEQ's rho, GBV's ranking, conditional draft rows and root residual.
"""

from __future__ import annotations

import torch

from specresearch.core.draws import sample_from_weights, wide
from specresearch.core.verify import block_scales

__all__ = []

_KSEQ_STEPS = 16


def fallback(weights, target):
    """``weights [B, V]``, or ``target`` on the rows where the weights have zero mass (``verify``'s rule)."""
    return torch.where((weights.sum(-1) == 0)[:, None], target, weights)


def kseq_rho(target, draft, num_drafts):
    """rho* per row (``[B]``, computed in the rows' dtype), the root of g on [1, K] (module docstring); 1 when K = 1.

    Regula falsi with the Illinois modification (a retained end's g is halved), which keeps a bracket
    [low, high] with g(low) >= 0 >= g(high) and converges superlinearly; the last of ``_KSEQ_STEPS`` iterates
    is returned (within 1e-12 of the exact root in tests/test_verify_multi.py).
    """
    if num_drafts == 1:
        return target.new_ones(target.shape[0])
    p, q = target, draft  # the rows' dtype, as every other computation here

    def g(rho):
        beta = torch.minimum(q, p / rho[:, None]).sum(-1)
        return sum((1 - beta) ** j for j in range(num_drafts)) - rho

    low, high = p.new_ones(p.shape[0]), p.new_full((p.shape[0],), float(num_drafts))
    g_low, g_high = g(low), g(high)  # >= 0 and <= 0 (exact facts; rounding may give tiny wrong signs)
    side = torch.zeros_like(low)  # +1: the last step replaced low, -1: it replaced high
    for _ in range(_KSEQ_STEPS):
        span = g_low - g_high
        secant = low + g_low * (high - low) / span.clamp(min=torch.finfo(span.dtype).tiny)
        rho = torch.where(span > 0, secant, (low + high) / 2)
        rho = rho.clamp(min=low, max=high)
        g_rho = g(rho)
        above = g_rho > 0  # rho replaces low (else high)
        g_high = torch.where(above & (side > 0), g_high / 2, g_high)  # Illinois: high kept twice in a row
        g_low = torch.where(~above & (side < 0), g_low / 2, g_low)  # low kept twice in a row
        low, g_low = torch.where(above, rho, low), torch.where(above, g_rho, g_low)
        high, g_high = torch.where(above, high, rho), torch.where(above, g_high, g_rho)
        side = torch.where(above, 1.0, -1.0)
    return rho


def rank_ratio(target, draft):
    """p/q where q > 0, +inf where q = 0 (ranked last), in the rows' dtype; any shape."""
    return torch.where(draft > 0, target / draft, torch.full_like(target, float("inf")))


def gbv_select(target_probs, draft_probs, draft_tokens):
    """X*: the index of the largest path (lexicographic in per-node (p/q, token id)); ``[B]`` int64.
    Paths that are still tied share their prefix, hence their rows, so their ratios are the same floats."""
    index = draft_tokens[..., None]  # [B, K, L, 1]
    length = draft_tokens.shape[2]
    p_x = target_probs[:, :, :length].gather(-1, index).squeeze(-1)  # [B, K, L]
    q_x = draft_probs.gather(-1, index).squeeze(-1)
    ratio = rank_ratio(p_x, q_x)
    tied = torch.ones_like(draft_tokens[:, :, 0], dtype=torch.bool)  # [B, K]
    for d in range(length):
        key = torch.where(tied, ratio[:, :, d], float("-inf"))
        tied &= key == key.max(-1, keepdim=True).values
        token = torch.where(tied, draft_tokens[:, :, d], -1)
        tied &= token == token.max(-1, keepdim=True).values
    return tied.long().argmax(-1)


def gbv_along(target, draft, tokens, num_drafts):
    """Along X* (``target [B, L+1, V]``, ``draft [B, L, V]``, ``tokens [B, L]``), without sorting: r = A_v / Q_v
    at each depth and q^G(x_d | v), both ``[B, L]`` float64. y(x) is a masked sum over the tokens ranked below x
    (p/q smaller, or equal with a smaller id), and r <- (r + y(x)) / q(x)."""
    batch, length, vocab = draft.shape
    ids = torch.arange(vocab, device=tokens.device)
    below = wide(torch.zeros(batch, device=draft.device))  # r = A_v / Q_v, 0 at the root
    ratios, drafted = [], []
    for d in range(length):
        q, x = wide(draft[:, d]), tokens[:, d : d + 1]
        ratio = rank_ratio(target[:, d], draft[:, d])
        ratio_x = ratio.gather(1, x)
        ranked_below = ((ratio < ratio_x) | ((ratio == ratio_x) & (ids < x))).to(q.dtype)
        y_x, q_x = (q * ranked_below).sum(-1), q.gather(1, x).squeeze(1)
        ratios.append(below)
        drafted.append(gbv_conditional(q_x, y_x, below, num_drafts))
        below = torch.where(q_x > 0, (below + y_x) / q_x, torch.zeros_like(below))
    return torch.stack(ratios, 1), torch.stack(drafted, 1)


def gbv_conditional(q, y, below, num_drafts):
    """q^G(t | v) = q(t) S(a, b) / S(1, c) (module docstring) for q = q(t | v), y = q-mass ranked below t
    (both normalised by Q_v) and below = A_v / Q_v, broadcast; float64."""
    shrink = 1 / (1 + below)
    start = (below + y) * shrink
    top = start + q * shrink
    return q * power_sum(top, start, num_drafts) / power_sum(torch.ones_like(below), below * shrink, num_drafts)


def gbv_needed(target, draft, tokens, drafted, eta):
    """Which q^G rows ``[B, L]`` block verification reads in full before it knows tau (``drafted [B, L]``:
    q^G(x_d) from ``gbv_along``; ``eta [B, L+1]``: block verification's uniforms): none when eta_L < p_L
    (tau = L, bonus row); else every row i in 1..L-1 with eta_i < p_i (the candidates of its backward scan;
    elsewhere h_i <= p_i <= eta_i, whatever the row). Row 0 only serves the sample when tau = 0
    (``gbv_resample_root``). The scales p_i need q^G at the drafted tokens only (no sort)."""
    length = tokens.shape[1]
    p_x = target[:, :length].gather(-1, tokens[..., None]).squeeze(-1)  # [B, L]
    q_x = drafted.to(draft.dtype)
    scale = block_scales(p_x, q_x)  # [B, L]: p_1..p_L, as block_verify computes them from the rows
    open_rows = eta[:, length - 1] >= scale[:, -1]  # [B]: tau < L possible
    candidates = eta[:, : length - 1] < scale[:, : length - 1]  # [B, L-1]: i = 1..L-1
    return torch.cat([torch.zeros_like(open_rows[:, None]), candidates & open_rows[:, None]], 1)


def gbv_resample_root(target, draft, tokens, num_drafts, along, result, u):
    """``result.next_token`` with the rows of tau = 0 resampled from norm(max(p - q^G, 0)) at the root, q^G's
    row 0 now computed in full (block verification's residual at p_0 = 1, same arithmetic, same uniform
    ``u [B]``; p where it has zero mass); ``[B]``."""
    zero = (result.num_accepted == 0).nonzero().squeeze(1)  # [n]
    if zero.numel() == 0:
        return result.next_token
    only_root = torch.zeros(zero.numel(), tokens.shape[1], dtype=torch.bool, device=zero.device)
    only_root[:, 0] = True
    selected = (target[zero], draft[zero], tokens[zero])
    along_zero = (along[0][zero], along[1][zero])
    root = gbv_draft_rows(*selected, num_drafts, only_root, along_zero)[:, 0]  # [n, V]
    target_root = target[zero, 0]
    weights = fallback((target_root - root).clamp_(min=0), target_root)
    return result.next_token.index_copy(0, zero, sample_from_weights(weights, u[zero]))


def gbv_draft_rows(target, draft, tokens, num_drafts, needed=None, along=None):
    """q^G rows ``[B, L, V]`` along X* (``target [B, L+1, V]``, ``draft [B, L, V]``, ``tokens [B, L]``).

    Rows where ``needed [B, L]`` is False (default: all True) keep the draft row, with q^G at the drafted token
    only (block verification never reads the rest of them, ``gbv_needed``); full rows cost one sort of the
    ranks p/q (stable: ties by token id). Every row holds ``gbv_along``'s q^G(x_d) at x_d, so the scales p_i
    are the same whichever rows are full. ``along``: ``gbv_along``'s output when already computed."""
    batch, length, _ = draft.shape
    needed = torch.ones(batch, length, dtype=torch.bool, device=tokens.device) if needed is None else needed
    below, drafted = gbv_along(target, draft, tokens, num_drafts) if along is None else along
    out = draft.clone()
    for d in range(length):
        index = needed[:, d].nonzero().squeeze(1)  # [n]
        if index.numel() > 0:
            q = wide(draft[index, d])
            order = rank_ratio(target[index, d], draft[index, d]).argsort(dim=-1, stable=True)  # ascending
            sorted_q = q.gather(1, order)
            exclusive = torch.cat([torch.zeros_like(sorted_q[:, :1]), sorted_q.cumsum(-1)[:, :-1]], 1)
            ranked_below = torch.empty_like(q).scatter_(1, order, exclusive)  # y(t) / Q_v
            out[index, d] = gbv_conditional(q, ranked_below, below[index, d, None], num_drafts).to(draft.dtype)
        out[:, d].scatter_(1, tokens[:, d : d + 1], drafted[:, d : d + 1].to(draft.dtype))
    return out


def power_sum(a, b, num_drafts):
    """S(a, b) = sum_{j<K} a^j b^(K-1-j) = (a^K - b^K) / (a - b) elementwise, by S_1 = 1,
    S_{n+1} = a S_n + b^n (no cancellation when a ~ b); exactly 1 when K = 1."""
    total, b_power = torch.ones_like(a), torch.ones_like(b)
    for _ in range(num_drafts - 1):
        b_power = b_power * b
        total = torch.addcmul(b_power, total, a)
    return total
