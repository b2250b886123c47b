"""draft_analysis: per-depth expected tokens and speed-ups, manifests of both kinds of draft, wall-clock tables."""

import json
from fractions import Fraction

import matplotlib

matplotlib.use("Agg")
import pandas as pd
import pytest

from specresearch.exact import theory
from specresearch.experiments.draft_analysis import (
    best_gammas,
    best_speedup,
    corpus_spans,
    expected_tokens,
    free_draft_rows,
    gamma1_costs,
    plot_acceptance_by_depth,
    plot_alpha_cost_tradeoff,
    plot_data_scaling,
    plot_speedup_by_category,
    plot_speedup_intervals,
    plot_speedup_vs_gamma,
    plot_tau_against_speed,
    pooled_speeds,
    read_draft_manifest,
    read_scaling,
    read_wallclock,
    speedup_curve,
    speedup_intervals,
    wallclock_table,
)
from specresearch.training.distill import drafts_dir


def test_expected_tokens_and_speedup_by_hand():
    assert expected_tokens([0.5, 0.4], 2) == pytest.approx(1 + 0.5 + 0.5 * 0.4)
    assert expected_tokens([0.5, 0.4], 0) == 1.0
    # gamma 1: 1.5 / 1.1 = 1.364; gamma 2: 1.7 / 1.2 = 1.417
    gamma, speedup = best_speedup([0.5, 0.4], 0.1)
    assert gamma == 2 and speedup == pytest.approx(1.7 / 1.2)
    assert best_speedup([0.5, 0.1], 0.1)[0] == 1  # 1.55 / 1.2 < 1.5 / 1.1


@pytest.mark.parametrize("alpha,c", [(0.3, 0.07), (0.8, 0.2)])
def test_a_constant_alpha_gives_leviathans_formula(alpha, c):
    for gamma in range(1, 6):
        assert expected_tokens([alpha] * 5, gamma) == pytest.approx(float(theory.expected_tokens(Fraction(str(alpha)), gamma)))
    best, speedup = best_speedup([alpha] * 5, c)
    assert speedup == pytest.approx(float(theory.walltime_improvement(Fraction(str(alpha)), best, Fraction(str(c)))))


def test_the_verification_cost_divides_the_prediction():
    # r_2 = 1.3, r_3 = 1.6: gamma 1 -> 1.5 / (1.3 + 0.1), gamma 2 -> 1.7 / (1.6 + 0.2)
    curve = speedup_curve([0.5, 0.4], 0.1, {1: 1.0, 2: 1.3, 3: 1.6})
    assert [g for g, _, _ in curve] == [1, 2]
    assert curve[0][2] == pytest.approx(1.5 / 1.4) and curve[1][2] == pytest.approx(1.7 / 1.8)
    assert best_speedup([0.5, 0.4], 0.1, {2: 1.3, 3: 1.6}) == (1, pytest.approx(1.5 / 1.4))
    with pytest.raises(ValueError, match=r"r_k for k = gamma \+ 1 at every gamma of \[1, 2\]"):
        speedup_curve([0.5, 0.4], 0.1, {2: 1.3})
    # only the gammas asked for: gamma 2 alone needs r_3 only
    assert speedup_curve([0.5, 0.4], 0.1, {3: 1.6}, gammas=[2]) == [(2, pytest.approx(1.7), pytest.approx(1.7 / 1.8))]
    with pytest.raises(ValueError, match=r"gammas must lie in 1..2"):
        speedup_curve([0.5, 0.4], 0.1, gammas=[3])
    # the loop's tokens per step in place of the product formula: gamma 1 -> 1.4 / (1.3 + 0.1)
    assert speedup_curve([0.5, 0.4], 0.1, {2: 1.3, 3: 1.6}, tokens_per_step=[1.4, 1.55])[0] == (1, 1.4, pytest.approx(1.0))
    with pytest.raises(ValueError, match="tokens_per_step"):
        speedup_curve([0.5, 0.4], 0.1, tokens_per_step=[1.4])


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="gamma"):
        expected_tokens([0.5], 2)
    with pytest.raises(ValueError, match="alphas"):
        expected_tokens([1.5], 1)
    with pytest.raises(ValueError, match="c must"):
        best_speedup([0.5], -1.0)


