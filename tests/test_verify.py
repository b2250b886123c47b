"""Deterministic tests of the batched verifiers in ``specresearch.core.verify``.

Hand-built instances whose answer is computed by hand, edge cases, input validation, and invariances
(batch rows, dtypes, generators, common random numbers). The statistical comparison with the exact
twin lives in ``tests/test_verify_vs_exact.py``.
"""

import itertools

import pytest
import torch

from specresearch.core import draws, verify
from specresearch.core.draws import draw_uniforms
from specresearch.core.verify import (
    VERIFIERS,
    VerifyResult,
    block_verify,
    greedy_verify,
    token_verify,
)

P_TWO = (1 / 3, 2 / 3)  # target of the two-symbol example (the two-symbol post); A = 0, B = 1
Q_TWO = (2 / 3, 1 / 3)  # draft
A, B = 0, 1


def _iid(target, draft, tokens, dtype=torch.float64):
    """Context-free instance: every row of p is ``target``, of q is ``draft``; ``tokens`` is [B, gamma]."""
    tokens = torch.as_tensor(tokens, dtype=torch.int64)
    batch, gamma = tokens.shape
    target_probs = torch.tensor(target, dtype=dtype).expand(batch, gamma + 1, -1).contiguous()
    draft_probs = torch.tensor(draft, dtype=dtype).expand(batch, gamma, -1).contiguous()
    return target_probs, draft_probs, tokens


