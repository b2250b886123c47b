"""The machine's cost curve and the default gamma it picks (``engine.cost``). Timings are never asserted: the tests
check the arithmetic on given curves, the cache's round trip and what the CLI does with the choice."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from specresearch.config import GENERATE_TAU
from specresearch.engine import cost
from specresearch.engine.cost import CostCurve, best_gamma, predicted_speedup
from specresearch.models.toy import tiny_llama
from specresearch.paths import repo_root


def test_the_default_taus_are_the_records():
    frame = pd.read_csv(repo_root() / "benchmarks" / "records" / "adaptive_amd.csv")
    means = frame[frame.temperature == 1.0].groupby("run").tau.mean()
    assert {g: round(means[f"gamma {g}"], 3) for g in GENERATE_TAU} == GENERATE_TAU


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
    target, draft = tiny_llama(48, seed=0), tiny_llama(48, seed=1)
    told = []
    curve = cost.cost_curve(target, draft, max_tokens=3, announce=told.append)
    assert len(told) == 1 and str(tmp_path / cost.COST_FILE) in told[0]  # the CLI prints it before the wait
    assert len(curve.ratios) == 3 and curve.ratios[0] == 1.0 and curve.draft_ratio > 0 and curve.target_seconds > 0
    assert len(curve.step_ratios) == 2 and all(r > 0 for r in curve.step_ratios)
    stored = json.loads((tmp_path / cost.COST_FILE).read_text())
    assert len(stored) == 1 and next(iter(stored.values()))["ratios"] == list(curve.ratios)

    def refuse(*args, **kwargs):
        raise AssertionError("timed again although the machine's answer was kept")

    monkeypatch.setattr(cost, "measure_cost_curve", refuse)
    assert cost.cost_curve(target, draft, max_tokens=3, announce=told.append) == curve and len(told) == 1
    with pytest.raises(AssertionError, match="timed again"):
        cost.cost_curve(target, draft, max_tokens=4)  # another question: timed anew
    assert cost.default_gamma(target, draft, {1: 1.5, 2: 1.8}) in (1, 2)


def test_another_gamma_replaces_the_measured_default_only_by_the_margin():
    expected = {1: 1.5, 2: 1.8, 3: 2.1}
    close = CostCurve((1.0,) * 5, 0.05, 0.01, step_ratios=(1.1, 1.5, 1.45))  # 1.364, 1.2, 1.448: gamma 3 by 6 %
    assert best_gamma(close, expected) == 3
    assert best_gamma(close, expected, incumbent=1, margin=0.10) == 1
    assert best_gamma(close, expected, incumbent=1, margin=0.05) == 3
    flat = CostCurve((1.0,) * 5, 0.05, 0.01, step_ratios=(1.05, 1.10, 1.15))  # a GPU at small batch: gamma 3 by 27 %
    assert best_gamma(flat, expected, incumbent=1, margin=0.10) == 3


def test_the_default_gamma_is_the_measured_one_unless_the_machine_says_otherwise(monkeypatch):
    from specresearch.config import GENERATE_GAMMA, GENERATE_MARGIN

    close = CostCurve((1.0,) * 4, 0.05, 0.01, step_ratios=(1.1, 1.5, 1.45))
    flat = CostCurve((1.0,) * 4, 0.05, 0.01, step_ratios=(1.05, 1.10, 1.15))
    for curve, want in ((close, GENERATE_GAMMA), (flat, 3)):
        monkeypatch.setattr(cost, "cost_curve", lambda *args, curve=curve, **kwargs: curve)
        assert cost.default_gamma(None, None, {1: 1.5, 2: 1.8, 3: 2.1}) == want
    assert cost.MARGIN == GENERATE_MARGIN


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


def test_auto_resolves_to_the_machines_gamma_for_chains_only(monkeypatch):
    from specresearch.config import GENERATE_GAMMA

    monkeypatch.setattr(cost, "default_gamma", lambda target, draft, **kwargs: 4)
    assert cost.resolve_gamma(3, None, None) == 3  # a count is kept
    assert cost.resolve_gamma("auto", None, None) == 4
    assert cost.resolve_gamma("auto", None, None, num_drafts=2) == GENERATE_GAMMA
    assert cost.resolve_gamma("auto", None, None, stop_below=0.5) == GENERATE_GAMMA
