"""The machine's cost curve and the default gamma it picks (``engine.cost``). Timings are never asserted: the tests
check the arithmetic on given curves, the cache's round trip and what the CLI does with the choice."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from specresearch.config import (
    GENERATE_GAMMA,
    GENERATE_TAU,
    GENERATE_TAU_GREEDY,
    GENERATE_TREES,
)
from specresearch.engine import cost
from specresearch.engine.cost import (
    CostCurve,
    best_config,
    best_gamma,
    fit_default_draft,
    predicted_speedup,
    tree_options,
)
from specresearch.models.toy import ToyLM, tiny_llama
from specresearch.paths import repo_root


def test_the_default_taus_are_the_records():
    frame = pd.read_csv(repo_root() / "benchmarks" / "records" / "adaptive_amd.csv")
    means = frame[frame.temperature == 1.0].groupby("run").tau.mean()
    assert {g: round(means[f"gamma {g}"], 3) for g in GENERATE_TAU} == GENERATE_TAU
    greedy = frame[frame.temperature == 0.0].groupby("run").tau.mean()
    assert {g: round(greedy[f"gamma {g}"], 3) for g in GENERATE_TAU_GREEDY} == GENERATE_TAU_GREEDY
    trees = pd.read_csv(repo_root() / "benchmarks" / "records" / "trees_head_h200.csv")
    taus = trees.groupby(["run", "temperature"]).tau.agg(["mean", "size"])
    for (k, depth, nodes), want in GENERATE_TREES.items():
        rows = [taus.loc[(f"dynamic K{k} g{depth} n{nodes}", t)] for t in (0.0, 1.0)]
        assert tuple(round(row["mean"], 3) for row in rows) == want and all(row["size"] == 8 for row in rows)


def test_speedup_and_best_gamma_follow_the_curve():
    expected = {1: 1.5, 2: 1.8, 3: 2.1}
    flat = CostCurve((1.0,) * 5, draft_ratio=0.05, target_seconds=0.01)  # a GPU at small batch: scoring is free
    assert predicted_speedup(flat, expected) == pytest.approx({1: 1.5 / 1.05, 2: 1.8 / 1.10, 3: 2.1 / 1.15})
    assert best_gamma(flat, expected) == 3
    steep = CostCurve((1.0, 1.3, 1.8, 2.3, 2.8), draft_ratio=0.3, target_seconds=0.02, overhead_ratio=0.1)
    assert best_gamma(steep, expected) == 1  # 1.5 / 1.7 = 0.88 against 1.8 / 2.5 and 2.1 / 3.2
    # measured whole steps decide when the curve has them: here gamma 1's step is cheap enough to win
    stepped = CostCurve((1.0,) * 5, draft_ratio=0.05, target_seconds=0.01, step_ratios=(1.1, 1.5, 1.8))
    assert predicted_speedup(stepped, expected) == pytest.approx({1: 1.5 / 1.1, 2: 1.8 / 1.5, 3: 2.1 / 1.8})
    assert best_gamma(stepped, expected) == 1
    assert predicted_speedup(stepped, expected, model="calls") == predicted_speedup(flat, expected)
    tie = CostCurve((1.0, 1.0, 1.0), draft_ratio=0.0, target_seconds=0.01)
    assert best_gamma(tie, {1: 2.0, 2: 2.0}) == 1  # ties go to the shorter
    with pytest.raises(ValueError, match="covers up to 2 tokens"):
        best_gamma(CostCurve((1.0, 1.1), 0.1, 0.01), {2: 1.8, 3: 2.0})


def test_the_curve_is_timed_once_and_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECRESEARCH_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECRESEARCH_ANSWERS", raising=False)  # the default place: the cache folder
    monkeypatch.setattr(cost, "steady", lambda curve: (True, ""))  # a tiny model's rounds may differ: kept regardless
    target, draft = tiny_llama(48, seed=0), tiny_llama(48, seed=1)
    told = []
    curve = cost.cost_curve(target, draft, max_tokens=3, announce=told.append)
    assert len(told) == 1 and str(tmp_path / cost.COST_FILE) in told[0]  # the CLI prints it before the wait
    assert len(curve.ratios) == 3 and curve.ratios[0] == 1.0 and curve.draft_ratio > 0 and curve.target_seconds > 0
    assert len(curve.step_ratios) == 2 and all(r > 0 for r in curve.step_ratios)
    assert len(curve.step_rounds) == 2 and all(len(r) == 2 for r in curve.step_rounds)  # two rounds of gammas 1, 2
    assert curve.step_ratios == tuple((a + b) / 2 for a, b in zip(*curve.step_rounds))  # the median of two
    stored = json.loads((tmp_path / cost.COST_FILE).read_text())
    assert len(stored) == 1 and next(iter(stored.values()))["ratios"] == list(curve.ratios)

    def refuse(*args, **kwargs):
        raise AssertionError("timed again although the machine's answer was kept")

    monkeypatch.setattr(cost, "FLAT", float("inf"))  # trees are timed whatever r is
    trees = cost.cost_curve(target, draft, max_tokens=3, trees=((2, 2, 3),))  # another question: its own entry
    assert trees.tree_steps[0][0] == (2, 2, 3) and trees.tree_steps[0][1] > 0 and trees.step_ratios
    assert len(trees.tree_rounds) == 2 and trees.tree_steps[0][1] == sum(r[0] for r in trees.tree_rounds) / 2
    monkeypatch.setattr(cost, "FLAT", 0.5)  # r climbs past the bound: no tree is timed
    assert cost.measure_cost_curve(target, draft, max_tokens=3, repeats=1, new_tokens=8, trees=((2, 2, 3),)).tree_steps == ()
    real_seconds = cost.score_seconds

    def wide_is_dear(target, ks, *args, **kwargs):  # flat up to 4 tokens, a 9-token call costs 3
        return {k: 1.0 if k <= 4 else 3.0 for k in real_seconds(target, ks, *args, **kwargs)}

    monkeypatch.setattr(cost, "FLAT", 1.15)
    monkeypatch.setattr(cost, "score_seconds", wide_is_dear)
    narrow_and_wide = cost.measure_cost_curve(target, draft, max_tokens=3, repeats=1, new_tokens=8, rounds=1,
                                              trees=((2, 2, 3), (2, 4, 8)))
    assert [shape for shape, _ in narrow_and_wide.tree_steps] == [(2, 2, 3)]  # the 8-node tree's own call is too dear
    monkeypatch.setattr(cost, "score_seconds", real_seconds)
    monkeypatch.setattr(cost, "measure_cost_curve", refuse)
    assert cost.cost_curve(target, draft, max_tokens=3, announce=told.append) == curve and len(told) == 1
    assert cost.cost_curve(target, draft, max_tokens=3, trees=((2, 2, 3),)) == trees  # tree steps kept too
    with pytest.raises(AssertionError, match="timed again"):
        cost.cost_curve(target, draft, max_tokens=4)  # another question: timed anew


def test_another_gamma_replaces_the_measured_default_only_by_the_margin():
    expected = {1: 1.5, 2: 1.8, 3: 2.1}
    close = CostCurve((1.0,) * 5, 0.05, 0.01, step_ratios=(1.1, 1.5, 1.45))  # 1.364, 1.2, 1.448: gamma 3 by 6 %
    assert best_gamma(close, expected) == 3
    assert best_gamma(close, expected, incumbent=1, margin=0.10) == 1
    assert best_gamma(close, expected, incumbent=1, margin=0.05) == 3
    flat = CostCurve((1.0,) * 5, 0.05, 0.01, step_ratios=(1.05, 1.10, 1.15))  # a GPU at small batch: gamma 3 by 27 %
    assert best_gamma(flat, expected, incumbent=1, margin=0.10) == 3


def test_the_default_gamma_is_the_measured_one_unless_the_machine_says_otherwise(monkeypatch):
    from specresearch.config import GENERATE_MARGIN

    close = CostCurve((1.0,) * 4, 0.05, 0.01, step_ratios=(1.1, 1.5, 1.45))
    flat = CostCurve((1.0,) * 4, 0.05, 0.01, step_ratios=(1.05, 1.10, 1.15))
    for curve, want in ((close, GENERATE_GAMMA), (flat, 3)):
        monkeypatch.setattr(cost, "cost_curve", lambda *args, curve=curve, **kwargs: curve)
        assert cost.default_config(None, None) == {"gamma": want}
    assert cost.MARGIN == GENERATE_MARGIN


def test_a_tree_replaces_the_chain_where_its_whole_step_is_cheap_enough():
    """The H200's steps (records trees_head_h200: a gamma-1 step 1.11 autoregressive steps, gamma 2 1.25, gamma 3
    1.41, the two trees 1.78 and 2.07) make the 32-node tree the default at T = 0 and keep a chain at T = 1; the
    reference CPU's (cost_curve_amd, tree_steps_amd: trees cost 2.6 steps and more) keep gamma 1 at both."""
    taus = {t: {shape: pair[t] for shape, pair in GENERATE_TREES.items()} for t in (0, 1)}
    gpu = CostCurve((1.0,) * 4, 0.1, 0.02, step_ratios=(1.11, 1.25, 1.41), tree_steps=(((4, 4, 10), 1.78), ((8, 6, 32), 2.07)))
    assert best_config(gpu, GENERATE_TAU_GREEDY, taus[0], margin=0.10) == tree_options((8, 6, 32))
    assert best_config(gpu, GENERATE_TAU, taus[1], margin=0.10) == {"gamma": GENERATE_GAMMA}
    cpu = CostCurve((1.0, 1.01, 1.43, 1.38), 0.089, 0.03, step_ratios=(1.10, 1.55, 1.59),
                    tree_steps=(((4, 4, 10), 3.4), ((8, 6, 32), 6.0)))
    for tau, trees in ((GENERATE_TAU_GREEDY, taus[0]), (GENERATE_TAU, taus[1])):
        assert best_config(cpu, tau, trees, margin=0.10) == {"gamma": 1}
    assert best_config(gpu, GENERATE_TAU_GREEDY, {}, margin=0.10) == {"gamma": 1}  # no tree weighed: a chain
    untimed = CostCurve((1.0,) * 4, 0.1, 0.02, step_ratios=(1.11, 1.25, 1.41))
    assert best_config(untimed, GENERATE_TAU_GREEDY, taus[0]) == {"gamma": 2}  # trees the curve did not time: chains only
    assert tree_options((8, 6, 32)) == {"verifier": "onehot", "num_drafts": 8, "gamma": 6, "draft_law": "dynamic",
                                        "tree_nodes": 32}


