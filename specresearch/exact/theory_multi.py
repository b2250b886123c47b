"""Single-step multi-draft acceptance at full vocabulary, in float64 (numpy).

Notation as in :mod:`specresearch.exact.multi`: p = target row, q = draft row (1-D arrays over the
vocabulary, V = 49152 for SmolLM2), K = number of drafts, one step (L = 1). Acceptance = P(the step
accepts a draft token) = E[accepted tokens] at L = 1. Each function is the float form of an exact
quantity of :mod:`specresearch.exact.multi` / :mod:`specresearch.exact.lp` and is tested against it on
small vocabularies (tests/test_exact_multi.py). Costs:

* :func:`rrs_acceptance` (SpecInfer RRS, i.i.d. drafts): closed form, O(K V).
* :func:`kseq_acceptance` (SpecTr K-SEQ, i.i.d.): rho* by bisection on the strictly decreasing
  g(rho) = sum_{j<K} (1 - beta(rho))^j - rho, O(V) per step, then 1 - (1 - beta(rho*))^K.
* :func:`gbv_acceptance` (GBV, i.i.d., L = 1): token verification against the law of the top-ranked
  draft, O(V log V).
* :func:`optimal_acceptance_iid` (the optimum for i.i.d. drafts): O(V log V), see its docstring.
* :func:`rrs_without_replacement_acceptance_mc` (RRS without replacement = traversal verification at
  L = 1, drafts without replacement): no closed form is known to us; an unbiased Monte Carlo estimate
  that simulates only the rejection path.
"""

from __future__ import annotations

import numpy as np

from specresearch.checks import check_int

__all__ = [
    "rrs_acceptance",
    "kseq_rho_float",
    "kseq_acceptance",
    "gbv_acceptance",
    "optimal_acceptance_iid",
    "rrs_without_replacement_acceptance_mc",
    "single_step_acceptances",
]


def _rows(target_probs, draft_probs) -> tuple[np.ndarray, np.ndarray]:
    """Validate two probability rows of equal length V (float64 copies)."""
    p = np.asarray(target_probs, dtype=np.float64)
    q = np.asarray(draft_probs, dtype=np.float64)
    for name, row in (("target_probs", p), ("draft_probs", q)):
        if row.ndim != 1 or row.size == 0:
            raise ValueError(f"{name} must be a non-empty 1-D array [V], got shape {row.shape}")
        if not np.all(np.isfinite(row)) or np.any(row < 0) or abs(row.sum() - 1) > 1e-6:
            raise ValueError(f"{name} must be finite, non-negative and sum to 1 (sum {row.sum():.6g})")
    if p.shape != q.shape:
        raise ValueError(f"target_probs and draft_probs must have the same vocabulary, got {p.shape} and {q.shape}")
    return p / p.sum(), q / q.sum()


def _check_k(num_drafts) -> int:
    check_int("num_drafts", num_drafts)
    return int(num_drafts)


def rrs_acceptance(target_probs, draft_probs, num_drafts) -> float:
    """SpecInfer RRS with K i.i.d. drafts: 1 - prod_i (1 - sum_x min(p_i(x), q(x))).

    Round i accepts w.p. sum_x q(x) min(1, p_i(x)/q(x)) whatever was rejected before (the draft is a
    fresh i.i.d. draw) and p_{i+1} = norm(max(p_i - q, 0)) does not depend on the rejected token.
    Args: ``target_probs``, ``draft_probs``: [V]. Returns: a float in [0, 1].
    """
    p, q = _rows(target_probs, draft_probs)
    reject = 1.0
    for _ in range(_check_k(num_drafts)):
        reject *= 1.0 - np.minimum(p, q).sum()
        residual = np.maximum(p - q, 0.0)
        if residual.sum() <= 0:
            break
        p = residual / residual.sum()
    return float(1.0 - reject)


def _beta(p: np.ndarray, q: np.ndarray, rho: float) -> float:
    return float(np.minimum(q, p / rho).sum())


def kseq_rho_float(target_probs, draft_probs, num_drafts, *, tol: float = 1e-13) -> float:
    """SpecTr's rho* in [1, K] by bisection (the float form of :func:`specresearch.exact.multi.kseq_rho`)."""
    p, q = _rows(target_probs, draft_probs)
    k = _check_k(num_drafts)
    lo, hi = 1.0, float(k)
    while hi - lo > tol:
        mid = (lo + hi) / 2
        beta = _beta(p, q, mid)
        if sum((1 - beta) ** j for j in range(k)) - mid > 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def kseq_acceptance(target_probs, draft_probs, num_drafts) -> float:
    """SpecTr K-SEQ with K i.i.d. drafts: 1 - (1 - beta(rho*))^K."""
    p, q = _rows(target_probs, draft_probs)
    k = _check_k(num_drafts)
    return 1.0 - (1.0 - _beta(p, q, kseq_rho_float(p, q, k))) ** k


