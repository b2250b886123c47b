"""specresearch.audit.real: the engines' rules on full next-token rows, checked against their exact twins.

Every float form at gamma = 1 is compared with the exact law of the first emitted token and the exact acceptance
(:mod:`specresearch.audit.engines`) on random rows without ties: deterministic, to 1e-12. EAGLE-1's acceptance is
a Monte Carlo estimate (64 rejection paths; the law itself is exact): within 6 standard errors of the twin.
"""

from __future__ import annotations

import random
from fractions import Fraction as F

import pytest
import torch

from specresearch.audit import LOSSY_SETTINGS, engine_rule, step_law
from specresearch.audit.engines import ENGINE_RULES
from specresearch.audit.real import TREE_RULES, distances, one_hot_cost, single_step, summarise

CASES = [(name, {}) for name in ENGINE_RULES] + [(name, params) for name, params in LOSSY_SETTINGS.items()]
CASES += [("medusa-typical", {"fast": False}), ("sglang", {"threshold_single": 0.3}), ("llamacpp-example", {"p_split": 0.05}),
          ("hf-assisted", {"ensemble_weight": 0.7})]


def _row(rng: random.Random, vocab: int) -> tuple:
    weights = rng.sample(range(1, 400), vocab)  # distinct: no ties in the top-k choice
    return tuple(F(w, sum(weights)) for w in weights)


@pytest.mark.parametrize("name, params", CASES, ids=[f"{n}{p}" for n, p in CASES])
@pytest.mark.parametrize("seed", range(4))
def test_float_form_equals_the_exact_twin(name, params, seed):
    rng = random.Random(seed)
    vocab, k = 5, 3
    p, q = _row(rng, vocab), _row(rng, vocab)
    rule = engine_rule(name, num_drafts=k if name in TREE_RULES else 1, gamma=1, **params)
    law = step_law(rule, p, q)
    first = [sum((v for s, v in law.items() if s[0] == t), F(0)) for t in range(vocab)]
    accepted = sum((v for s, v in law.items() if len(s) > 1), F(0))
    to = lambda row: torch.tensor([[float(v) for v in row]], dtype=torch.float64)  # noqa: E731
    r, acceptance = single_step(name, to(p), to(q), num_drafts=k, **params)
    assert torch.allclose(r, to(first), atol=1e-12), (name, params, r, first)
    if name == "eagle1":
        assert abs(float(acceptance[0]) - float(accepted)) < 6 * 0.5 / 8  # 64 paths: standard error <= 0.5 / 8
    else:
        assert float(acceptance[0]) == pytest.approx(float(accepted), abs=1e-12), (name, params)


def test_distances_and_summaries():
    p = torch.tensor([[0.5, 0.5, 0.0]], dtype=torch.float64)
    tv, kl = distances(torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64), p)
    assert float(tv[0]) == 0.5 and float(kl[0]) == pytest.approx(torch.log(torch.tensor(2.0)).item())
    assert float(distances(torch.tensor([[0.5, 0.0, 0.5]], dtype=torch.float64), p)[1][0]) == float("inf")
    q = torch.tensor([[0.2, 0.7, 0.1]], dtype=torch.float64)
    exact = summarise("eagle2", p, q, num_drafts=2)
    assert exact.tv == 0 and exact.acceptance == exact.frontier == 1.0
    lossy = summarise("sglang", p, q, num_drafts=1, threshold_acc=0.5)
    assert lossy.tv > 0 and lossy.acceptance <= lossy.frontier + 1e-12
    cost = one_hot_cost(p, q, num_drafts=2)
    assert cost["onehot, top-1"] == 0.5 and cost["token, sampled"] == pytest.approx(0.7)
    with pytest.raises(ValueError, match="unknown engine rule"):
        single_step("nope", p, q)


