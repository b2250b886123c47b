"""specresearch.audit: exact verdicts on the engines' rules, rules brought by a user, the lossy frontier.

Exact tests enumerate laws with Fractions: they cannot be lucky. The two statistical tests run the torch form
of a user's rule through the generation engine on a tiny Markov pair (``ToyLM``); the one that must pass
asserts the exact, conservative Bonferroni p-value > 1e-7, so a correct implementation fails with probability
<= 1e-7 (experiments.stats.FPR_NOTE); the one that must reject shows the test has power at the same N.
"""

from __future__ import annotations

import random
from fractions import Fraction as F
from pathlib import Path

import pytest
import torch

from specresearch import exact
from specresearch.audit import (
    ENGINE_RULES,
    LOSSY_SETTINGS,
    audit,
    engine_rule,
    engine_table,
    frontier_closed_form,
    frontier_float,
    lossy_frontier,
    optimum,
    rule_from_acceptance,
    step_law,
)
from specresearch.exact import lp
from specresearch.models.toy import ToyLM

P2, Q2 = exact.two_symbol_example()

# The exact verdict of every engine rule (default settings, then its lossy setting): written out, not derived
# from the claims the rules carry, so that a change in either shows up.
VERDICTS = {
    ("eagle2", ()): True, ("eagle1", ()): True, ("medusa-typical", ()): False, ("medusa-nucleus", ()): False,
    ("sglang", ()): True, ("sglang", (("threshold_acc", 0.5),)): False,
    ("vllm-greedy", ()): True, ("vllm-probabilistic", ()): True, ("vllm-block", ()): True,
    ("hf-assisted", ()): True, ("hf-assisted", (("assistant", "greedy"),)): False,
    ("hf-lookup", ()): True, ("llamacpp-server", ()): True, ("llamacpp-example", ()): False,
    ("trtllm-relaxed", ()): True, ("trtllm-relaxed", (("relaxed_delta", 0.6), ("relaxed_topk", 10))): False,
    ("llamacpp-server", (("synth_rates", (0.5, 0.25)),)): False,
}


def test_every_engine_and_lossy_setting_has_a_verdict():
    settings = {(name, ()) for name in ENGINE_RULES} | {(n, tuple(sorted(p.items()))) for n, p in LOSSY_SETTINGS.items()}
    assert settings == set(VERDICTS)


@pytest.mark.parametrize("name, params", sorted(VERDICTS), ids=[f"{n}{dict(p)}" for n, p in sorted(VERDICTS)])
def test_engine_verdicts(name, params):
    report = audit(name, **dict(params))
    assert report.lossless == VERDICTS[(name, params)]
    assert (report.counterexample is None) == report.lossless
    assert report.claim_holds  # what the engine's authors say agrees with the exact verdict
    if not report.lossless:
        assert report.counterexample.tv > 0 and report.counterexample.law != report.counterexample.target_law


def test_llamacpp_example_emits_token_0_with_probability_five_sixths():
    law = step_law(engine_rule("llamacpp-example"), (F(1, 2), F(1, 2)), (F(3, 5), F(2, 5)))
    assert sum(v for seq, v in law.items() if seq[0] == 0) == F(5, 6)


def test_llamacpp_synthetic_acceptance_keeps_the_draft_token_at_its_rates():
    """--spec-synth-rates 1/2,1/4: depth 1 kept with 1/2, depth 2 with (1/4) / (1/2); a rejection emits p's sample."""
    rule = engine_rule("llamacpp-server", synth_rates=(0.5, 0.25))
    law = step_law(rule, P2, Q2)  # greedy chain (0, 0); p = (1/3, 2/3) at every prefix
    assert law[(1,)] == F(1, 2) * P2[1] and law[(0, 0, 1)] == F(1, 4) * P2[1]
    assert law[(0, 1)] == F(1, 2) * F(1, 2) * P2[1] and sum(law.values()) == 1
    with pytest.raises(ValueError, match="non-increasing"):
        engine_rule("llamacpp-server", synth_rates=(0.25, 0.5))


def test_sglang_threshold_acc_half_doubles_a_candidate():
    """threshold_acc = 0.5: a candidate with p = 0.3 comes out with probability 0.6."""
    rule = engine_rule("sglang", num_drafts=1, threshold_acc=0.5)
    assert step_law(rule, (F(3, 10), F(7, 10)), (F(2, 3), F(1, 3)))[(0, 0)] + step_law(rule, (F(3, 10), F(7, 10)), (F(2, 3), F(1, 3)))[(0, 1)] == F(3, 5)