def test_the_default_configuration_weighs_trees_at_the_temperature_asked(monkeypatch):
    seen = []
    gpu = CostCurve((1.0,) * 4, 0.1, 0.02, step_ratios=(1.11, 1.25, 1.41), tree_steps=(((4, 4, 10), 1.78), ((8, 6, 32), 2.07)))

    def curve(target, draft, **kwargs):
        seen.append(kwargs["trees"])
        return gpu

    monkeypatch.setattr(cost, "cost_curve", curve)
    head = tiny_llama(48, seed=1)
    assert cost.default_config(None, head, 0.0) == tree_options((8, 6, 32))
    assert cost.default_config(None, head, 1.0) == {"gamma": GENERATE_GAMMA}
    assert cost.default_config(None, head, 0.0, trees=False) == {"gamma": 1} and seen[-1] == ()
    assert seen[0] == tuple(GENERATE_TREES)
    recurrent = SimpleNamespace(recurrent=True)  # trees a row per path, never captured: chains only
    assert cost.default_config(recurrent, head, 0.0) == {"gamma": 1} and seen[-1] == ()


def test_a_planning_draft_is_timed_on_the_draft_it_wraps_at_every_gamma(monkeypatch):
    """``ngram+NAME`` drafts one token where lookup finds no match (the calibration's prompt has none): its step costs
    are those of NAME's chains, each step drafting gamma tokens."""
    import specresearch.engine.generate as engine
    from specresearch.drafts.combined import LookupOrDraft

    target, inner = tiny_llama(48, seed=0), tiny_llama(48, seed=1)
    seen, real = [], engine.speculative_generate

    def spy(target, draft, prompts, **kwargs):
        result = real(target, draft, prompts, **kwargs)
        seen.append((draft, kwargs["gamma"], [s.gamma for s in result.steps]))
        return result

    monkeypatch.setattr(engine, "speculative_generate", spy)
    curve = cost.measure_cost_curve(target, LookupOrDraft(inner, draft_gamma=1), max_tokens=4, repeats=2, new_tokens=12)
    assert len(curve.step_ratios) == 3 and all(r > 0 for r in curve.step_ratios)
    assert all(draft is inner for draft, _, _ in seen)
    for gamma in (1, 2, 3):
        assert any(g == gamma and steps.count(gamma) >= 2 for _, g, steps in seen), gamma  # steps that draft gamma tokens

    class Planner:  # plans its lengths and wraps no draft: nothing fixes its chains' length
        vocab_size, device = 48, torch.device("cpu")

        def plan_length(self, gamma):
            return 1

    with pytest.raises(ValueError, match="plans its own draft lengths"):
        cost.measure_cost_curve(target, Planner(), max_tokens=3, repeats=1)