def _feature_manifest(tokens, alpha1, steps=10, sequences=None):
    return {"feature_head_config": {"name": "head"}, "corpus": {"generated_tokens": tokens, "sequences": sequences},
            "training": {"steps": steps}, "train_config": {"batch_size": 8},
            "cost": {"c": 0.07}, "finished": True,
            "measurement": {"alpha_by_depth": {t: [alpha1, alpha1 / 2] for t in ("0.2", "0.6", "1.0")},
                            "greedy_agreement_by_depth": [0.3, 0.2]}}


def _distilled_manifest(tokens, alpha):
    return {"draft_config": {"name": "lm"}, "corpus": {"generated_tokens": tokens}, "training": {"steps": 20}, "cost": {"c": 0.16},
            "finished": True, "measurement": {"alpha": {t: alpha for t in ("0.2", "0.6", "1.0")}, "greedy_agreement": 0.4}}


def test_manifests_of_both_kinds_read_into_one_shape(tmp_path):
    (tmp_path / "feature_2.json").write_text(json.dumps(_feature_manifest(2000, 0.2)))
    (tmp_path / "feature_1.json").write_text(json.dumps(_feature_manifest(1000, 0.1)))
    (tmp_path / "distill_1.json").write_text(json.dumps(_distilled_manifest(1000, 0.3)))
    (tmp_path / "unfinished.json").write_text(json.dumps({"finished": False, "corpus": {}}))
    lm = read_draft_manifest(tmp_path / "distill_1.json", depths=3)
    assert lm["kind"] == "distilled LM" and lm["alpha_by_depth"]["1.0"] == [0.3] * 3 and lm["greedy_by_depth"] == [0.4] * 3
    table = read_scaling(tmp_path)
    assert list(table["kind"]) == ["distilled LM", "feature", "feature"]
    assert list(table["tokens"]) == [1000, 1000, 2000] and list(table["alpha_T1.0"]) == [0.3, 0.1, 0.2]
    assert table["passes"].isna().all()  # the corpus does not say how many sequences it has
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "manifest.json").write_text(json.dumps(_feature_manifest(4000, 0.4, steps=100, sequences=80)))
    both = read_scaling(tmp_path, tmp_path / "more")  # a directory of manifests and a draft directory
    assert list(both["tokens"]) == [1000, 1000, 2000, 4000] and both["passes"].iloc[-1] == 10.0  # 100 steps x 8 / 80
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no finished"):
        read_scaling(tmp_path / "empty")
    with pytest.raises(ValueError, match="not a draft manifest"):
        read_scaling(tmp_path / "nothing")
    with pytest.raises(ValueError, match="at least one"):
        read_scaling()
    with pytest.raises(ValueError, match="not a draft manifest"):
        read_draft_manifest(tmp_path / "missing.json")