def test_medusa_nucleus_on_a_chain_emits_p_times_two_minus_p():
    rule = engine_rule("medusa-nucleus", num_drafts=1)
    law = step_law(rule, P2, Q2)  # the chain drafts token 0 (q's argmax)
    assert sum(v for seq, v in law.items() if seq[0] == 0) == P2[0] * (2 - P2[0])


def test_llamacpp_example_subtracts_the_draft_list_position_by_position():
    """The target's list {0, 1, 2}, the draft's {0, 2} (min-p kept fewer tokens of the sharper draft): the draft's
    token 0 is accepted with (1/2) / (3/4) = 2/3; on a rejection the example sorts both lists by id and subtracts
    position by position (speculative.cpp l. 335-351), so token 1 loses token 2's q (1/4 - 1/4) and token 2 keeps
    its 1/4: the residual is token 2, never token 1, where the textbook max(p - q, 0) is token 1."""
    from specresearch.audit.engines import list_aligned

    p, q = (F(1, 2), F(1, 4), F(1, 4), F(0)), (F(3, 4), F(0), F(1, 4), F(0))
    assert list_aligned(p, q) == [F(3, 4), F(1, 4), 0, 0]
    law = step_law(engine_rule("llamacpp-example", gamma=1), p, q)
    assert [sum((v for s, v in law.items() if s[0] == t), F(0)) for t in range(4)] == [F(2, 3), 0, F(1, 3), 0]
    assert list_aligned(P2, Q2) == list(Q2)  # the same lists: q itself


def test_llamacpp_example_verifies_its_paths_in_a_random_order():
    """p = (1/2, 1/2, 0), q = (3/5, 3/10, 1/10), two paths (tokens 0 and 1): in path order token 0 comes first
    with probability 5/6; in llama.cpp's uniformly random order (speculative.cpp l. 280-282) the first token's law is
    (5/12, 7/12) = 1/2 (5/6, 1/6) + 1/2 (0, 1) (token 1 first: p/q = 5/3, always accepted)."""
    p, q = (F(1, 2), F(1, 2), F(0)), (F(3, 5), F(3, 10), F(1, 10))
    law = step_law(engine_rule("llamacpp-example", num_drafts=2, gamma=1), p, q)
    assert [sum((v for s, v in law.items() if s[0] == t), F(0)) for t in range(3)] == [F(5, 12), F(7, 12), 0]
    assert engine_rule("llamacpp-example").num_drafts == 1 and engine_rule("llamacpp-example").gamma == 3  # its defaults
    with pytest.raises(ValueError, match="gamma = 1 only"):
        engine_rule("llamacpp-example", num_drafts=2, gamma=2)


def test_medusa_nucleus_compares_each_path_with_its_own_sample():
    """Two paths of one token, x0 and x1 (q's top two): each is compared with its own draw of p (Medusa's
    get_nucleus_posterior_mask samples per candidate and position), so x1 comes out when its draw matches and x0's
    did not, or when neither matched and the fresh draw is x1: p1 (1 - p0) + (1 - p0)(1 - p1) p1. One draw per
    node would give p1 + (1 - p0 - p1) p1."""
    p, q = (F(1, 2), F(1, 3), F(1, 6)), (F(1, 2), F(1, 3), F(1, 6))
    law = step_law(engine_rule("medusa-nucleus", num_drafts=2, gamma=1), p, q)
    first = [sum((v for s, v in law.items() if s[0] == t), F(0)) for t in range(3)]
    none = (1 - p[0]) * (1 - p[1])
    assert first == [p[0] + none * p[0], p[1] * (1 - p[0]) + none * p[1], none * p[2]]
    assert first[1] != p[1] + (1 - p[0] - p[1]) * p[1]


def test_medusa_typical_breaks_a_tie_in_length_by_likelihood():
    """Both candidates typical (accepted length 1 each): Medusa keeps the likelier one (evaluate_posterior l.
    496-501), here the second in q's order, and emits it with probability 1."""
    p, q = (F(1, 5), F(3, 5), F(1, 5)), (F(1, 2), F(3, 10), F(1, 5))  # q's order: token 0, then token 1
    law = step_law(engine_rule("medusa-typical", num_drafts=2, gamma=1), p, q)
    assert sum((v for s, v in law.items() if s[0] == 1), F(0)) == 1