def _uniforms(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def _random_instance(batch, gamma, vocab, seed, dtype=torch.float64, zero_fraction=0.3):
    """Context-dependent random rows with exact zeros; draft tokens drawn from the draft rows."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, 2 * gamma + 1, vocab, generator=generator, dtype=torch.float64)
    zeros = torch.rand(logits.shape, generator=generator, dtype=torch.float64) < zero_fraction
    zeros[..., 0] = False  # keep every row non-empty
    probs = logits.masked_fill(zeros, float("-inf")).softmax(-1)
    target_probs, draft_probs = probs[:, : gamma + 1], probs[:, gamma + 1 :]
    tokens = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=generator).view(batch, gamma)
    return target_probs.to(dtype).contiguous(), draft_probs.to(dtype).contiguous(), tokens


@pytest.fixture(params=["dense", "pruned"])
def tau_rule(request, monkeypatch):
    """Run a test through both of block verification's tau rules (chosen by input size in production)."""
    threshold = 1 << 62 if request.param == "dense" else -1
    monkeypatch.setattr(verify, "_DENSE_TAU_MAX_ELEMENTS", threshold)
    return request.param


# --------------------------------------------------------------------------------------------------
# Hand-computed two-symbol example (the two-symbol post): p = (1/3, 2/3), q = (2/3, 1/3), gamma = 2.


@pytest.mark.usefixtures("tau_rule")
def test_two_symbol_block_accepts_both_when_eta1_fails_but_eta2_passes():
    # Draft AB: p_1 = 1/2, h_1 = 0 (w_1 = max(p/2 - q, 0) = 0), p_2 = min(1/2 * 2, 1) = 1 = h_2.
    # eta_1 = 0.7 fails h_1 but eta_2 = 0.9 < h_2 = 1: tau is the LAST passing index, 2.
    # Token verification rejects A (0.7 * 2/3 >= 1/3) and resamples from norm(max(p - q, 0)) = B.
    instance = _iid(P_TWO, Q_TWO, [[A, B]])
    u = _uniforms([0.7, 0.9, 0.2])
    block = block_verify(*instance, uniforms=u)
    token = token_verify(*instance, uniforms=u)
    assert block.num_accepted.tolist() == [2]
    assert block.next_token.tolist() == [A]  # bonus ~ p = (1/3, 2/3) by inverse CDF: 0.2 < 1/3 -> A
    assert token.num_accepted.tolist() == [0]
    assert token.next_token.tolist() == [B]


@pytest.mark.parametrize(
    ("tokens", "etas", "block_expected", "token_expected"),
    [
        # BA: p_1 = 1, h_1 = 1; p_2 = 1/2 = h_2. eta_2 = 0.9 fails -> tau = 1, next ~ norm(w_1) = B.
        ([B, A], (0.3, 0.9), (1, B), (1, B)),
        # AA: p_1 = 1/2, h_1 = 0; p_2 = 1/4 = h_2. eta_2 = 0.2 < 1/4 -> tau = 2 (bonus: u = 0.5 -> B).
        ([A, A], (0.3, 0.2), (2, B), (2, B)),
        # AA with eta_2 = 0.3 >= 1/4: tau = 0, next ~ norm(max(p - q, 0)) = B; token accepts both.
        ([A, A], (0.3, 0.3), (0, B), (2, B)),
        # AA with eta_1 = 0 exactly: h_1 = 0 must still fail (strict <), so tau = 0; token accepts A only.
        ([A, A], (0.0, 0.9), (0, B), (1, B)),
        # AA with eta_1 = 0.6: token rejects A at once (0.6 * 2/3 >= 1/3); block still accepts both.
        ([A, A], (0.6, 0.1), (2, B), (0, B)),
    ],
)
@pytest.mark.usefixtures("tau_rule")
def test_two_symbol_hand_computed(tokens, etas, block_expected, token_expected):
    instance = _iid(P_TWO, Q_TWO, [tokens])
    u = _uniforms([*etas, 0.5])
    block = block_verify(*instance, uniforms=u)
    token = token_verify(*instance, uniforms=u)
    assert (block.num_accepted.item(), block.next_token.item()) == block_expected
    assert (token.num_accepted.item(), token.next_token.item()) == token_expected


@pytest.mark.usefixtures("tau_rule")
@pytest.mark.parametrize(("eta", "expected"), [(0.4, (1, B)), (0.6, (0, B))])
def test_gamma_one_block_equals_token(eta, expected):
    # gamma = 1, draft A: p_1 = h_1 = 1/2 and token accepts iff eta * 2/3 < 1/3: the two rules coincide.
    # Bonus ~ p with u = 0.5 -> B; residual max(p - q, 0) -> B.
    instance = _iid(P_TWO, Q_TWO, [[A]])
    u = _uniforms([eta, 0.5])
    for method in ("token", "block"):
        result = VERIFIERS[method](*instance, uniforms=u)
        assert (result.num_accepted.item(), result.next_token.item()) == expected


def _grid_expectation(method, points=12):
    """E[num_accepted] and P(first emitted token = B) for the two-symbol example, computed exactly.

    Every threshold involved (1/4, 1/3, 1/2, 1, 2) is a multiple of 1/12 or above 1, so averaging over the
    midpoint grid of [0, 1)^3 with 12 points per axis is an exact integral, and the four draft blocks are
    weighted by their draft probability.
    """
    grid = (torch.arange(points, dtype=torch.float64) + 0.5) / points
    u = torch.cartesian_prod(grid, grid, grid)  # [points^3, 3]
    mean_accepted, first_is_b = 0.0, 0.0
    for block in itertools.product((A, B), repeat=2):
        weight = Q_TWO[block[0]] * Q_TWO[block[1]]
        instance = _iid(P_TWO, Q_TWO, [list(block)] * u.shape[0])
        result = VERIFIERS[method](*instance, uniforms=u)
        first = torch.where(result.num_accepted > 0, instance[2][:, 0], result.next_token)
        mean_accepted += weight * result.num_accepted.double().mean().item()
        first_is_b += weight * (first == B).double().mean().item()
    return mean_accepted, first_is_b


@pytest.mark.usefixtures("tau_rule")
def test_two_symbol_expected_accepted_is_exact():
    # Token: alpha + alpha^2 = 2/3 + 4/9 = 10/9. Block (Sun et al.): 11/9. Both emit B first w.p. p(B) = 2/3.
    token_mean, token_first = _grid_expectation("token")
    block_mean, block_first = _grid_expectation("block")
    assert token_mean == pytest.approx(10 / 9, abs=1e-12)
    assert block_mean == pytest.approx(11 / 9, abs=1e-12)
    assert token_first == pytest.approx(2 / 3, abs=1e-12)
    assert block_first == pytest.approx(2 / 3, abs=1e-12)


# --------------------------------------------------------------------------------------------------
# Edge cases


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.usefixtures("tau_rule")
def test_zero_draft_probability_is_rejected_without_nan(method):
    # q(x_1) = 0 (the token could not have been drafted): reject even at eta = 0, never divide by zero
    # (p(x)/q(x) would be inf; the log-space p_i of block verification would be nan for p = q = 0).
    instance = _iid((0.5, 0.5, 0.0), (1.0, 0.0, 0.0), [[1, 0], [2, 0]])
    result = VERIFIERS[method](*instance, uniforms=_uniforms([0.0, 0.0, 0.3], [0.0, 0.0, 0.3]))
    assert result.num_accepted.tolist() == [0, 0]
    assert result.next_token.tolist() == [1, 1]  # norm(max(p - q, 0)) = token 1


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.usefixtures("tau_rule")
def test_zero_residual_mass_falls_back_to_target(method):
    # p == q and the drafted token has p = q = 0: rejected, max(p - q, 0) = 0, so sample p itself.
    instance = _iid((0.5, 0.5, 0.0), (0.5, 0.5, 0.0), [[2]])
    for u, expected in ((0.2, 0), (0.7, 1)):
        result = VERIFIERS[method](*instance, uniforms=_uniforms([0.1, u]))
        assert result.num_accepted.tolist() == [0]
        assert result.next_token.tolist() == [expected]


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.usefixtures("tau_rule")
def test_zero_residual_mass_falls_back_to_target_in_a_batch(method):
    # As above with B = 3 (the batched scan fills the tau = 0 rows together): rows 0 and 2 have p == q and
    # a rejected token, so they sample p; row 1 (q puts its mass on symbol 2) samples max(p - q, 0) = p.
    target = torch.tensor([[0.5, 0.5, 0.0]], dtype=torch.float64).expand(3, 2, 3).contiguous()
    draft = torch.tensor([[[0.5, 0.5, 0.0]], [[0.0, 0.0, 1.0]], [[0.5, 0.5, 0.0]]], dtype=torch.float64)
    tokens = torch.tensor([[2], [2], [2]])
    result = VERIFIERS[method](target, draft, tokens, uniforms=_uniforms([0.1, 0.7], [0.1, 0.2], [0.1, 0.3]))
    assert result.num_accepted.tolist() == [0, 0, 0]
    assert result.next_token.tolist() == [1, 0, 0]


def test_residual_share_zero_mass_with_unit_scale_is_zero_not_nan():
    # h_i = m / (m + 1 - p_i) is 0/0 when p == q (m = 0) and p_i = 1; the contract says h_i = 0.
    share = verify._residual_share(torch.tensor([0.0, 0.5]), torch.tensor([1.0, 1.0]))
    assert share.tolist() == [0.0, 1.0]


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.usefixtures("tau_rule")
def test_zero_target_probability_never_accepted_even_with_zero_uniform(method):
    # p(x_2) = 0; uniforms of exactly 0.0 must not accept it (strict comparisons).
    target = (0.0, 0.5, 0.5)
    draft = (0.5, 0.5, 0.0)
    instance = _iid(target, draft, [[1, 0], [0, 1]])
    result = VERIFIERS[method](*instance, uniforms=torch.zeros(2, 3, dtype=torch.float64))
    assert result.num_accepted.tolist() == [1, 0]
    assert result.next_token.tolist() == [2, 2]  # max(p - q, 0) = (0, 0, 1/2); u = 0 still skips zero weights


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.usefixtures("tau_rule")
def test_one_hot_rows(method, dtype):
    agree = _iid((0, 0, 0, 1.0), (0, 0, 0, 1.0), [[3, 3, 3]], dtype)
    disagree = _iid((0, 0, 1.0, 0), (0, 0, 0, 1.0), [[3, 3, 3]], dtype)
    u = _uniforms([0.999999999, 0.999999999, 0.999999999, 0.999999999])  # rounds to 1.0 in float32
    assert VERIFIERS[method](*agree, uniforms=u).num_accepted.tolist() == [3]
    assert VERIFIERS[method](*agree, uniforms=u).next_token.tolist() == [3]
    assert VERIFIERS[method](*disagree, uniforms=u).num_accepted.tolist() == [0]
    assert VERIFIERS[method](*disagree, uniforms=u).next_token.tolist() == [2]


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.usefixtures("tau_rule")
def test_bonus_token_only_when_all_accepted(method):
    # Token 4 has mass only in the bonus row p(.|X^gamma): it can be emitted iff all gamma are accepted.
    gamma, vocab, batch = 3, 5, 400
    generator = torch.Generator().manual_seed(0)
    inner = torch.rand(batch, gamma, vocab - 1, generator=generator, dtype=torch.float64)
    target_probs = torch.zeros(batch, gamma + 1, vocab, dtype=torch.float64)
    target_probs[:, :gamma, :-1] = inner / inner.sum(-1, keepdim=True)
    target_probs[:, gamma, -1] = 1.0
    draft = torch.rand(batch, gamma, vocab - 1, generator=generator, dtype=torch.float64)
    draft_probs = torch.nn.functional.pad(draft / draft.sum(-1, keepdim=True), (0, 1))
    tokens = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=generator).view(batch, gamma)
    result = VERIFIERS[method](target_probs, draft_probs, tokens, generator)
    all_accepted = result.num_accepted == gamma
    assert 0 < int(all_accepted.sum()) < batch  # both branches exercised
    assert torch.equal(result.next_token == vocab - 1, all_accepted)