def _truncated_row(rng: random.Random, vocab: int, kept: int) -> tuple:
    """A candidate list of ``kept`` tokens (as a sampler chain leaves it), zeros elsewhere, no ties among the kept."""
    tokens, weights = rng.sample(range(vocab), kept), rng.sample(range(1, 400), kept)
    row = [F(0)] * vocab
    for token, weight in zip(tokens, weights):
        row[token] = F(weight, sum(weights))
    return tuple(row)


@pytest.mark.parametrize("num_drafts", [1, 2])
@pytest.mark.parametrize("seed", range(6))
def test_llamacpp_example_on_truncated_lists_equals_the_exact_twin(num_drafts, seed):
    """Lists of different tokens (the case where the example's position-by-position residual differs from p - q):
    the float form equals the exact twin (the next test shows where it parts from the textbook residual)."""
    rng = random.Random(seed)
    vocab = 7
    p, q = _truncated_row(rng, vocab, rng.randint(3, 6)), _truncated_row(rng, vocab, rng.randint(2, 5))
    law = step_law(engine_rule("llamacpp-example", num_drafts=num_drafts, gamma=1, p_split=0.05), p, q)
    first = [sum((v for s, v in law.items() if s[0] == t), F(0)) for t in range(vocab)]
    to = lambda row: torch.tensor([[float(v) for v in row]], dtype=torch.float64)  # noqa: E731
    r, _ = single_step("llamacpp-example", to(p), to(q), num_drafts=num_drafts, p_split=0.05, lists="support")
    assert torch.allclose(r, to(first), atol=1e-12), (p, q, r, first)


def test_llamacpp_example_residual_differs_from_the_textbook_one_on_different_lists():
    p = torch.tensor([[0.5, 0.25, 0.25, 0.0]], dtype=torch.float64)
    q = torch.tensor([[0.75, 0.0, 0.25, 0.0]], dtype=torch.float64)
    lists = single_step("llamacpp-example", p, q, num_drafts=1, lists="support")[0]
    tokens = single_step("llamacpp-example", p, q, num_drafts=1)[0]  # full lists, the float form's default
    assert torch.allclose(lists, torch.tensor([[2 / 3, 0, 1 / 3, 0]], dtype=torch.float64))
    assert torch.allclose(tokens, torch.tensor([[2 / 3, 1 / 3, 0, 0]], dtype=torch.float64))
    with pytest.raises(ValueError, match="lists"):
        single_step("llamacpp-example", p, q, num_drafts=1, lists="other")
    full = step_law(engine_rule("llamacpp-example", gamma=1, lists="full"), tuple(map(F, p[0].tolist())), tuple(map(F, q[0].tolist())))
    assert [float(sum((v for s, v in full.items() if s[0] == t), F(0))) for t in range(4)] == pytest.approx(tokens[0].tolist())


def test_llamacpps_sampler_chain_by_hand():
    """llamacpp_chain: top-k, then top-p on the survivors (the token that reaches p kept), then min-p against the
    likeliest, then the temperature; each sampler off at its neutral setting. (tests/test_audit_execute.py holds it
    against llama-server's own chain when llama.cpp is built.)"""
    from specresearch.audit.real import llamacpp_chain

    p = torch.tensor([[0.5, 0.3, 0.15, 0.04, 0.01]], dtype=torch.float64)
    # top-3 -> (0.5, 0.3, 0.15) / 0.95; cumulative before each: 0, 0.526, 0.842 -> top-p 0.8 keeps two
    assert llamacpp_chain(p, top_k=3, top_p=0.8, min_p=0.0)[0].tolist() == pytest.approx([0.625, 0.375, 0, 0, 0])
    assert llamacpp_chain(p, top_k=3, top_p=0.8, min_p=0.0, temperature=0.5)[0].tolist() == pytest.approx(
        [0.25 / 0.34, 0.09 / 0.34, 0, 0, 0])
    # min-p 0.1 keeps p >= 0.05: three tokens; off switches leave p itself
    assert llamacpp_chain(p, top_k=0, top_p=1.0, min_p=0.1)[0].tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0, 0])
    assert torch.allclose(llamacpp_chain(p, top_k=0, top_p=1.0, min_p=0.0), p)
    # a tie at the top-k boundary is broken by token id; a zero never comes back
    tied = torch.tensor([[0.4, 0.2, 0.2, 0.2, 0.0]], dtype=torch.float64)
    assert llamacpp_chain(tied, top_k=2, top_p=1.0, min_p=0.0)[0].tolist() == pytest.approx([2 / 3, 1 / 3, 0, 0, 0])
    assert llamacpp_chain(tied, top_k=0, top_p=1.0, min_p=0.0, temperature=2.0)[0, 4] == 0
    with pytest.raises(ValueError, match="temperature"):
        llamacpp_chain(p, temperature=0.0)