def test_transformers_ensemble_verification_is_lossy_and_accepts_more():
    """transformers' ``assistant_ensemble_weight`` w accepts against w p + (1 - w) q: on the two-symbol example with
    w = 1/2 it accepts more than token verification (which it equals as w -> 1) and is not lossless."""
    token, ensemble = audit("hf-assisted"), audit("hf-assisted", ensemble_weight=F(1, 2))
    assert token.tv == 0 and ensemble.tv > 0 and ensemble.acceptance > token.acceptance
    assert "CONTRADICTED" not in str(ensemble)
    with pytest.raises(ValueError, match="ensemble_weight must lie in"):
        engine_rule("hf-assisted", ensemble_weight=1)


def test_medusa_typical_threshold_is_decided_exactly():
    """p = (1/2, 1/4, 1/4): exp(-H) = 2^(-3/2), delta exp(-H) = 0.106...; eps = 0.09 is the smaller: 1/4 passes.
    With eps = 1 the entropy term decides: 1/4 > 0.3 * 2^(-3/2) = 0.1060 passes, 1/10 would not."""
    from specresearch.audit.engines import _typical

    row = (F(1, 2), F(1, 4), F(1, 4))
    assert _typical(row, 1, F(9, 100), F(3, 10)) and _typical(row, 1, F(1), F(3, 10))
    assert not _typical((F(1, 10), F(9, 10)), 0, F(1), F(3, 10))  # 0.1 < 0.3 * exp(-H) = 0.3 * 0.722


def test_the_two_symbol_figures():
    """Exact TV of the 2-token law and acceptance against the lossless optimum on p = (1/3, 2/3), q = (2/3, 1/3)."""
    block, token = audit("vllm-block"), audit("vllm-probabilistic")
    assert block.tv == token.tv == 0 and block.acceptance == block.optimum == F(11, 9) and token.acceptance == F(10, 9)
    greedy = audit("hf-assisted", assistant="greedy")
    assert greedy.tv > 0 and greedy.acceptance > greedy.optimum  # a lossy rule may accept more than any exact one
    assert "lossless" in str(greedy) and "CONTRADICTED" not in str(greedy)


@pytest.mark.parametrize("seed", range(3))
def test_tree_optimum_is_the_lp_on_topk_trees(seed):
    rng = random.Random(seed)
    target, draft = (exact.random_rational_model(3, rng, zero_prob=0.25) for _ in range(2))
    for k, gamma in [(1, 2), (2, 1), (2, 2)]:
        want = lp.optimal_verifier_lp(target, draft, gamma, num_drafts=k, draft_law="topk").optimum
        assert optimum(engine_rule("eagle2", num_drafts=k, gamma=gamma), target, draft) == want


@pytest.mark.parametrize("method, kwargs", [("onehot", dict(num_drafts=2, gamma=2, draft_law="topk")),
                                            ("traversal", dict(num_drafts=2, gamma=2)),
                                            ("rrs_without_replacement", dict(num_drafts=2, draft_law="without_replacement"))])
def test_exact_verifiers_pass_on_random_models(method, kwargs):
    report = audit(method, num_models=30, **kwargs)
    assert report.lossless and report.models_checked == 30


def test_a_wrong_tree_rule_is_caught():
    """RRS (reads q) on a deterministic top-k tree: the draft's q is not the law the candidates came from."""
    report = audit("rrs", num_drafts=2, draft_law="topk")
    assert not report.lossless and report.counterexample.where == "context-free grid"


# ----------------------------------------------------------------------------- rules a user brings


def test_rule_from_acceptance_decides_the_square_root_rule():
    rule = rule_from_acceptance(lambda p_x, q_x: min(1, p_x / q_x) ** 0.5, name="sqrt")
    report = audit(rule)
    assert rule.numeric and not report.lossless and report.counterexample.tv > 0.2
    token = audit(rule_from_acceptance(lambda p_x, q_x: min(1, p_x / q_x)), gamma=2)
    assert token.lossless and not token.rule.numeric and token.acceptance == F(10, 9)


