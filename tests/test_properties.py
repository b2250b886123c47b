"""Property tests of the three verifiers on adversarial probability tables (hypothesis, derandomized).

Inputs: random p and q rows mixing dense rows, exact zeros, one-hot rows, near-duplicates of the other
model's row (q = p up to ~1e-7 relative), rows with tiny mass (~1e-30 entries), in float32 and float64;
drafts mostly sampled from q (sometimes any token, even one with q = 0); uniforms including exact 0
and values just below 1. Properties, for token / block / greedy verification:

* outputs are int64 of shape [B], ``num_accepted`` in 0..gamma, ``next_token`` in [0, V);
* no accepted draft has target probability 0 (w.r.t. the target row it was checked against);
* ``next_token`` has positive target probability in the row it is sampled from (row ``num_accepted``);
* token verification: the correction token has positive residual max(p - q, 0) when the residual has
  mass, so it is never the rejected draft (unless that draft had q = 0, i.e. q could not have drawn it);
* the bonus token (from the last row) appears only when all gamma drafts are accepted;
* when p == q, token and block verification accept everything and agree token for token.

``@settings(derandomize=True)``: every run draws the same examples. Case counts (for the README): run
``pytest tests/test_properties.py --hypothesis-show-statistics``.
"""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specresearch.core.verify import VERIFIERS, block_verify, token_verify

EXAMPLES = 200
SETTINGS = settings(derandomize=True, max_examples=EXAMPLES, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
KINDS = ("dense", "zeros", "one_hot", "tiny", "near_duplicate")


def _row(rng: np.random.Generator, vocab: int, kind: str, other: np.ndarray | None) -> np.ndarray:
    """One probability row (float64) of the given kind; ``other`` is the row a near-duplicate copies."""
    if kind == "one_hot":
        row = np.zeros(vocab)
        row[rng.integers(vocab)] = 1.0
        return row
    row = rng.dirichlet(np.full(vocab, 0.5))
    if kind == "zeros":
        row[rng.random(vocab) < 0.5] = 0.0
        if row.sum() == 0:
            row[rng.integers(vocab)] = 1.0
    elif kind == "tiny":
        row = np.full(vocab, 1e-30)
        row[rng.integers(vocab)] = 1.0
    elif kind == "near_duplicate" and other is not None:
        row = other * (1 + 1e-7 * rng.standard_normal(vocab))
    return row / row.sum()


@st.composite
def verify_inputs(draw, equal: bool = False):
    """(target_probs [B, gamma+1, V], draft_probs [B, gamma, V], draft_tokens [B, gamma], uniforms [B, gamma+1])."""
    batch, gamma, vocab = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(2, 8))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    target_kind, draft_kind = draw(st.sampled_from(KINDS)), draw(st.sampled_from(KINDS))
    target = np.stack([[_row(rng, vocab, target_kind, None) for _ in range(gamma + 1)] for _ in range(batch)])
    draft = target[:, :gamma].copy() if equal else np.stack(
        [[_row(rng, vocab, draft_kind, target[b, i]) for i in range(gamma)] for b in range(batch)])
    draft_probs = torch.tensor(draft).to(dtype)
    draft_probs /= draft_probs.sum(-1, keepdim=True)  # renormalise after the cast
    any_token = draw(st.floats(0, 0.3)) if not equal else 0.0
    tokens = [[int(rng.choice(vocab, p=draft_probs[b, i].double().numpy() / float(draft_probs[b, i].double().sum())))
               if rng.random() >= any_token else int(rng.integers(vocab)) for i in range(gamma)] for b in range(batch)]
    uniforms = torch.tensor(rng.choice([0.0, 1 - 1e-12, 0.5, *rng.random(5)], size=(batch, gamma + 1)))
    target_probs = torch.tensor(target).to(dtype)
    target_probs /= target_probs.sum(-1, keepdim=True)
    return target_probs, draft_probs, torch.tensor(tokens, dtype=torch.long), uniforms


def _check_common(result, target_probs, draft_tokens):
    batch, gamma = draft_tokens.shape
    n, nxt = result.num_accepted, result.next_token
    assert n.dtype == nxt.dtype == torch.int64 and n.shape == nxt.shape == (batch,)
    assert bool(((n >= 0) & (n <= gamma)).all()) and bool(((nxt >= 0) & (nxt < target_probs.shape[-1])).all())
    for b in range(batch):
        for i in range(int(n[b])):  # accepted x_{i+1} was checked against target row i
            assert target_probs[b, i, draft_tokens[b, i]] > 0, "accepted a token with p = 0"
        assert target_probs[b, n[b], nxt[b]] > 0, "emitted a next_token with p = 0 in its row"


@pytest.mark.parametrize("method", sorted(VERIFIERS))
@SETTINGS
@given(inputs=verify_inputs())
def test_outputs_valid_and_never_zero_probability(method, inputs):
    target_probs, draft_probs, draft_tokens, uniforms = inputs
    result = VERIFIERS[method](target_probs, draft_probs, draft_tokens, uniforms=uniforms)
    _check_common(result, target_probs, draft_tokens)


@SETTINGS
@given(inputs=verify_inputs())
def test_token_verification_never_emits_the_rejected_draft_when_the_residual_has_mass(inputs):
    target_probs, draft_probs, draft_tokens, uniforms = inputs
    result = token_verify(target_probs, draft_probs, draft_tokens, uniforms=uniforms)
    for b, n in enumerate(result.num_accepted.tolist()):
        if n < draft_tokens.shape[1]:
            residual = (target_probs[b, n].double() - draft_probs[b, n].double()).clamp(min=0)
            if float(residual.sum()) > 0:
                assert residual[result.next_token[b]] > 0  # drawn from max(p - q, 0) ...
                if draft_probs[b, n, draft_tokens[b, n]] > 0:  # ... so never a rejected x that q could draw
                    assert int(result.next_token[b]) != int(draft_tokens[b, n])


@pytest.mark.parametrize("method", sorted(VERIFIERS))
@SETTINGS
@given(inputs=verify_inputs())
def test_bonus_token_only_when_all_drafts_are_accepted(method, inputs):
    """Give the last target row a support of its own (a new token V): it can be emitted only as the bonus."""
    target_probs, draft_probs, draft_tokens, uniforms = inputs
    batch, gamma, vocab = draft_probs.shape
    target = torch.cat([target_probs, torch.zeros(batch, gamma + 1, 1, dtype=target_probs.dtype)], -1)
    target[:, -1] = 0
    target[:, -1, vocab] = 1  # bonus row: one-hot on the new token
    draft = torch.cat([draft_probs, torch.zeros(batch, gamma, 1, dtype=draft_probs.dtype)], -1)
    result = VERIFIERS[method](target, draft, draft_tokens, uniforms=uniforms)
    _check_common(result, target, draft_tokens)
    assert ((result.next_token == vocab) == (result.num_accepted == gamma)).all()


@SETTINGS
@given(inputs=verify_inputs(equal=True))
def test_token_and_block_agree_and_accept_all_when_p_equals_q(inputs):
    target_probs, draft_probs, draft_tokens, uniforms = inputs
    token = token_verify(target_probs, draft_probs, draft_tokens, uniforms=uniforms)
    block = block_verify(target_probs, draft_probs, draft_tokens, uniforms=uniforms)
    assert (token.num_accepted == draft_tokens.shape[1]).all() and (block.num_accepted == token.num_accepted).all()
    assert torch.equal(token.next_token, block.next_token)