def test_a_planning_draft_is_keyed_by_the_draft_it_wraps():
    from specresearch.drafts.combined import LookupOrDraft

    target, one, two = tiny_llama(48, seed=0), tiny_llama(48, seed=1), tiny_llama(48, seed=2, num_layers=1)
    assert cost._key(target, LookupOrDraft(one), 3) == cost._key(target, one, 3)
    assert cost._key(target, LookupOrDraft(one), 3) != cost._key(target, LookupOrDraft(two), 3)


def test_a_fused_target_is_timed_apart_from_the_same_target_unfused():
    """Fusing keeps the parameters (and their shapes) and changes the products: the cost curve's cache tells them
    apart."""
    from specresearch.models.fused import unfuse_projections

    fused, plain = tiny_llama(48, seed=0), tiny_llama(48, seed=0)
    assert fused.fuses and unfuse_projections(plain.model) > 0
    assert cost._key(fused, None, 3) != cost._key(plain, None, 3)


def test_auto_resolves_to_the_machines_configuration_for_chains_only(monkeypatch):
    asked = []
    monkeypatch.setattr(cost, "default_config", lambda target, draft, temperature, **kwargs: asked.append(
        (temperature, kwargs["trees"])) or {"gamma": 4})
    assert cost.resolve_config(3, None, None) == {"gamma": 3}  # a count is kept
    assert cost.resolve_config("auto", None, None, temperature=0.0, trees=True) == {"gamma": 4}
    assert asked == [(0.0, True)]
    assert cost.resolve_config("auto", None, None, num_drafts=2) == {"gamma": GENERATE_GAMMA}
    assert cost.resolve_config("auto", None, None, stop_below=0.5) == {"gamma": GENERATE_GAMMA}
    assert len(asked) == 1