def test_inverse_cdf_never_picks_zero_weight():
    weights = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0, 0.0]] * 6, dtype=torch.float32)
    below_one = 1 - torch.finfo(torch.float32).eps / 2
    u = torch.tensor([0.0, 0.25, 0.2499999, 0.5, below_one, 1.0], dtype=torch.float32)  # 1.0: rounding past the end
    picked = draws.inverse_cdf(weights, u)
    assert picked.tolist() == [1, 3, 1, 3, 3, 3]


def test_block_scales_log_space_matches_forward_recursion():
    # p_i = min(p_{i-1} p(x_i) / q(x_i), 1), with zeros in p(x) and q(x), against the plain loop.
    p_x = torch.tensor([[0.2, 0.9, 0.1, 0.5], [0.0, 0.5, 0.5, 0.5], [0.3, 0.3, 0.2, 0.9]], dtype=torch.float64)
    q_x = torch.tensor([[0.4, 0.3, 0.1, 0.6], [0.5, 0.5, 0.5, 0.5], [0.3, 0.0, 0.1, 0.3]], dtype=torch.float64)
    expected = torch.zeros_like(p_x)
    for b in range(p_x.shape[0]):
        scale = 1.0
        for i in range(p_x.shape[1]):
            scale = min(scale * p_x[b, i].item() / q_x[b, i].item(), 1.0) if q_x[b, i] > 0 else 0.0
            expected[b, i] = scale
    assert torch.allclose(verify._block_scales(p_x, q_x), expected, rtol=1e-12, atol=0)
    assert expected[0].tolist() == pytest.approx([0.5, 1.0, 1.0, 5 / 6])


