"""Batched speculative-decoding verifiers: token, block and greedy verification.

Notation (fixed here for the whole package; some write-ups swap the letters, the code never does):

* p = the target (large) model, passed as ``target_probs``; q = the draft (small) model, ``draft_probs``.
* gamma = the draft block length; x_1..x_gamma = the drafted tokens (``draft_tokens``), x_{i+1} ~ q(. | X^i)
  where X^i = prefix + x_1..x_i.
* alpha = E[sum_x min(p(x), q(x))], the expected per-token acceptance rate (Leviathan et al. 2023, arXiv 2211.17192).
* eta_1..eta_gamma = acceptance uniforms; one more uniform drives the sample of ``next_token``.

Shapes (every verifier):

* ``target_probs``  ``[B, gamma+1, V]``: row i is p(. | X^i), i = 0..gamma.
* ``draft_probs``   ``[B, gamma, V]``:   row i is q(. | X^i), the law x_{i+1} was drawn from.
* ``draft_tokens``  ``[B, gamma]`` int64.
* ``uniforms``      ``[B, gamma+1]`` in [0, 1): column i-1 is eta_i, column gamma the inverse-CDF uniform.
  Feeding the same uniforms to two verifiers couples them with common random numbers.
* Output: ``VerifyResult(num_accepted [B], next_token [B])``; row b emits
  ``draft_tokens[b, :num_accepted[b]]`` followed by ``next_token[b]``.

Token verification (Leviathan et al. 2023, arXiv 2211.17192, Algorithm 1): x_i is accepted iff
eta_i * q(x_i) < p(x_i) and q(x_i) > 0; n = number accepted before the first rejection; next_token ~
norm(max(p(.|X^n) - q(.|X^n), 0)) if n < gamma, else the bonus token ~ p(.|X^gamma).

Block verification (Sun et al., ICLR 2025, arXiv 2403.10444, Algorithm 2) in its BACKWARD form:
p_0 = 1, p_i = min(p_{i-1} p(x_i|X^{i-1}) / q(x_i|X^{i-1}), 1) (p_i = 0 when q(x_i) = 0);
w_i(x) = max(p_i p(x|X^i) - q(x|X^i), 0); h_i = sum w_i / (sum w_i + 1 - p_i) for i < gamma (0 when
sum w_i = 0) and h_gamma = p_gamma; tau = the LAST i in 1..gamma with eta_i < h_i (tau = 0 if none) --
not the first failure: a failed eta_1 followed by a passed eta_2 accepts both tokens.
next_token ~ p(.|X^gamma) if tau = gamma, else ~ norm(w_tau).
The two-symbol post writes the same rule FORWARD: walking i = 0..gamma it keeps a candidate block and replaces
it by X^i + (t ~ norm(w_i)) with probability sum w_i / (sum w_i + 1 - p_i) = h_i (weight 1 - p_i on
keeping the old one; at i = gamma, q is the zero row so w_gamma = p_gamma p and the replacement
probability is p_gamma). The final candidate is the one from the last replacement, i.e. the last i
whose coin came up "replace": with coin i driven by eta_i the two forms return the same block.
Two facts make our implementation cheap and are exact identities, not approximations:
sum w_i <= p_i, hence h_i <= p_i (we clamp h_i to p_i so float rounding cannot break it), so eta_i >= p_i
cannot pass; and tau = gamma whenever eta_gamma < p_gamma. The remaining candidates are visited from the
back (i = gamma-1 down to 1), each needing the O(V) residual mass sum w_i; the first pass is tau, so no
earlier index of that row is computed, and the pass's weights w_tau are reused to sample ``next_token``.
The only Python loop is over the gamma columns; none runs over B or V. B = 1 runs the scan on the gamma
scalars (one host copy), with torch for the O(V) row. B >= 2 visits one column i at a time
(i = gamma-1 .. 1), vectorised over that column's open rows: their p and q rows are gathered
(``index_select`` with ``out=``) into preallocated slots of one [2, B, V] work buffer, w_i and sum w_i are
computed for all of them at once, and the passing rows' w_i stay in the next free slots (compacted).
After the loop, the bonus rows (tau = gamma) and the tau = 0 rows fill the remaining slots, and one
inverse CDF samples every row; its cdf goes in the second half of the buffer. Small vocabularies
(V <= 4096) compute every h_i at once instead (fewer ops). All give the same tau and token
(tests/test_verify.py). p_i itself is computed
loop-free in log space, log p_i = S_i - max_{j<=i} S_j with
S_i = sum_{k<=i} log(p(x_k)/q(x_k)), S_0 = 0 (the Lindley recursion of log p_i = min(log p_{i-1} + l_i, 0)).

Greedy verification: accept while x_i equals argmax p(.|X^{i-1}) (first maximal index, as
``torch.argmax``); next_token = argmax p(.|X^n). Lossless only with respect to greedy decoding.

Numerics: everything is computed in the dtype of ``target_probs`` (float32 or float64) on its device.
Uniforms are cast to that dtype and clamped to the largest float below 1, so a rounding to 1.0 can
never reject a token with p(x) >= q(x). Tests compare float32 and float64 on instances away from the
acceptance boundaries; exactly at a boundary float32 may decide differently (e.g. p_i computed in log
space as 0.99999994 rather than 1). The inverse-CDF sampler never returns a zero-weight token. When a
residual has zero mass (p == q on that row) the sample falls back to p, never NaN.

Validation (``validate=True``, the default) raises ``ValueError`` naming the argument for: non-tensor or
wrong-rank inputs, disagreeing B / gamma / V, gamma < 1, dtype other than float32/float64 (or
target/draft dtypes differing), NaN/inf or negative probabilities, rows whose sum differs from 1 by
more than 1e-4 (float32) or 1e-8 (float64), non-integer or out-of-range ``draft_tokens``, ``uniforms``
of the wrong shape or outside [0, 1), and passing both ``generator`` and ``uniforms``. It costs two
passes over the probabilities (a sum and a min); a hot loop that builds its inputs itself may pass
``validate=False`` and skip it.
"""