def test_a_measurement_whose_rounds_disagree_or_that_began_on_a_busy_machine_is_not_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECRESEARCH_ANSWERS", str(tmp_path))
    quiet = CostCurve((1.0, 1.0, 1.4), 0.09, 0.05, step_ratios=(1.1, 1.6), step_rounds=((1.05, 1.58), (1.15, 1.62)),
                      load=0.2)
    assert quiet.spread() == pytest.approx(0.10 / 1.10) and cost.steady(quiet) == (True, "")
    shaky = CostCurve((1.0, 1.0, 1.4), 0.09, 0.05, step_ratios=(1.1, 1.6), step_rounds=((0.9, 1.58), (1.3, 1.62)),
                      load=0.2)
    assert cost.steady(shaky) == (False, "its rounds differ by 36%")
    load = float(os.cpu_count() or 1)  # every core busy
    busy = CostCurve((1.0, 1.0, 1.4), 0.09, 0.05, step_ratios=(1.1, 1.6), step_rounds=quiet.step_rounds, load=load)
    assert not cost.steady(busy)[0] and f"load average was {load:.1f}" in cost.steady(busy)[1]
    assert CostCurve((1.0,), 0.0, 0.05).spread() == 0.0 and cost.steady(CostCurve((1.0,), 0.0, 0.05))[0]
    measured = []

    def measure(target, draft, **kwargs):
        measured.append(kwargs)
        return [shaky, busy, quiet, None][len(measured) - 1]

    monkeypatch.setattr(cost, "measure_cost_curve", measure)
    monkeypatch.setattr(cost, "_key", lambda *args: "this machine")
    told = []
    for want in (shaky, busy, quiet, quiet):  # timed three times: the unsteady two serve their call and are not kept
        assert cost.cost_curve(None, None, max_tokens=3, announce=told.append) == want
    assert len(measured) == 3 and len(told) == 5  # "timing ..." three times, "not kept" twice
    assert "not kept: its rounds differ by 36%" in told[1] and f"not kept: the load average was {load:.1f}" in told[3]
    stored = json.loads((tmp_path / cost.COST_FILE).read_text())["this machine"]
    assert stored["step_rounds"] == [[1.05, 1.58], [1.15, 1.62]] and stored["load"] == 0.2