@pytest.mark.parametrize("seed", range(5))
def test_pruned_block_tau_equals_dense_reference(seed):
    target_probs, draft_probs, tokens = _random_instance(64, 6, 12, seed, zero_fraction=0.2)
    eta = draw_uniforms(64, 6, torch.Generator().manual_seed(seed))[:, :-1]
    p_x, q_x = verify._drafted_probs(target_probs, draft_probs, tokens)
    scale = verify._block_scales(p_x, q_x)
    pruned = verify._block_tau(target_probs, draft_probs, scale, eta)
    assert torch.equal(pruned, verify._block_tau_dense(target_probs, draft_probs, scale, eta))
    assert len(set(pruned.tolist())) > 2  # the instance exercises several outcomes


@pytest.mark.parametrize("batch", [1, 3, verify._BACKWARD_MIN_BATCH])
def test_pruned_block_tau_equals_dense_on_both_sides_of_the_backward_round(batch):
    # Below _BACKWARD_MIN_BATCH (B = 1) the backward scan runs in Python on scalars; from it on it is
    # vectorised per column. 200 seeds of uniforms cover passes and failures at several columns.
    target_probs, draft_probs, tokens = _random_instance(batch, 5, 12, seed=11, zero_fraction=0.2)
    p_x, q_x = verify._drafted_probs(target_probs, draft_probs, tokens)
    scale = verify._block_scales(p_x, q_x)
    outcomes = set()
    for seed in range(200):
        eta = draw_uniforms(batch, 5, torch.Generator().manual_seed(seed))[:, :-1]
        pruned = verify._block_tau(target_probs, draft_probs, scale, eta)
        assert torch.equal(pruned, verify._block_tau_dense(target_probs, draft_probs, scale, eta))
        outcomes.update(pruned.tolist())
    assert len(outcomes) > 2