def test_a_continued_head_counts_the_tokens_and_steps_of_its_chain(tmp_path):
    """A head continued from a head that was itself continued: tokens and steps add up over the three
    disjoint chunk ranges, passes are None; overlapping ranges of one corpus raise."""
    def corpus(tokens, first, chunks, key="k"):
        return {"generated_tokens": tokens, "sequences": 64 * chunks, "chunks": chunks, "first_chunk": first, "cache_key": key}

    first = {"corpus": corpus(1000, 0, 2), "training_steps": 40}  # a record of an older run: no first_chunk key
    del first["corpus"]["first_chunk"]
    second = {"corpus": corpus(700, 2, 1), "training_steps": 30, "init_from": first}
    manifest = {**_feature_manifest(500, 0.3, steps=20), "init_from": second}
    manifest["corpus"] = corpus(500, 3, 1)
    (tmp_path / "m.json").write_text(json.dumps(manifest))
    m = read_draft_manifest(tmp_path / "m.json")
    assert (m["tokens"], m["steps"], m["passes"], m["continued"]) == (2200, 90, None, True)
    assert [(s["cache_key"], s["first_chunk"], s["end_chunk"]) for s in corpus_spans(manifest)] == [("k", 3, 4), ("k", 2, 3), ("k", 0, 2)]
    (tmp_path / "plain.json").write_text(json.dumps(_feature_manifest(500, 0.3, steps=20, sequences=80)))
    plain = read_draft_manifest(tmp_path / "plain.json")
    assert (plain["tokens"], plain["passes"], plain["continued"]) == (500, 2.0, False)
    second["corpus"] = corpus(700, 1, 2)  # chunks 1-2 overlap the first head's 0-1
    (tmp_path / "m.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="overlapping chunks"):
        read_draft_manifest(tmp_path / "m.json")
    second["corpus"] = corpus(700, 1, 2, key="another corpus")  # the same indices of another corpus do not overlap
    (tmp_path / "m.json").write_text(json.dumps(manifest))
    assert read_draft_manifest(tmp_path / "m.json")["tokens"] == 2200


@pytest.mark.parametrize("name", ["eagle3-v8k", "v8k-4l"])
def test_the_shipped_manifests_read(name):
    m = read_draft_manifest(drafts_dir() / name)
    assert m["name"] == name and 0 < m["c"] < 1 and m["tokens"] > 10_000
    assert all(0 < a < 1 for alphas in m["alpha_by_depth"].values() for a in alphas)


def test_wallclock_records_split_into_runs_and_score_costs(tmp_path):
    path = tmp_path / "w.jsonl"
    rows = [{"prompt": "a", "category": "code", "temperature": 0.0, "method": "autoregressive", "gamma": 0, "tokens": 4, "seconds": 1.0,
             "acceptance_rate": None},
            {"method": "target_score", "k": 1, "ms_before": 80.0, "ms_after": 100.0},
            {"method": "target_score", "k": 2, "ms_before": 120.0, "ms_after": 114.0},
            {"method": "machine", "cpu": "x", "cpu_count": 2}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs, cost = read_wallclock(path)
    assert list(runs["method"]) == ["autoregressive"] and cost == {1: 1.0, 2: pytest.approx(117 / 90)}
    path.write_text(json.dumps(rows[1]) + "\n")
    with pytest.raises(ValueError, match="no generation runs"):
        read_wallclock(path)


def test_wallclock_table_divides_summed_rates_by_the_baselines():
    rows = pd.DataFrame([
        {"temperature": 0.0, "method": "autoregressive", "gamma": 0, "tokens": 10, "seconds": 2.0, "acceptance_rate": None},
        {"temperature": 0.0, "method": "autoregressive", "gamma": 0, "tokens": 10, "seconds": 3.0, "acceptance_rate": None},
        {"temperature": 0.0, "method": "ngram", "gamma": 2, "tokens": 10, "seconds": 1.0, "acceptance_rate": 0.5},
        {"temperature": 0.0, "method": "ngram", "gamma": 2, "tokens": 10, "seconds": 1.5, "acceptance_rate": 0.7},
        {"temperature": 1.0, "method": "autoregressive", "gamma": 0, "tokens": 8, "seconds": 2.0, "acceptance_rate": None},
        {"temperature": 1.0, "method": "ngram", "gamma": 2, "tokens": 8, "seconds": 4.0, "acceptance_rate": 0.1},
    ])
    table = wallclock_table(rows).set_index(["temperature", "method"])
    assert table.loc[(0.0, "ngram"), "vs_autoregressive"] == pytest.approx((20 / 2.5) / (20 / 5.0))
    assert table.loc[(0.0, "ngram"), "acceptance_rate"] == pytest.approx(0.6)
    assert table.loc[(1.0, "ngram"), "vs_autoregressive"] == pytest.approx(0.5)
    assert table.loc[(1.0, "autoregressive"), "vs_autoregressive"] == 1.0
    with pytest.raises(ValueError, match="autoregressive baseline"):
        wallclock_table(rows[rows["method"] != "autoregressive"])


def test_free_draft_rows_keep_only_prefill_and_target_time_of_speculative_runs():
    """A speculative run of 10 tokens in 1.0 s, of which 0.1 s prefill and 0.6 s in the target: without the draft and the
    rest it would take 0.7 s. Autoregressive decoding (2.0 s) is kept as timed, so the ceiling is 2.0 / 0.7 against
    the measured 2.0 / 1.0."""
    rows = pd.DataFrame([
        {"temperature": 0.0, "prompt": "p", "method": "autoregressive", "gamma": 0, "tokens": 10, "seconds": 2.0,
         "prefill_seconds": 0.1, "target_seconds": 1.8},
        {"temperature": 0.0, "prompt": "p", "method": "head", "gamma": 1, "tokens": 10, "seconds": 1.0,
         "prefill_seconds": 0.1, "target_seconds": 0.6},
    ])
    free = free_draft_rows(rows)
    assert list(free["seconds"]) == pytest.approx([2.0, 0.7]) and list(rows["seconds"]) == [2.0, 1.0]  # a copy
    measured, ceiling = (speedup_intervals(r, n_boot=10)[0].iloc[0].speedup for r in (rows, free))
    assert (measured, ceiling) == pytest.approx((2.0, 2.0 / 0.7))
    with pytest.raises(ValueError, match="target_seconds"):
        free_draft_rows(rows.drop(columns="target_seconds"))


def test_speedup_intervals_resample_prompts_and_pair_the_methods():
    """Method a is exactly twice as fast as autoregressive decoding on every prompt, b 1.5x on two prompts and 2.5x on
    two: a's interval is the point 2.0; b's point is its pooled rate and its interval spans prompts of both kinds;
    a - b is paired, so its interval is b's mirrored (the resamples are the same draws)."""
    rows = []
    for i, ar_seconds in enumerate([1.0, 2.0, 1.0, 4.0]):
        rows.append({"temperature": 1.0, "prompt": f"p{i}", "method": "autoregressive", "gamma": 0, "tokens": 10, "seconds": ar_seconds})
        rows.append({"temperature": 1.0, "prompt": f"p{i}", "method": "a", "gamma": 1, "tokens": 10, "seconds": ar_seconds / 2})
        rows.append({"temperature": 1.0, "prompt": f"p{i}", "method": "b", "gamma": 3, "tokens": 10, "seconds": ar_seconds / (1.5 if i < 2 else 2.5)})
    rows = pd.DataFrame(rows)
    speedups, differences = speedup_intervals(rows, [(("a", 1), ("b", 3))], n_boot=400)
    a, b = (speedups.set_index("method").loc[m] for m in ("a", "b"))
    assert (a.speedup, a.low, a.high) == pytest.approx((2.0, 2.0, 2.0))
    assert b.speedup == pytest.approx(40 / (1 / 1.5 + 2 / 1.5 + 1 / 2.5 + 4 / 2.5) / (40 / 8))
    assert 1.5 <= b.low < b.speedup < b.high <= 2.5
    d = differences.iloc[0]
    assert (d.a, d.b) == ("a g1", "b g3") and d.difference == pytest.approx(2.0 - b.speedup)
    assert (d.low, d.high) == pytest.approx((2.0 - b.high, 2.0 - b.low))
    again = speedup_intervals(rows, n_boot=400)[0]
    assert again.equals(speedups)  # seeded
    with pytest.raises(ValueError, match="lacks some prompts"):
        speedup_intervals(rows.drop(index=[2]))
    with pytest.raises(ValueError, match="no autoregressive baseline"):
        speedup_intervals(rows[rows["method"] != "autoregressive"])
    with pytest.raises(ValueError, match=r"pairs: \[\('c', 1\)\]"):
        speedup_intervals(rows, [(("c", 1), ("a", 1))])
    assert list(speedups["method"]) == ["a", "b"] and b.speedup == pytest.approx(2.0)  # a tie: untie it to see the order
    fig = plot_speedup_intervals(speedups.assign(speedup=[2.0, 1.9]), {1.0: 1.15})  # one panel, slowest at the bottom, the target dashed
    ax, = fig.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["b (gamma 3)", "a (gamma 1)"]
    assert [line.get_xdata()[0] for line in ax.lines[-2:]] == [1.0, 1.15]
    with pytest.raises(ValueError, match=r"targets at temperatures \[0.0\]"):
        plot_speedup_intervals(speedups, {0.0: 1.25})


def test_plots_draw_one_line_per_draft_and_kind(tmp_path):
    drafts = [read_draft_manifest(drafts_dir() / n) for n in ("eagle3-v8k", "v8k-4l")]
    fig = plot_acceptance_by_depth(drafts)
    assert len(fig.axes) == 3 and all(len(ax.lines) == 2 for ax in fig.axes)
    (tmp_path / "f.json").write_text(json.dumps(_feature_manifest(1000, 0.1)))
    (tmp_path / "d.json").write_text(json.dumps(_distilled_manifest(1000, 0.3)))
    fig = plot_data_scaling(read_scaling(tmp_path))
    assert len(fig.axes[0].lines) == 3  # two kinds and the alpha = 0.5 line
    for name, tokens, steps, sequences in (("f5a", 1000, 60, 100), ("f5b", 2000, 115, 200), ("f9", 2000, 235, 200)):
        (tmp_path / f"{name}.json").write_text(json.dumps(_feature_manifest(tokens, 0.2, steps=steps, sequences=sequences)))
    fig = plot_data_scaling(read_scaling(tmp_path))  # 4.8 and 4.6 passes on one line, 9.4 on another, f.json on its own
    labels = sorted(line.get_label() for line in fig.axes[0].lines)
    assert labels == ["alpha = 0.5", "distilled LM", "feature", "feature, 4.7 passes", "feature, 9.4 passes"]
    continued = {**_feature_manifest(1500, 0.3, steps=50, sequences=100), "init_from": {
        "corpus": {"generated_tokens": 2000, "chunks": 2, "cache_key": "k"}, "training_steps": 235}}
    continued["corpus"].update(chunks=1, first_chunk=2, cache_key="k")
    (tmp_path / "c.json").write_text(json.dumps(continued))
    fig = plot_data_scaling(read_scaling(tmp_path))  # drawn as its own star at its chain's 3500 tokens, on no line
    stars = [line for line in fig.axes[0].lines if line.get_label() == "feature, continued from a saved head"]
    assert len(stars) == 1 and list(stars[0].get_xdata()) == [3500] and list(stars[0].get_ydata()) == [0.3]
    assert sorted(line.get_label() for line in fig.axes[0].lines) == sorted(labels + ["feature, continued from a saved head"])
    again = {**_feature_manifest(1000, 0.35, steps=40, sequences=100), "init_from": {**continued, "training_steps": 50}}
    again["corpus"].update(chunks=1, first_chunk=3, cache_key="k")
    (tmp_path / "a.json").write_text(json.dumps(again))  # continued again: 4500 tokens, read before c.json, drawn after it
    stars = [line for line in plot_data_scaling(read_scaling(tmp_path)).axes[0].lines if line.get_label().endswith("saved head")]
    assert list(stars[0].get_xdata()) == [3500, 4500] and list(stars[0].get_ydata()) == [0.3, 0.35]
    measured = pd.DataFrame([{"temperature": 1.0, "method": "eagle3-v8k", "gamma": 1, "vs_autoregressive": 0.8},
                             {"temperature": 1.0, "method": "ngram", "gamma": 1, "vs_autoregressive": 0.9}])
    fig = plot_speedup_vs_gamma(drafts, measured)
    assert len(fig.axes[0].lines) == 2 + 1 + 1 + 1  # two predicted curves, eagle3-v8k and ngram measured, the 1.0 line
    fig = plot_speedup_vs_gamma(drafts, measured, score_cost={1: 1.0, 2: 1.2, 3: 1.4})  # r known up to gamma 2
    solid = [line for line in fig.axes[0].lines if line.get_label().endswith("predicted, measured r")]
    assert len(solid) == 2 and all(list(line.get_xdata()) == [1, 2] for line in solid)
    fig = plot_speedup_vs_gamma(drafts, measured, score_cost={1: 1.0, 2: 1.2, 3: 1.4, 5: 1.6})  # gammas 1, 2, 4 timed
    solid = [line for line in fig.axes[0].lines if line.get_label().endswith("predicted, measured r")]
    assert all(list(line.get_xdata()) == [1, 2, 4] for line in solid)
    for d, line in zip(drafts, solid):  # E(4) / (r_5 + 4 c) at gamma 4, though r_4 was not timed
        alphas = d["alpha_by_depth"]["1.0"]
        assert line.get_ydata()[2] == pytest.approx(speedup_curve(alphas[:4], d["c"], {2: 1.6, 3: 1.6, 4: 1.6, 5: 1.6})[-1][2])
    looped = dict(drafts[0], loop_tokens_by_gamma={"1.0": [1.3, 1.35, 1.4, 1.42]})
    fig = plot_speedup_vs_gamma([looped], measured, score_cost={1: 1.0, 2: 1.2, 3: 1.4})
    dashed = [line for line in fig.axes[0].lines if "from the loop" in line.get_label()]
    assert len(dashed) == 1 and list(dashed[0].get_ydata()) == pytest.approx([1.3 / (1.2 + looped["c"]), 1.35 / (1.4 + 2 * looped["c"])])


def test_best_gammas_and_the_bars_per_category():
    """Each method's gamma is the best over all prompts at that temperature; one bar per (method, category + all)."""
    def run(category, method, gamma, seconds):
        return {"category": category, "temperature": 0.0, "method": method, "gamma": gamma, "tokens": 10, "seconds": seconds,
                "acceptance_rate": None if method == "autoregressive" else 0.5}

    rows = pd.DataFrame([run("code", "autoregressive", 0, 2.0), run("rag", "autoregressive", 0, 2.0),
                         run("code", "ngram", 1, 2.0), run("rag", "ngram", 1, 2.0),  # 1.0x over all prompts
                         run("code", "ngram", 4, 4.0), run("rag", "ngram", 4, 1.0),  # 0.8x: 0.5x on code, 2x on rag
                         run("code", "both", 1, 1.0), run("rag", "both", 1, 1.0)])
    assert best_gammas(wallclock_table(rows), 0.0) == {"ngram": 1, "both": 1}
    fig = plot_speedup_by_category(rows, 0.0)
    heights = [bar.get_height() for bar in fig.axes[0].patches]
    assert heights == pytest.approx([1.0, 1.0, 1.0, 2.0, 2.0, 2.0])  # ngram: code, rag, all; then both
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["ngram (gamma 1)", "both (gamma 1)"]
    with pytest.raises(ValueError, match="no runs at temperature"):
        plot_speedup_by_category(rows, 0.0, methods=["lookup"])
    with pytest.raises(ValueError, match="no speculative runs"):
        best_gammas(wallclock_table(rows), 1.0)


def test_gamma1_costs_put_a_run_in_units_of_one_autoregressive_token():
    """AR: 20 tokens in 2 s (0.1 s a token). Draft d at gamma 1: 20 tokens in 1.8 s over 16 steps with 0.16 s of
    drafting: c = 0.01 / 0.1, speed-up 2 / 1.8, and extra closes (1 + alpha) / speed-up = 1 + c + extra."""
    def run(method, gamma, seconds, steps=0, draft=0.0, alpha=None, temperature=1.0):
        return {"temperature": temperature, "method": method, "gamma": gamma, "tokens": 10, "seconds": seconds, "steps": steps,
                "draft_seconds": draft, "acceptance_rate": alpha}

    rows = pd.DataFrame([run("autoregressive", 0, 1.0, 10), run("autoregressive", 0, 1.0, 10),
                         run("d", 1, 0.9, 8, 0.08, 0.2), run("d", 1, 0.9, 8, 0.08, 0.3),
                         run("d", 3, 0.5, 4, 0.2, 0.9),  # another gamma: not in the table
                         run("autoregressive", 0, 5.0, 10, temperature=0.0)])
    costs = gamma1_costs(rows, 1.0).set_index("method").loc["d"]
    assert costs.alpha == pytest.approx(0.25) and costs.c == pytest.approx(0.1) and costs.speedup == pytest.approx(2 / 1.8)
    assert costs.extra == pytest.approx(1.25 * 1.8 / 2 - 1.1)
    with pytest.raises(ValueError, match="no gamma-1 runs"):
        gamma1_costs(rows, 0.0)
    with pytest.raises(ValueError, match="no autoregressive runs"):
        gamma1_costs(rows, 0.5)
    held_out = pd.DataFrame([{"label": "h", "alpha": 0.3, "c": 0.07}])
    fig = plot_alpha_cost_tradeoff(gamma1_costs(rows, 1.0), costs.extra, held_out)
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.lines if not line.get_label().startswith("_")] == [
        "held-out alpha, c timed off the loop", "d: 1.11x in the loop"]
    assert [t.get_text() for t in ax.texts if t.get_text() == "h"] == ["h"]
    two = pd.DataFrame([{"label": "a", "alpha": 0.3, "c": 0.07, "series": "short"}, {"label": "b", "alpha": 0.31, "c": 0.07, "series": "long"}])
    ax = plot_alpha_cost_tradeoff(gamma1_costs(rows, 1.0), costs.extra, two).axes[0]
    assert [line.get_label() for line in ax.lines if line.get_label().startswith("held-out")] == [
        "held-out alpha, c timed off the loop: short", "held-out alpha, c timed off the loop: long"]
    assert {t.get_text(): t.get_ha() for t in ax.texts if t.get_text() in ("a", "b")} == {"a": "left", "b": "right"}
    with pytest.raises(ValueError, match="extra must be > -1"):
        plot_alpha_cost_tradeoff(gamma1_costs(rows, 1.0), -1.0)


def test_tau_against_speed_draws_the_runs_that_covered_every_prompt():
    rows = pd.DataFrame([{"prompt_id": p, "temperature": t, "run": run, "tau": tau + p, "vs_autoregressive": vs + p}
                         for t in (0.0, 1.0) for p in (0, 1)
                         for run, tau, vs in (("chain block g1", 1.5, 1.3), ("dynamic K4 g4 n10", 2.5, 1.1))]
                        + [{"prompt_id": 0, "temperature": 0.0, "run": "traversal K2 g2", "tau": 1.8, "vs_autoregressive": 1.0}])
    fig, points = plot_tau_against_speed({"cpu": (rows, "o"), "gpu": (rows.assign(vs_autoregressive=2.0), "^")},
                                         labelled=["gpu"])
    assert len(points) == 8 and "traversal K2 g2" not in set(points.run)  # one prompt of two: not drawn
    chain = points[(points.source == "cpu") & (points.temperature == 0.0)].set_index("run").loc["chain block g1"]
    assert (chain.tau, chain.vs) == pytest.approx((2.0, 1.8))  # mean tau, median speed over the two prompts
    left, right = fig.axes[:2]
    assert len(left.texts) == len(right.texts) == 2  # only the labelled source's two runs carry names
    assert [h.get_label() for h in fig.legends[0].legend_handles][:2] == ["cpu", "gpu"]


def test_pooled_speeds_sum_prompts_and_repeats_against_their_paired_autoregressive_runs():
    rows = pd.DataFrame({"prompt_id": ["a", "a", "b", "a", "b"], "temperature": [0.0] * 4 + [1.0],
                         "run": ["g1", "g1", "g1", "g2", "g1"], "seconds": [1.0, 1.0, 2.0, 4.0, 1.0],
                         "tokens": [10, 10, 10, 10, 10], "ar_seconds": [2.0, 2.0, 2.0, 2.0, 3.0],
                         "ar_tokens": [10, 10, 10, 10, 10]})
    table = pooled_speeds(rows, n_boot=200).set_index(["temperature", "run"])
    # g1 at T = 0: prompt a twice (2 s of its runs against 4 s of autoregressive), b once (2 s against 2 s): 6 / 4
    assert table.loc[(0.0, "g1"), "pooled"] == pytest.approx(1.5) and table.loc[(0.0, "g1"), "prompts"] == 2
    assert table.loc[(0.0, "g1"), "low"] <= 1.5 <= table.loc[(0.0, "g1"), "high"]
    assert table.loc[(0.0, "g2"), "pooled"] == pytest.approx(0.5)
    assert table.loc[(1.0, "g1"), "pooled"] == pytest.approx(3.0)
    by_run = pooled_speeds(rows, by=("run",), n_boot=200).set_index("run")  # one grouping column: keys by name
    assert by_run.loc["g1", "pooled"] == pytest.approx(9 / 5)