def test_another_configuration_replaces_the_default_only_where_every_round_agrees():
    expected = {1: 1.5, 2: 1.8, 3: 2.1}
    # medians (1.1, 1.5, 1.4): gamma 3 at 1.5 beats gamma 1's 1.364 by 10 %; the second round alone (1.31) does not
    split = CostCurve((1.0,) * 4, 0.05, 0.01, step_ratios=(1.1, 1.5, 1.4),
                      step_rounds=((1.1, 1.5, 1.2), (1.1, 1.5, 1.6)))
    assert [best_gamma(one, expected, incumbent=1, margin=0.05) for one in split.rounds()] == [3, 1]
    assert best_gamma(split, expected) == 3  # no incumbent: the medians decide
    assert best_gamma(split, expected, incumbent=1, margin=0.05) == 1
    agreed = CostCurve((1.0,) * 4, 0.05, 0.01, step_ratios=(1.1, 1.5, 1.3),
                       step_rounds=((1.1, 1.5, 1.2), (1.1, 1.5, 1.4)))
    assert best_gamma(agreed, expected, incumbent=1, margin=0.05) == 3
    taus = {shape: pair[0] for shape, pair in GENERATE_TREES.items()}
    steps, trees = (1.11, 1.25, 1.41), (((4, 4, 10), 1.78), ((8, 6, 32), 2.07))
    one_round_slow = CostCurve((1.0,) * 4, 0.1, 0.02, step_ratios=steps, tree_steps=trees,
                               step_rounds=(steps, steps), tree_rounds=((1.78, 2.07), (1.78, 2.8)))
    assert [best_config(one, GENERATE_TAU_GREEDY, taus, margin=0.10) for one in one_round_slow.rounds()] == [
        tree_options((8, 6, 32)), {"gamma": GENERATE_GAMMA}]
    assert best_config(one_round_slow, GENERATE_TAU_GREEDY, taus, margin=0.10) == {"gamma": GENERATE_GAMMA}
    both = CostCurve((1.0,) * 4, 0.1, 0.02, step_ratios=steps, tree_steps=trees, step_rounds=(steps, steps),
                     tree_rounds=((1.78, 2.07), (1.78, 2.07)))
    assert best_config(both, GENERATE_TAU_GREEDY, taus, margin=0.10) == tree_options((8, 6, 32))
    chains_in_rounds = CostCurve((1.0,) * 4, 0.1, 0.02, step_ratios=steps, tree_steps=trees, step_rounds=(steps, steps))
    assert best_config(chains_in_rounds, GENERATE_TAU_GREEDY, taus, margin=0.10) == tree_options((8, 6, 32))  # trees kept


def test_the_default_combined_draft_drafts_the_chosen_chains_length_off_a_match():
    """The curve weighs the wrapped draft's chains of each gamma, so a chosen chain sets the combined draft's
    off-match length (built by name it drafts one token there); a tree, a draft that always drafts the engine's gamma
    and a draft without the setting are left as they are."""
    from specresearch.drafts.combined import LookupOrDraft

    combined = LookupOrDraft(ToyLM(torch.randn(8, 8, generator=torch.Generator().manual_seed(0))), draft_gamma=1)
    combined.reset(1)
    combined.prefill(torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.long))  # no repeated suffix: no match
    assert combined.plan_length(3) == 1
    fit_default_draft(combined, {"gamma": 3})
    assert combined.draft_gamma == 3 and combined.plan_length(3) == 3
    fit_default_draft(combined, tree_options((2, 2, 3)))
    assert combined.draft_gamma == 3
    free = LookupOrDraft(ToyLM(torch.randn(8, 8)), draft_gamma=None)
    fit_default_draft(free, {"gamma": 2})
    assert free.draft_gamma is None
    plain = ToyLM(torch.randn(8, 8))
    fit_default_draft(plain, {"gamma": 2})
    assert not hasattr(plain, "draft_gamma")