def _ratio_order(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Tokens by p/q ascending, ties by token id, q = 0 last (the order of exact_multi's GBV)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(q > 0, p / np.where(q > 0, q, 1.0), np.inf)
    return np.lexsort((np.arange(p.size), ratio))


def gbv_acceptance(target_probs, draft_probs, num_drafts) -> float:
    """GBV (Thomas and Pal 2026) at L = 1 with K i.i.d. drafts: sum_x min(p(x), q^G(x)).

    q^G(x) = F(x)^K - F(x^-)^K is the law of the top-ranked of K i.i.d. drafts in the p/q order
    (F = cumulative q in that order); block verification of one token is token verification.
    """
    p, q = _rows(target_probs, draft_probs)
    order = _ratio_order(p, q)
    cdf = np.cumsum(q[order])
    below = np.concatenate([[0.0], cdf[:-1]])
    q_top = cdf ** _check_k(num_drafts) - below ** _check_k(num_drafts)
    return float(np.minimum(p[order], q_top).sum())


def optimal_acceptance_iid(target_probs, draft_probs, num_drafts) -> float:
    """The best single-step acceptance with K i.i.d. drafts: min_H p(H) + 1 - q(H)^K, in O(V log V).

    The minimising H is a prefix of the tokens sorted by p/q ascending. Proof: if H is optimal,
    removing t in H cannot help, so p(t) <= q(H)^K - (q(H) - q(t))^K <= K q(H)^(K-1) q(t), and adding
    t outside H cannot help, so p(t) >= (q(H) + q(t))^K - q(H)^K >= K q(H)^(K-1) q(t), by convexity
    of s^K. Hence every ratio in H is <= c = K q(H)^(K-1) <= every ratio outside; for K >= 2 the first
    inequality is strict when q(t) > 0, so no token of ratio exactly c is in H and H is a prefix of the
    sorted order whatever the tie-break. (Tokens with q = 0 sort last; adding them never helps.)
    Checked against the exact minimum over all 2^V sets in tests/test_lp_multi.py.
    """
    p, q = _rows(target_probs, draft_probs)
    order = _ratio_order(p, q)
    p_cum = np.concatenate([[0.0], np.cumsum(p[order])])
    q_cum = np.concatenate([[0.0], np.cumsum(q[order])])
    return float(np.min(p_cum + 1.0 - np.minimum(q_cum, 1.0) ** _check_k(num_drafts)))


def rrs_without_replacement_acceptance_mc(target_probs, draft_probs, num_drafts, num_samples: int = 256,
                                         rng: np.random.Generator | None = None) -> tuple[float, float]:
    """Monte Carlo estimate of RRS without replacement (drafts without replacement), L = 1.

    P(all K rejected) = E[prod_i r_i], r_i = 1 - sum_x min(p_i(x), q_i(x)), where the expectation is
    over the rejected drafts only: given a rejection in round i, X_i ~ norm(max(q_i - p_i, 0)); then
    p_{i+1} = norm(max(p_i - q_i, 0)) and q_{i+1} = q_i with X_i removed, renormalised. Each sample
    costs O(K V). Traversal verification at L = 1 is the same rule (exact_multi).

    Args:
        target_probs, draft_probs: [V].
        num_samples: independent rejection paths.
        rng: ``numpy.random.Generator`` (default: seed 0).
    Returns:
        (estimate, standard error) of the acceptance.
    """
    p0, q0 = _rows(target_probs, draft_probs)
    k, rng = _check_k(num_drafts), rng if rng is not None else np.random.default_rng(0)
    check_int("num_samples", num_samples, minimum=2)
    products = np.empty(num_samples)
    for s in range(num_samples):
        p, q, prod = p0, q0.copy(), 1.0
        for _ in range(k):
            reject = 1.0 - np.minimum(p, q).sum()
            prod *= max(reject, 0.0)
            over = np.maximum(q - p, 0.0)
            if prod <= 0 or over.sum() <= 0:
                break
            x = rng.choice(p.size, p=over / over.sum())
            residual = np.maximum(p - q, 0.0)
            p = residual / residual.sum() if residual.sum() > 0 else p
            q[x] = 0.0
            if q.sum() <= 0:
                break
            q = q / q.sum()
        products[s] = prod
    return 1.0 - float(products.mean()), float(products.std(ddof=1) / np.sqrt(num_samples))


def single_step_acceptances(target_probs, draft_probs, num_drafts, *, num_samples: int = 256,
                            rng: np.random.Generator | None = None) -> dict[str, float]:
    """Every single-step acceptance above for one (p, q) pair and K, as one record.

    Keys: ``rrs``, ``kseq``, ``gbv``, ``optimum_iid`` (exact closed forms in float64, i.i.d. drafts),
    ``rrs_without_replacement_mc`` and ``rrs_without_replacement_mc_stderr`` (Monte Carlo, drafts
    without replacement; traversal verification has the same acceptance at L = 1).
    """
    estimate, stderr = rrs_without_replacement_acceptance_mc(target_probs, draft_probs, num_drafts, num_samples, rng)
    return {
        "rrs": rrs_acceptance(target_probs, draft_probs, num_drafts),
        "kseq": kseq_acceptance(target_probs, draft_probs, num_drafts),
        "gbv": gbv_acceptance(target_probs, draft_probs, num_drafts),
        "optimum_iid": optimal_acceptance_iid(target_probs, draft_probs, num_drafts),
        "rrs_without_replacement_mc": estimate,
        "rrs_without_replacement_mc_stderr": stderr,
    }