@pytest.mark.parametrize("batch", [1, 5])
def test_backward_scan_output_equals_dense_rule_with_its_sample(batch, monkeypatch):
    # The backward scan (Python at B = 1, per column at B >= 2) reuses w_tau for the sample; the dense rule
    # computes every h_i, then samples from a fresh residual row. Same uniforms: same tau AND same token.
    target_probs, draft_probs, tokens = _random_instance(batch, 5, 12, seed=8, zero_fraction=0.2)  # seed 8: all taus
    outcomes = set()
    for seed in range(150):
        u = draw_uniforms(batch, 5, torch.Generator().manual_seed(seed))
        monkeypatch.setattr(verify, "_DENSE_TAU_MAX_ELEMENTS", 1 << 62)
        dense = block_verify(target_probs, draft_probs, tokens, uniforms=u)
        monkeypatch.setattr(verify, "_DENSE_TAU_MAX_ELEMENTS", -1)
        scan = block_verify(target_probs, draft_probs, tokens, uniforms=u)
        assert torch.equal(scan.num_accepted, dense.num_accepted)
        assert torch.equal(scan.next_token, dense.next_token)
        outcomes.update(scan.num_accepted.tolist())
    assert outcomes == set(range(6))  # tau = 0 (row-0 residual), 1..4 (reused w_tau) and 5 (bonus row)


# --------------------------------------------------------------------------------------------------
# Greedy verification


def test_greedy_hand_computed():
    target_probs = torch.tensor(
        [[[0.1, 0.6, 0.3], [0.4, 0.4, 0.2], [0.2, 0.2, 0.6]], [[0.1, 0.6, 0.3], [0.1, 0.2, 0.7], [0.5, 0.2, 0.3]]],
        dtype=torch.float64,
    )
    draft_probs = torch.full((2, 2, 3), 1 / 3, dtype=torch.float64)
    tokens = torch.tensor([[1, 0], [1, 1]])  # row 0: both argmaxes (tie 0.4/0.4 -> first index 0); row 1: second fails
    result = greedy_verify(target_probs, draft_probs, tokens)
    assert result.num_accepted.tolist() == [2, 1]
    assert result.next_token.tolist() == [2, 2]


# --------------------------------------------------------------------------------------------------
# Invariances: dtypes, batch rows, generators, common random numbers, output shapes