from dataclasses import dataclass

import torch

from specresearch.core.draws import draw_uniforms, inverse_cdf

__all__ = [
    "VERIFIERS",
    "VerifyResult",
    "block_scales",
    "block_verify",
    "expected_num_accepted",
    "greedy_verify",
    "token_verify",
    "validate_inputs",
]

_SUM_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
# Up to this vocabulary size (elements per row) computing every h_i at once is cheaper than the backward
# scan, which issues a few dozen small kernels per column; above it the scan saves most rows
# (benchmarks/bench_verify.py, on a CPU). All paths return the same tau (tests/test_verify.py). Off the CPU the dense
# path runs at every size: the scan reads the host once per column (B > 1) or once per call (B = 1), each a GPU sync,
# and a GPU computes every h_i at once in a handful of kernels.
_DENSE_TAU_MAX_ELEMENTS = 1 << 12
# From this batch size on the backward scan is vectorised over rows; below it (B = 1) it runs in Python.
_BACKWARD_MIN_BATCH = 2


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of one verification step for a batch of B draft blocks."""

    num_accepted: torch.Tensor  # [B] int64 in 0..gamma
    next_token: torch.Tensor  # [B] int64: residual sample, or the bonus token when all gamma are accepted




def token_verify(target_probs, draft_probs, draft_tokens, generator=None, *, uniforms=None, validate=True):
    """Token verification (Leviathan et al. 2023, arXiv 2211.17192, Algorithm 1; the two-symbol post's ``token_verify``).

    Args:
        target_probs: ``[B, gamma+1, V]`` p(. | X^i), i = 0..gamma.
        draft_probs: ``[B, gamma, V]`` q(. | X^i), i = 0..gamma-1.
        draft_tokens: ``[B, gamma]`` int64, x_{i+1} drawn from draft_probs[:, i].
        generator: ``torch.Generator`` for the uniforms (default torch RNG if it and ``uniforms`` are None).
        uniforms: ``[B, gamma+1]`` pre-drawn uniforms in [0, 1) (see ``draw_uniforms``).
        validate: check the inputs (see the module docstring); False skips the checks.
    Returns:
        ``VerifyResult`` with ``num_accepted [B]`` and ``next_token [B]``.
    """
    eta = _prepare(target_probs, draft_probs, draft_tokens, generator, uniforms, validate)  # [B, gamma+1]
    p_x, q_x = _drafted_probs(target_probs, draft_probs, draft_tokens)  # [B, gamma] each
    accepted = (eta[:, :-1] * q_x < p_x) & (q_x > 0)  # strict: p(x) = 0 is never accepted, even at eta = 0
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # first rejection
    scale = torch.ones_like(p_x[:, 0])
    next_token = _sample_residual(target_probs, draft_probs, num_accepted, scale, eta[:, -1])
    return VerifyResult(num_accepted=num_accepted, next_token=next_token)


def block_verify(target_probs, draft_probs, draft_tokens, generator=None, *, uniforms=None, validate=True, scan=None):
    """Block verification (Sun et al., ICLR 2025, arXiv 2403.10444, Algorithm 2, backward form).

    tau = the last i with eta_i < h_i (see the module docstring for p_i, w_i, h_i and the equivalence
    with the forward form of the two-symbol post). Same arguments and return value as ``token_verify``; ``scan``:
    None picks the backward scan on the CPU above 4096 tokens (the fastest there), False computes every h_i at once
    (no host read: a captured step's form), True forces the scan. The same tau and token either way.
    """
    eta = _prepare(target_probs, draft_probs, draft_tokens, generator, uniforms, validate)  # [B, gamma+1]
    p_x, q_x = _drafted_probs(target_probs, draft_probs, draft_tokens)  # [B, gamma]
    scale = _block_scales(p_x, q_x)  # [B, gamma]: p_1..p_gamma
    if scan is None:
        scan = target_probs.shape[-1] > _DENSE_TAU_MAX_ELEMENTS and target_probs.device.type == "cpu"
    if not scan:
        tau = _block_tau_dense(target_probs, draft_probs, scale, eta[:, :-1])  # [B]
        next_token = _sample_residual(target_probs, draft_probs, tau, _scale_at(scale, tau), eta[:, -1])
    else:
        tau, next_token = _block_backward(target_probs, draft_probs, scale, eta[:, :-1], eta[:, -1])
    return VerifyResult(num_accepted=tau, next_token=next_token)


def greedy_verify(target_probs, draft_probs, draft_tokens, generator=None, *, uniforms=None, validate=True):
    """Greedy verification: accept while x_i == argmax p(. | X^{i-1}); next token = argmax p(. | X^n).

    Deterministic: ``generator`` and ``uniforms`` are accepted for a uniform signature and not used
    (``uniforms`` is still validated). Same shapes as ``token_verify``; ``draft_probs`` is only validated.
    """
    if validate:
        _validate(target_probs, draft_probs, draft_tokens, generator, uniforms)
    best = target_probs.argmax(-1)  # [B, gamma+1], first maximal index
    num_accepted = (draft_tokens == best[:, :-1]).long().cumprod(-1).sum(-1)  # [B]
    next_token = best.gather(1, num_accepted[:, None]).squeeze(1)
    return VerifyResult(num_accepted=num_accepted, next_token=next_token)


VERIFIERS = {"token": token_verify, "block": block_verify, "greedy": greedy_verify}


def expected_num_accepted(target_probs, draft_probs, draft_tokens, method, *, validate=True):
    """E[num_accepted | drafted block] of ``method``: the verifier's mean over its uniforms, in closed form.

    Given the block, the number of accepted drafts is random only through eta_1..eta_gamma:

    * token (Leviathan et al. 2023, Algorithm 1): P(n >= k) = prod_{i<=k} a_i with a_i = min(1, p(x_i) /
      q(x_i)) (0 when q(x_i) = 0), so E[n] = sum_{k=1}^{gamma} prod_{i<=k} a_i;
    * block (Sun et al. 2025, Algorithm 2; tau = the last i with eta_i < h_i): P(tau = i) = h_i prod_{j>i}
      (1 - h_j), so E[tau] = sum_{i=1}^{gamma} i h_i prod_{j>i} (1 - h_j), with the same h_i (and p_i)
      ``block_verify`` compares its uniforms with;
    * greedy: deterministic, the ``greedy_verify`` count.

    Both closed forms hold for any block, so evaluating them on the block one verifier drew gives the
    other verifier's expectation on that same block (a counterfactual that costs only the h_i).

    Args:
        target_probs, draft_probs, draft_tokens: as ``token_verify`` (``[B, gamma+1, V]``, ``[B, gamma, V]``,
            ``[B, gamma]``).
        method: ``"token"``, ``"block"`` or ``"greedy"``.
        validate: check the inputs as the verifiers do; False skips the checks.
    Returns:
        ``[B]`` expected accepted drafts (in 0..gamma), in the dtype of ``target_probs``.
    """
    if method not in VERIFIERS:
        raise ValueError(f"method must be one of {sorted(VERIFIERS)}, got {method!r}")
    if validate:
        _validate(target_probs, draft_probs, draft_tokens, None, None)
    if method == "greedy":
        return greedy_verify(target_probs, draft_probs, draft_tokens, validate=False).num_accepted.to(target_probs.dtype)
    p_x, q_x = _drafted_probs(target_probs, draft_probs, draft_tokens)  # [B, gamma]
    if method == "token":
        accept = torch.where(q_x > 0, (p_x / q_x).clamp(max=1), torch.zeros_like(p_x))  # [B, gamma]: a_i
        return accept.cumprod(-1).sum(-1)
    h = _block_h(target_probs, draft_probs, _block_scales(p_x, q_x))  # [B, gamma]
    survive = (1 - h).flip(-1).cumprod(-1).flip(-1)  # [B, gamma]: prod_{j >= i} (1 - h_j)
    later = torch.cat([survive[:, 1:], torch.ones_like(survive[:, :1])], 1)  # prod_{j > i} (1 - h_j)
    positions = torch.arange(1, h.shape[1] + 1, device=h.device, dtype=h.dtype)
    return (positions * h * later).sum(-1)


# ---------------------------------------------------------------------------------------------------
# Building blocks shared with the multi-draft verifiers (``verify_multi``): the same arithmetic, so that
# with one draft path they reproduce ``token_verify`` / ``block_verify`` bit for bit.


def validate_inputs(target_probs, draft_probs, draft_tokens):
    """Run the checks of ``validate=True`` (see the module docstring) on ``target_probs [B, gamma+1, V]``,
    ``draft_probs [B, gamma, V]`` and ``draft_tokens [B, gamma]``; raises ``ValueError`` naming the argument."""
    _validate(target_probs, draft_probs, draft_tokens, None, None)




def block_scales(p_x, q_x):
    """p_1..p_gamma of block verification (``[N, gamma]``) from the drafted tokens' p and q (``[N, gamma]``):
    p_i = min(p_{i-1} p(x_i)/q(x_i), 1), p_0 = 1, and 0 once a q(x_i) = 0 (module docstring, log-space form)."""
    return _block_scales(p_x, q_x)


# ---------------------------------------------------------------------------------------------------
# Shared stages


def _prepare(target_probs, draft_probs, draft_tokens, generator, uniforms, validate):
    """Validate (optionally) and return the uniforms ``[B, gamma+1]`` in the probabilities' dtype, < 1."""
    if validate:
        _validate(target_probs, draft_probs, draft_tokens, generator, uniforms)
    if uniforms is None:
        uniforms = draw_uniforms(*draft_tokens.shape, generator, device=target_probs.device)
    dtype = target_probs.dtype
    below_one = 1.0 - torch.finfo(dtype).eps / 2  # largest float < 1: a cast must not round eta up to 1
    return uniforms.to(device=target_probs.device, dtype=dtype).clamp(max=below_one)


def _drafted_probs(target_probs, draft_probs, draft_tokens):
    """p(x_i | X^{i-1}) and q(x_i | X^{i-1}) of the drafted tokens, both ``[B, gamma]``."""
    gamma = draft_tokens.shape[1]
    index = draft_tokens[..., None]  # [B, gamma, 1]
    p_x = target_probs[:, :gamma].gather(-1, index).squeeze(-1)
    q_x = draft_probs.gather(-1, index).squeeze(-1)
    return p_x, q_x


def _sample_residual(target_probs, draft_probs, index, scale, u):
    """Sample from norm(max(scale * p(.|X^index) - q(.|X^index), 0)) per row, or from p(.|X^gamma) where
    index == gamma; falls back to p(.|X^index) where the residual has zero mass. Returns ``[B]`` int64.

    index: ``[B]`` in 0..gamma; scale: ``[B]``; u: ``[B]`` uniforms in [0, 1).
    """
    gamma = draft_probs.shape[1]
    rows = torch.arange(index.shape[0], device=index.device)
    has_draft = index < gamma  # [B]; where False q is the zero row and the scale 1, so the weights are p
    target_row = _rows(target_probs, rows, index)  # [B, V]
    draft_row = _rows(draft_probs, rows, index.clamp(max=gamma - 1)).mul_(has_draft[:, None])
    scale = torch.where(has_draft, scale, torch.ones_like(scale))
    weights = _residual_weights(target_row, draft_row, scale, out=draft_row)  # reuses draft_row's memory
    no_mass = (weights.sum(-1, keepdim=True) == 0).to(weights.dtype)  # [B, 1]
    return inverse_cdf(weights.addcmul_(target_row, no_mass), u)


def _rows(probs, batch_index, row_index):
    """``probs[batch_index, row_index]`` for ``probs [B, n, V]``, as a fresh ``[K, V]`` tensor (a row copy)."""
    if not probs.is_contiguous():
        return probs[batch_index, row_index]
    flat = probs.view(-1, probs.shape[-1])  # index_select copies whole rows: far faster than advanced indexing
    return flat.index_select(0, batch_index * probs.shape[1] + row_index)


def _residual_weights(target_rows, draft_rows, scale, out=None):
    """w = max(scale * target_rows - draft_rows, 0) (``[..., V]``, scale ``[...]``), as -min(draft - scale *
    target, 0): one fused ``addcmul`` into ``out`` (e.g. ``draft_rows`` when it is a copy: no new buffer),
    then a clamp and a negation in place. Every h_i and every residual sample uses these same weights.
    """
    negative = torch.addcmul(draft_rows, target_rows, scale[..., None], value=-1, out=out)
    return negative.clamp_(max=0).neg_()




def _block_scales(p_x, q_x):
    """p_1..p_gamma of Sun et al. Algorithm 2 (``[B, gamma]``) without a loop over gamma.

    With l_k = log(p(x_k)/q(x_k)) (-inf where p(x_k) = 0 or q(x_k) = 0) and S_0 = 0, S_i = l_1 + .. + l_i,
    log p_i = S_i - max_{j <= i} S_j. S_0 = 0 keeps the running max finite, so no inf - inf.
    """
    log_ratio = torch.where(q_x > 0, p_x.log() - q_x.log(), float("-inf"))
    cumulative = torch.nn.functional.pad(log_ratio.cumsum(-1), (1, 0))  # [B, gamma+1], S_0 = 0
    return (cumulative - cumulative.cummax(-1).values).exp()[:, 1:]


def _scale_at(scale, tau):
    """p_tau per row (p_0 = 1) from ``scale [B, gamma]`` and ``tau [B]``; ``[B]``."""
    return torch.cat([torch.ones_like(scale[:, :1]), scale], 1).gather(1, tau[:, None]).squeeze(1)


def _block_tau(target_probs, draft_probs, scale, eta):
    """tau of the backward scan (``_block_backward``) without the sample; for tests and benchmarks."""
    return _block_backward(target_probs, draft_probs, scale, eta, torch.zeros_like(eta[:, 0]))[0]


def _block_backward(target_probs, draft_probs, scale, eta, u):
    """tau = last i in 1..gamma with eta_i < h_i (0 if none) and the next token, both ``[B]`` int64.

    ``eta < scale`` is exact at i = gamma (h_gamma = p_gamma) and necessary at i < gamma (h_i <= p_i). The
    other candidates are visited from the back, one column i at a time (the only Python loop: over gamma),
    and the first pass is tau. A column's open rows are processed together (``_visit_column``): their
    weights w_i fill the next free slots of one ``[B, V]`` buffer, whose slots [0, filled) hold w_tau of the
    rows already decided, so at the end it holds every row's sampling weights (in slot order) and one
    inverse CDF samples all rows. B = 1 runs the scan in Python instead (``_block_single``).
    """
    if scale.shape[0] < _BACKWARD_MIN_BATCH:
        return _block_single(target_probs, draft_probs, scale, eta, u)
    gamma = scale.shape[1]
    tau = torch.where(eta[:, -1] < scale[:, -1], gamma, 0)  # [B]
    candidates = (eta[:, :-1] < scale[:, :-1]) & (tau == 0)[:, None]  # [B, gamma-1], column k is i = k + 1
    weights, scratch = target_probs.new_empty(2, target_probs.shape[0], target_probs.shape[-1]).unbind(0)  # [B, V] each
    slot_rows, filled = torch.empty_like(tau), 0  # slot s of ``weights`` holds the weights of row slot_rows[s]
    for k in range(gamma - 2, -1, -1):
        rows = candidates[:, k].nonzero().squeeze(1)  # [K]: rows whose last open candidate is i = k + 1
        if rows.numel() > 0:
            column = (scale[:, k].index_select(0, rows), eta[:, k].index_select(0, rows), rows, k + 1)
            done = _visit_column(target_probs, draft_probs, *column, weights[filled:], scratch)  # [n]
            slot_rows[filled : filled + done.numel()] = done
            filled += done.numel()
            tau.index_fill_(0, done, k + 1)
            candidates.index_fill_(0, done, False)
    filled = _fill_final_rows(target_probs, draft_probs, tau, weights, scratch, slot_rows, filled)
    assert filled == tau.shape[0]
    tokens = inverse_cdf(weights, u[slot_rows], out=scratch)  # [B] in slot order
    return tau, torch.empty_like(tokens).index_copy_(0, slot_rows, tokens)


def _visit_column(target_probs, draft_probs, scale, eta, rows, i, free, scratch):
    """h_i for ``rows`` [K] (scale, eta: their p_i and eta_i, ``[K]``); returns the rows that pass, ``[n]``,
    with their w_i left in ``free[:n]`` (``free``: the unfilled slots, ``[>= K, V]``; ``scratch``: ``[>= K, V]``).
    """
    count = rows.numel()
    weights = _gathered_weights(target_probs, draft_probs, i, rows, scale, free[:count], scratch[:count])
    passed = eta < _residual_share(weights.sum(-1), scale)  # [K]
    kept = int(passed.sum())
    holes = (~passed[:kept]).nonzero().squeeze(1)  # failed slots among the first ``kept``
    movers = passed[kept:].nonzero().squeeze(1) + kept  # passed slots past them: same count
    if holes.numel() > 0:  # compact: passed rows' weights into free[:kept] (two row copies per mover)
        weights.index_copy_(0, holes, torch.index_select(weights, 0, movers, out=scratch[: holes.numel()]))
    order = torch.arange(count, device=rows.device).index_copy_(0, holes, movers)
    return rows[order[:kept]]


def _gathered_weights(target_probs, draft_probs, i, rows, scale, out, scratch):
    """w_i = max(scale * p(.|X^i) - q(.|X^i), 0) of ``rows`` [K] written into ``out`` [K, V] (the q rows are
    gathered there, the p rows into ``scratch`` [K, V]: preallocated, so no fresh buffer); returns ``out``.
    """
    torch.index_select(draft_probs[:, i], 0, rows, out=out)
    torch.index_select(target_probs[:, i], 0, rows, out=scratch)
    return _residual_weights(scratch, out, scale, out=out)


def _fill_final_rows(target_probs, draft_probs, tau, weights, scratch, slot_rows, filled):
    """Slots for the rows no pass decided, as ``_sample_residual`` computes them: p(.|X^gamma) where
    tau = gamma; max(p - q, 0) at X^0 where tau = 0 (p where it has no mass). Returns the filled count.
    """
    bonus = (tau == draft_probs.shape[1]).nonzero().squeeze(1)  # [n]: weights = p exactly
    torch.index_select(target_probs[:, -1], 0, bonus, out=weights[filled : filled + bonus.numel()])
    slot_rows[filled : filled + bonus.numel()], filled = bonus, filled + bonus.numel()
    first = (tau == 0).nonzero().squeeze(1)  # [m]
    count = first.numel()
    slots = weights[filled : filled + count]
    residual = _gathered_weights(target_probs, draft_probs, 0, first, weights.new_ones(count), slots, scratch[:count])
    empty = (residual.sum(-1) == 0).nonzero().squeeze(1)  # no residual mass: sample from p (0 + p, exact)
    residual.index_copy_(0, empty, scratch[empty])
    slot_rows[filled : filled + count] = first
    return filled + count


def _block_single(target_probs, draft_probs, scale, eta, u):
    """``_block_backward`` for B = 1: the scan over the gamma scalars in Python after one host copy (exact:
    float32 and float64 convert to Python floats without rounding), torch for the O(V) rows only.
    """
    gamma = scale.shape[1]
    weights = target_probs.new_empty(1, target_probs.shape[-1])  # [1, V]
    scales, etas = torch.stack([scale[0], eta[0]]).tolist()
    tau = gamma if etas[-1] < scales[-1] else 0
    backward = range(gamma - 1, 0, -1) if tau == 0 else ()  # tau = gamma: no earlier index matters
    for i in backward:
        if etas[i - 1] >= scales[i - 1]:  # h_i <= p_i: cannot pass
            continue
        mass = _row_weights(target_probs[:, i], draft_probs[:, i], scale[:, i - 1], 0, weights).sum()
        if bool(eta[0, i - 1] < _residual_share(mass, scale[0, i - 1])):
            tau = i
            break
    else:
        _final_row_weights(target_probs, draft_probs, 0, tau, weights)
    return torch.full((1,), tau, dtype=torch.int64, device=u.device), inverse_cdf(weights, u)


def _row_weights(target_rows, draft_rows, scale, row, weights):
    """w = max(scale[row] * target_rows[row] - draft_rows[row], 0) written into ``weights[row]``; returns
    that ``[V]`` row. ``target_rows``, ``draft_rows``: ``[B, V]`` (views of one i); ``scale``: ``[B]``.
    Used by the B = 1 scan (``_block_single``) only.
    """
    return _residual_weights(target_rows[row], draft_rows[row], scale[row], out=weights[row])


def _final_row_weights(target_probs, draft_probs, row, tau, weights):
    """``weights[row]`` for tau = gamma (p(.|X^gamma)) or tau = 0 (max(p - q, 0) at X^0, p where it has no
    mass); the B = 1 counterpart of ``_fill_final_rows``."""
    if tau == draft_probs.shape[1]:
        weights[row].copy_(target_probs[row, tau])
        return
    one = target_probs.new_ones(target_probs.shape[0])  # p_0 = 1
    if float(_row_weights(target_probs[:, 0], draft_probs[:, 0], one, row, weights).sum()) == 0:
        weights[row].copy_(target_probs[row, 0])


def _block_tau_dense(target_probs, draft_probs, scale, eta):
    """``_block_tau`` computing h_i for every (b, i): no pruning, no host sync; used for small inputs."""
    return _last_true(eta < _block_h(target_probs, draft_probs, scale))


def _block_h(target_probs, draft_probs, scale):
    """h_1..h_gamma of Sun et al. Algorithm 2 (``[B, gamma]``; h_gamma = p_gamma) from ``scale`` = p_1..p_gamma."""
    weights = _residual_weights(target_probs[:, 1:-1], draft_probs[:, 1:], scale[:, :-1])  # [B, gamma-1, V]
    return torch.cat([_residual_share(weights.sum(-1), scale[:, :-1]), scale[:, -1:]], 1)


def _residual_share(mass, scale):
    """h_i = m / (m + 1 - p_i) for residual mass m = sum_x w_i(x), clamped to p_i (exact bound); 0 where m = 0.

    m = 0 gives 0 / (1 - p_i) = 0, or 0 / 0 = nan when p_i = 1, which ``nan_to_num_`` turns into 0.
    """
    return (mass / (mass + 1 - scale)).nan_to_num_(0.0).minimum(scale)


def _last_true(mask):
    """1-based index of the last True along dim 1 of ``mask [B, gamma]``, 0 if none; ``[B]`` int64."""
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    if mask.shape[1] == 0:  # gamma = 1 leaves no candidate column; amax rejects an empty dimension
        return positions.new_zeros(mask.shape[0])
    return (mask * positions).amax(-1)


# ---------------------------------------------------------------------------------------------------
# Validation (vectorised: a few reductions, one host sync each)


def _validate(target_probs, draft_probs, draft_tokens, generator, uniforms):
    _check_tensors(target_probs=target_probs, draft_probs=draft_probs, draft_tokens=draft_tokens)
    _check_shapes(target_probs, draft_probs, draft_tokens)
    for name, probs in (("target_probs", target_probs), ("draft_probs", draft_probs)):
        _check_distribution(name, probs)
    if draft_probs.dtype != target_probs.dtype:
        raise ValueError(f"draft_probs is {draft_probs.dtype} but target_probs {target_probs.dtype}; cast both to one dtype")
    _check_tokens(draft_tokens, target_probs.shape[-1])
    if uniforms is not None:
        if generator is not None:
            raise ValueError("pass either generator or uniforms, not both (uniforms already fix the randomness)")
        _check_uniforms(uniforms, draft_tokens.shape)


def _check_tensors(**tensors):
    ranks = {"target_probs": 3, "draft_probs": 3, "draft_tokens": 2}
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
        if value.dim() != ranks[name]:
            raise ValueError(f"{name} must be {ranks[name]}-D; got shape {list(value.shape)}")
        if value.device != tensors["target_probs"].device:
            raise ValueError(f"{name} is on {value.device} but target_probs on {tensors['target_probs'].device}")


def _check_shapes(target_probs, draft_probs, draft_tokens):
    batch, gamma = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if batch < 1 or gamma < 1:
        raise ValueError(f"draft_tokens must be [B, gamma] with B >= 1 and gamma >= 1; got {list(draft_tokens.shape)}")
    if vocab < 1 or draft_probs.shape[-1] != vocab:
        raise ValueError(
            f"draft_probs has vocabulary size {draft_probs.shape[-1]} but target_probs has {vocab}; "
            "both must share one non-empty vocabulary (slice or pad the logits to the same V)"
        )
    if tuple(target_probs.shape) != (batch, gamma + 1, vocab):
        raise ValueError(
            f"target_probs must be [B, gamma+1, V] = {[batch, gamma + 1, vocab]} to match draft_tokens "
            f"{list(draft_tokens.shape)}; got {list(target_probs.shape)} (one row per draft token plus the bonus row)"
        )
    if tuple(draft_probs.shape) != (batch, gamma, vocab):
        raise ValueError(f"draft_probs must be [B, gamma, V] = {[batch, gamma, vocab]}; got {list(draft_probs.shape)}")


def _check_distribution(name, probs):
    if probs.dtype not in _SUM_TOLERANCE:
        raise ValueError(f"{name} must be float32 or float64; got {probs.dtype} (cast with .float() or .double())")
    sums = probs.sum(-1)
    if not bool(torch.isfinite(sums).all()):
        raise ValueError(f"{name} contains NaN or inf; check the logits / temperature that produced it")
    smallest = float(probs.min())
    if smallest < 0:
        raise ValueError(f"{name} has negative entries (min {smallest:.3g}); probabilities must be >= 0")
    tolerance = _SUM_TOLERANCE[probs.dtype]
    worst = float((sums - 1).abs().max())
    if worst > tolerance:
        raise ValueError(
            f"{name} rows must sum to 1 within {tolerance:g} for {probs.dtype}; the worst row is off by "
            f"{worst:.3g} (normalise it, e.g. softmax or divide by the row sum)"
        )


def _check_tokens(draft_tokens, vocab):
    if draft_tokens.dtype.is_floating_point or draft_tokens.dtype.is_complex or draft_tokens.dtype == torch.bool:
        raise ValueError(f"draft_tokens must be an integer tensor (int64); got {draft_tokens.dtype} (use .long())")
    low, high = int(draft_tokens.min()), int(draft_tokens.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"draft_tokens must be token ids in [0, V) = [0, {vocab}); got values in [{low}, {high}]")


def _check_uniforms(uniforms, token_shape):
    batch, gamma = token_shape
    if not isinstance(uniforms, torch.Tensor) or not uniforms.dtype.is_floating_point:
        raise ValueError("uniforms must be a floating torch.Tensor of shape [B, gamma+1] (see draw_uniforms)")
    if tuple(uniforms.shape) != (batch, gamma + 1):
        raise ValueError(f"uniforms must be [B, gamma+1] = {[batch, gamma + 1]}; got {list(uniforms.shape)}")
    inside = (uniforms >= 0) & (uniforms < 1)  # False for NaN too
    if not bool(inside.all()):
        raise ValueError(f"uniforms must lie in [0, 1); got values in [{float(uniforms.min())}, {float(uniforms.max())}]")