def test_vllms_sampling_law_by_hand():
    """vllm_law: bad words on the output's end, the repetition penalty on prompt and output tokens (dividing positive
    logits, multiplying the others), frequency and presence penalties on the output's counts, the temperature, then
    top-k (ties kept) and top-p on the survivors (a token dropped where the ascending cumulative probability up to it
    is <= 1 - p)."""
    import math

    from specresearch.audit.real import vllm_law

    logits = torch.tensor([2.0, 1.0, -1.0, 0.5, 0.0], dtype=torch.float64)

    def softmax(values):
        weights = [math.exp(v) if v != -math.inf else 0.0 for v in values]
        return [w / sum(weights) for w in weights]

    assert vllm_law(logits, [4], []).tolist() == pytest.approx(softmax(logits.tolist()))  # 0 x 2 = 0
    # prompt token 0 and output token 2 penalised by 2: 2 -> 1, -1 -> -2; output 2 twice: frequency 0.5 x 2, presence 0.25
    law = vllm_law(logits, [0], [2, 2], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    assert law.tolist() == pytest.approx(softmax([1.0, 1.0, -2.0 - 1.0 - 0.25, 0.5, 0.0]))
    # bad words: (3, 1) bans 1 after an output ending in 3; (4,) always bans 4; (2, 3) does not match the prompt
    law = vllm_law(logits, [2], [0, 3], bad_words=[[3, 1], [4], [2, 3]])
    assert law.tolist() == pytest.approx(softmax([2.0, -math.inf, -1.0, 0.5, -math.inf]))
    assert vllm_law(logits, [2], [], bad_words=[[2, 3]])[3] > 0
    # top-k 2 at T = 0.5, then top-p: logits 4, 2 -> probabilities 0.881, 0.119; p = 0.85 drops the second
    assert vllm_law(logits, [], [], temperature=0.5, top_k=2).tolist() == pytest.approx(softmax([4.0, 2.0] + [-math.inf] * 3))
    assert vllm_law(logits, [], [], temperature=0.5, top_k=2, top_p=0.85).tolist() == pytest.approx([1, 0, 0, 0, 0])
    assert vllm_law(logits, [], [], temperature=0.5, top_k=2, top_p=0.9)[1] > 0
    # allowed tokens keep their logits, the rest -inf; a stop token banned while the output is short of min_tokens
    law = vllm_law(logits, [], [3], allowed_token_ids=[0, 1, 3], min_tokens=2, stop_token_ids=[1])
    assert law.tolist() == pytest.approx(softmax([2.0, -math.inf, -math.inf, 0.5, -math.inf]))
    assert vllm_law(logits, [], [3, 0], min_tokens=2, stop_token_ids=[1])[1] > 0
    tied = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    assert (vllm_law(tied, [], [], top_k=2) > 0).tolist() == [True, True, True, False]
    with pytest.raises(ValueError, match="temperature"):
        vllm_law(logits, [], [], temperature=0.0)


def test_llamacpp_example_tests_a_token_off_the_targets_list_with_the_p_read_before():
    """llama-speculative sets p_tgt only when the path's token is on the target's list and never resets it between
    paths (speculative.cpp l. 276, 299-304): with two paths, tokens 0 (q 3/5) and 2 (q 2/5, off the target's list
    p = (3/10, 7/10, 0)), the order (0, 2) rejects 0 half the time and then tests 2 with 0's p = 3/10: token 2, which
    the target's sampler chain excludes, is emitted with probability 1/2 x 1/2 x 3/4 = 3/16."""
    p, q = (F(3, 10), F(7, 10), F(0)), (F(3, 5), F(0), F(2, 5))
    law = step_law(engine_rule("llamacpp-example", num_drafts=2, gamma=1), p, q)
    first = [sum((v for s, v in law.items() if s[0] == t), F(0)) for t in range(3)]
    assert first == [F(1, 4), F(9, 16), F(3, 16)]
    to = lambda row: torch.tensor([[float(v) for v in row]], dtype=torch.float64)  # noqa: E731
    r, _ = single_step("llamacpp-example", to(p), to(q), num_drafts=2, lists="support")
    assert torch.allclose(r, to(first), atol=1e-12)
    full = single_step("llamacpp-example", to(p), to(q), num_drafts=2, lists="full")[0]  # untruncated: no such token
    assert full[0, 2] == 0


def test_hf_assisted_with_drafts_from_another_law():
    """``drafted=``: drafts sampled from d, verified with q. d = q is the token rule (lossless); d the one-hot argmax of
    q is the greedy assistant's form; a permuted q is lossy, and the law is d x min(1, p / q) plus the rejected mass
    spread on max(p - q, 0), by hand on a three-token row."""
    generator = torch.Generator().manual_seed(0)
    p = torch.rand(5, 7, generator=generator, dtype=torch.float64).softmax(-1)
    q = (3 * torch.rand(5, 7, generator=generator, dtype=torch.float64)).softmax(-1)
    same, _ = single_step("hf-assisted", p, q, num_drafts=1, drafted=q)
    assert torch.allclose(same, p, atol=1e-12)
    greedy = torch.zeros_like(q).scatter_(1, q.argmax(-1, keepdim=True), 1.0)
    assert torch.allclose(single_step("hf-assisted", p, q, num_drafts=1, drafted=greedy)[0],
                          single_step("hf-assisted", p, q, num_drafts=1, assistant="greedy")[0], atol=1e-12)
    permuted, accepted = single_step("hf-assisted", p, q, num_drafts=1, drafted=q[:, [1, 2, 3, 4, 5, 6, 0]])
    assert (distances(permuted, p)[0] > 1e-3).all() and torch.allclose(permuted.sum(-1), torch.ones(5, dtype=torch.float64))
    p1, q1, d1 = (torch.tensor([row], dtype=torch.float64) for row in ([0.5, 0.3, 0.2], [0.2, 0.3, 0.5], [0.5, 0.2, 0.3]))
    law, kept = single_step("hf-assisted", p1, q1, num_drafts=1, drafted=d1)
    # accepted: 0.5 x 1, 0.2 x 1, 0.3 x 0.4; rejected 0.18 goes to max(p - q, 0) = (0.3, 0, 0), all on token 0
    assert torch.allclose(law, torch.tensor([[0.5 + 0.18, 0.2, 0.12]], dtype=torch.float64))
    assert torch.allclose(kept, torch.tensor([0.82], dtype=torch.float64))


def test_vllm_laws_settings_are_the_python_engines_recorded_settings():
    """Every setting ``vllm_law`` reads (besides the temperature) is one the ``python`` engine records and refuses
    without a ``target_law``, and the other way round: a rename on one side fails here, not in a run."""
    import inspect

    from specresearch.audit.real import vllm_law
    from specresearch.audit.runners import PYTHON_SETTINGS

    keywords = {name for name, parameter in inspect.signature(vllm_law).parameters.items()
                if parameter.kind is inspect.Parameter.KEYWORD_ONLY}
    assert keywords - {"temperature"} == set(PYTHON_SETTINGS)