@pytest.mark.parametrize("method", ["token", "block", "greedy"])
@pytest.mark.usefixtures("tau_rule")
def test_float32_and_float64_agree_with_same_uniforms(method):
    # Uniforms are drawn at random, so a tie within float32 rounding of a threshold has probability ~1e-4;
    # the seed is fixed, so this test is deterministic.
    target_probs, draft_probs, tokens = _random_instance(128, 4, 20, seed=1)
    u = draw_uniforms(128, 4, torch.Generator().manual_seed(2))
    double = VERIFIERS[method](target_probs, draft_probs, tokens, uniforms=u)
    single = VERIFIERS[method](target_probs.float(), draft_probs.float(), tokens, uniforms=u)
    assert torch.equal(double.num_accepted, single.num_accepted)
    assert torch.equal(double.next_token, single.next_token)


@pytest.mark.parametrize("method", ["token", "block", "greedy"])
@pytest.mark.usefixtures("tau_rule")
def test_batch_rows_are_independent(method):
    target_probs, draft_probs, tokens = _random_instance(16, 5, 9, seed=3)
    u = draw_uniforms(16, 5, torch.Generator().manual_seed(4))
    batched = VERIFIERS[method](target_probs, draft_probs, tokens, uniforms=u)
    for b in range(16):
        alone = VERIFIERS[method](target_probs[b : b + 1], draft_probs[b : b + 1], tokens[b : b + 1], uniforms=u[b : b + 1])
        assert alone.num_accepted.item() == batched.num_accepted[b].item()
        assert alone.next_token.item() == batched.next_token[b].item()


@pytest.mark.parametrize("method", ["token", "block"])
def test_generator_reproducible_and_equal_to_drawn_uniforms(method):
    instance = _random_instance(32, 4, 10, seed=5)
    first = VERIFIERS[method](*instance, torch.Generator().manual_seed(7))
    second = VERIFIERS[method](*instance, torch.Generator().manual_seed(7))
    explicit = VERIFIERS[method](*instance, uniforms=draw_uniforms(32, 4, torch.Generator().manual_seed(7)))
    for other in (second, explicit):
        assert torch.equal(first.num_accepted, other.num_accepted)
        assert torch.equal(first.next_token, other.next_token)


@pytest.mark.usefixtures("tau_rule")
def test_common_random_numbers_on_equal_models_accept_everything():
    target_probs, _, _ = _random_instance(64, 4, 10, seed=6)
    draft_probs = target_probs[:, :4].contiguous()
    tokens = torch.multinomial(draft_probs.view(-1, 10), 1, generator=torch.Generator().manual_seed(8)).view(64, 4)
    u = draw_uniforms(64, 4, torch.Generator().manual_seed(9))
    token = token_verify(target_probs, draft_probs, tokens, uniforms=u)
    block = block_verify(target_probs, draft_probs, tokens, uniforms=u)
    assert token.num_accepted.tolist() == [4] * 64
    assert block.num_accepted.tolist() == [4] * 64
    assert torch.equal(token.next_token, block.next_token)  # same bonus row, same uniform