def test_the_lossless_residual_makes_any_smaller_acceptance_exact():
    assert audit(rule_from_acceptance(lambda p_x, q_x: min(1, p_x / q_x) ** 2, residual="lossless")).lossless
    assert not audit(rule_from_acceptance(lambda p_x, q_x: min(1, p_x / q_x), residual="target")).lossless


def test_bad_rules_and_arguments_are_refused():
    with pytest.raises(ValueError, match="not a probability"):
        audit(rule_from_acceptance(lambda p_x, q_x: 2 * p_x / q_x))
    for returned in (None, "1", 1j, float("nan")):  # not numbers in [0, 1]: named, not a TypeError from a comparison
        with pytest.raises(ValueError, match=r"accept returned .* at p\(x\) = .*: not a probability"):
            audit(rule_from_acceptance(lambda p_x, q_x, returned=returned: returned))
    with pytest.raises(ValueError, match="residual must be"):
        rule_from_acceptance(lambda p_x, q_x: 1, residual="nope")
    with pytest.raises(ValueError, match="unknown engine rule"):
        engine_rule("nope")
    with pytest.raises(ValueError, match="takes"):
        audit("sglang", threshold=0.5)
    with pytest.raises(ValueError, match="threshold_acc must be in"):
        audit("sglang", threshold_acc=1.5)
    with pytest.raises(ValueError, match="both target and draft"):
        audit("eagle2", target=P2)
    with pytest.raises(ValueError, match="rule must be"):
        audit(42)


def _markov(seed: int, vocab: int = 5):
    model = exact.random_rational_model(vocab, random.Random(seed), depth=1, zero_prob=0.2)
    return ToyLM(torch.tensor([[float(p) for p in model((t,))] for t in range(vocab)], dtype=torch.float64).log())


def test_the_torch_form_through_the_engine_passes_and_rejects():
    pair = (_markov(3), _markov(4), None)
    options = {"prompt": [2, 1], "k": 2, "num_samples": 12_000, "seed": 7}
    token = audit(rule_from_acceptance(lambda p_x, q_x: min(1, p_x / q_x), gamma=2), torch_rule=True, pair=pair, chi_square=options)
    assert token.chi_square.impossible == 0 and token.chi_square.bonferroni_p_value > 1e-7
    sqrt = audit(rule_from_acceptance(lambda p_x, q_x: min(1, p_x / q_x) ** 0.5, gamma=2), torch_rule=True, pair=pair, chi_square=options)
    assert sqrt.chi_square.p_value < 1e-7  # power: the same N rejects the lossy rule
    assert "chi-square" in str(sqrt)


# ----------------------------------------------------------------------------- the lossy frontier


def test_frontier_two_symbol_values():
    assert [lossy_frontier(P2, Q2, e) for e in (0, F(1, 10), F(1, 3), F(1, 2))] == [F(2, 3), F(23, 30), 1, 1]
    assert lossy_frontier(P2, Q2, 0, num_drafts=2) == lp.optimal_acceptance(P2, Q2, 2) == F(8, 9)


@pytest.mark.parametrize("seed", range(6))
def test_frontier_lp_equals_its_closed_form(seed):
    rng = random.Random(seed)
    vocab = 2 + seed % 3
    target, draft = (exact.random_rational_model(vocab, rng, depth=0, zero_prob=0.25)(()) for _ in range(2))
    for k, law in [(1, "iid"), (2, "iid"), (2, "without_replacement"), (3, "iid")]:
        for eps in (0, F(1, 20), F(1, 5)):
            assert lossy_frontier(target, draft, eps, num_drafts=k, draft_law=law) == frontier_closed_form(target, draft, eps, num_drafts=k, draft_law=law)
        assert lossy_frontier(target, draft, 0, num_drafts=k, draft_law=law) == lp.optimal_acceptance(target, draft, k, law)


def test_frontier_float_matches_the_exact_one():
    got = frontier_float([1 / 3, 2 / 3], [2 / 3, 1 / 3], [0, 0.1, 0.5])
    assert got.tolist() == pytest.approx([2 / 3, 23 / 30, 1.0])
    with pytest.raises(ValueError, match="eps must be"):
        lossy_frontier(P2, Q2, 1.5)


def test_the_docs_table_is_the_computed_one():
    text = (Path(__file__).resolve().parents[1] / "docs" / "audit.md").read_text()
    table = text.split("<!-- engine table: generated -->\n")[1].split("\n<!-- end of engine table -->")[0]
    assert table == engine_table()