@pytest.mark.parametrize("method", ["token", "block", "greedy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_output_shapes_and_dtypes(method, dtype):
    target_probs, draft_probs, tokens = _random_instance(3, 2, 7, seed=0, dtype=dtype)
    result = VERIFIERS[method](target_probs, draft_probs, tokens, torch.Generator().manual_seed(0))
    assert isinstance(result, VerifyResult)
    for field in (result.num_accepted, result.next_token):
        assert field.shape == (3,) and field.dtype == torch.int64 and field.device == target_probs.device
    assert bool(((result.num_accepted >= 0) & (result.num_accepted <= 2)).all())
    assert bool(((result.next_token >= 0) & (result.next_token < 7)).all())


def test_verifiers_registry():
    assert VERIFIERS == {"token": token_verify, "block": block_verify, "greedy": greedy_verify}


def test_draw_uniforms():
    u = draw_uniforms(4, 3, torch.Generator().manual_seed(0))
    assert u.shape == (4, 4) and u.dtype == torch.float64
    assert bool(((u >= 0) & (u < 1)).all())
    with pytest.raises(ValueError, match="gamma"):
        draw_uniforms(4, 0)
    with pytest.raises(ValueError, match="batch"):
        draw_uniforms(0, 2)


# --------------------------------------------------------------------------------------------------
# Validation


def _valid(dtype=torch.float64):
    return _random_instance(2, 3, 5, seed=0, dtype=dtype)


def _bad_cases():
    target, draft, tokens = _valid()
    nan_target = target.clone()
    nan_target[0, 0, 0] = float("nan")
    negative = draft.clone()
    negative[1, 0, :2] += torch.tensor([-0.5, 0.5], dtype=torch.float64)
    unnormalised = target * 1.001
    off_float32 = target.float().clone()
    off_float32[0, 1] *= 1.001
    return {
        "target rank": ((target[0], draft, tokens), {}, "target_probs"),
        "target rows": ((target[:, :3], draft, tokens), {}, "target_probs"),
        "draft rows": ((target, draft[:, :2], tokens), {}, "draft_probs"),
        "batch": ((target, draft, tokens[:1]), {}, "target_probs"),
        "vocab": ((target, torch.nn.functional.pad(draft, (0, 1)), tokens), {}, "draft_probs"),
        "gamma zero": ((target[:, :1], draft[:, :0], tokens[:, :0]), {}, "draft_tokens"),
        "nan": ((nan_target, draft, tokens), {}, "target_probs.*NaN"),
        "negative": ((target, negative, tokens), {}, "draft_probs.*negative"),
        "sum float64": ((unnormalised, draft, tokens), {}, "target_probs.*sum to 1 within 1e-08"),
        "sum float32": ((off_float32, draft.float(), tokens), {}, "target_probs.*sum to 1 within 0.0001"),
        "half": ((target.half(), draft.half(), tokens), {}, "target_probs.*float32 or float64"),
        "mixed dtypes": ((target, draft.float(), tokens), {}, "draft_probs.*float32"),
        "tokens float": ((target, draft, tokens.double()), {}, "draft_tokens.*integer"),
        "tokens range": ((target, draft, tokens + 5), {}, "draft_tokens.*\\[0, 5\\)"),
        "tokens negative": ((target, draft, tokens - 5), {}, "draft_tokens"),
        "uniforms shape": ((target, draft, tokens), {"uniforms": torch.rand(2, 3, dtype=torch.float64)}, "uniforms"),
        "uniforms one": ((target, draft, tokens), {"uniforms": torch.ones(2, 4, dtype=torch.float64)}, "uniforms"),
        "uniforms negative": ((target, draft, tokens), {"uniforms": -torch.rand(2, 4, dtype=torch.float64)}, "uniforms"),
        "both": ((target, draft, tokens, torch.Generator()), {"uniforms": torch.rand(2, 4, dtype=torch.float64)}, "generator"),
        "not a tensor": ((target.tolist(), draft, tokens), {}, "target_probs"),
    }


@pytest.mark.parametrize("method", ["token", "block", "greedy"])
@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_validation_errors_name_the_argument(method, case):
    args, kwargs, pattern = _bad_cases()[case]
    with pytest.raises(ValueError, match=pattern):
        VERIFIERS[method](*args, **kwargs)


def test_float32_rows_within_tolerance_are_accepted_and_validate_false_skips_checks():
    target, draft, tokens = _valid(torch.float32)
    target[0, 0] *= 1 + 5e-5  # inside the float32 tolerance of 1e-4
    token_verify(target, draft, tokens, torch.Generator().manual_seed(0))
    unnormalised = target * 1.01
    with pytest.raises(ValueError, match="target_probs"):
        token_verify(unnormalised, draft, tokens)
    result = token_verify(unnormalised, draft, tokens, torch.Generator().manual_seed(0), validate=False)
    assert result.num_accepted.shape == (2,)
