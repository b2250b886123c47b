"""The block-vs-token sweep (specresearch.experiments.bench) and its analysis (specresearch.experiments.analysis), on toy models.

Statistical assertions use fixed seeds; each states its false-positive rate (probability that a correct
implementation fails), always < 1e-6, from a normal approximation with an upper bound on the standard
error. The sweeps on i.i.d. toy models run ~10 s in all (one torch thread, see conftest).
"""

import json
import os
import sys
from fractions import Fraction

import numpy as np
import pandas as pd
import pytest
import torch

from specresearch import exact
from specresearch.config import SamplingConfig
from specresearch.core.sampling import sample_tokens
from specresearch.core.verify import VERIFIERS
from specresearch.drafts.registry import truncated_draft
from specresearch.engine.generate import speculative_generate
from specresearch.exact import theory
from specresearch.experiments import analysis, bench
from specresearch.experiments.bench import BenchConfig, BenchPrompt, run_bench
from specresearch.experiments.records import (
    AUTOREGRESSIVE,
    RECORD_COLUMNS,
    machine_info,
    write_run_info,
)
from specresearch.models.toy import ToyLM, tiny_llama


def _toy(probs) -> ToyLM:
    """An i.i.d. ToyLM whose next-token law is ``probs`` (exact zeros allowed)."""
    return ToyLM(torch.tensor([float(p) for p in probs]).log())


def _prompts(count: int, token_ids=(0,)) -> list[BenchPrompt]:
    return [BenchPrompt(f"toy-{i:02d}", "toy" if i % 2 else "toy-b", tuple(token_ids)) for i in range(count)]


@pytest.fixture(scope="module")
def two_symbol(tmp_path_factory):
    """Token and block verification of the two-symbol post's pair p = (1/3, 2/3), q = (2/3, 1/3) at T = 1, gamma = 4:
    40 prompts x 240 tokens (~3700 token steps, ~3150 block steps)."""
    target, draft = exact.two_symbol_example()
    config = BenchConfig(temperatures=(1.0,), gammas=(4,), max_new_tokens=240)
    path = tmp_path_factory.mktemp("bench") / "two_symbol.csv"
    records = run_bench(_toy(target), _toy(draft), _prompts(40), config, path, progress=False)
    return records, target, draft


def test_sampling_advances_the_generator_independently_of_the_probabilities():
    """The CRN claim of bench's docstring: drafting consumes the same randomness whatever q is."""
    for vocab in (2, 5, 64):
        g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        for _ in range(4):
            sample_tokens(torch.softmax(torch.randn(1, vocab), -1), g1)
            sample_tokens(torch.softmax(3 * torch.randn(1, vocab), -1), g2)
        assert torch.equal(g1.get_state(), g2.get_state())


def _tiny_pair():
    """A 2-layer random tiny Llama and its first layer as draft (shared embeddings: they often agree)."""
    target = tiny_llama(48, seed=0, init_std=0.5)
    return target, truncated_draft(target, 1)


def test_t0_token_and_block_give_identical_outputs(tmp_path):
    target, draft = _tiny_pair()
    prompts = [BenchPrompt(f"p{i}", "c", tuple(range(1 + i, 6 + 2 * i))) for i in range(4)]
    config = BenchConfig(temperatures=(0.0,), gammas=(2, 3), max_new_tokens=12)
    records = run_bench(target, draft, prompts, config, tmp_path / "t0.csv", progress=False)
    spec = analysis.speculative_records(records)
    assert analysis.t0_agreement(records) == (8, 8)
    assert spec["accepted_tokens"].sum() > 0 and (spec["examined_drafts"] > spec["accepted_tokens"]).any()
    assert (spec["shared_steps"] == spec["target_calls"]).all()
    assert (spec["common_prefix_tokens"] == spec["new_tokens"]).all()
    baseline = records[records["verifier"] == AUTOREGRESSIVE].set_index("prompt_id")["output_hash"]
    assert (spec["output_hash"].to_numpy() == baseline.loc[spec["prompt_id"]].to_numpy()).all()  # = greedy


def _recording(name: str, log: list):
    def verify(target_probs, draft_probs, draft_tokens, generator=None, *, uniforms=None, validate=True):
        log.append((draft_tokens.clone(), uniforms.clone()))
        return VERIFIERS[name](target_probs, draft_probs, draft_tokens, generator, uniforms=uniforms, validate=validate)
    return verify


def test_common_random_numbers_are_shared_as_documented(tmp_path):
    """Same (prompt, seed): uniforms equal at every step; drafts equal on the first ``shared_steps`` steps."""
    target, draft = _tiny_pair()
    prompts = [BenchPrompt(f"p{i}", "c", (3 + i, 7, 11)) for i in range(3)]
    config = BenchConfig(temperatures=(1.0,), gammas=(3,), max_new_tokens=16)
    records = analysis.speculative_records(run_bench(target, draft, prompts, config, tmp_path / "crn.csv",
                                                     progress=False)).set_index(["prompt_id", "verifier"])
    for prompt in prompts:
        logs = {"token": [], "block": []}
        for name, log in logs.items():
            out = speculative_generate(target, draft, [list(prompt.token_ids)], verifier=_recording(name, log),
                                       gamma=3, max_new_tokens=16, sampling=SamplingConfig(temperature=1.0),
                                       seed=[bench.run_seed(prompt.id, 0)])
            assert bench._output_hash(out.tokens[0]) == records.loc[(prompt.id, name), "output_hash"]
        pairs = list(zip(logs["token"], logs["block"]))
        assert all(torch.equal(a[1], b[1]) for a, b in pairs)  # the streams stay aligned
        shared = int(records.loc[(prompt.id, "token"), "shared_steps"])
        assert shared >= 1 and shared == int(records.loc[(prompt.id, "block"), "shared_steps"])
        assert all(torch.equal(a[0], b[0]) for a, b in pairs[:shared])


def test_block_gain_is_positive_at_t1(two_symbol):
    """Exact BE: token 211/81 = 2.605, block 247/81 = 3.049, gain +17.06% (exact.block_efficiency).

    Standard error of the BE difference <= sd_token / sqrt(steps_token) + sd_block / sqrt(steps_block)
    (sd 1.51 and 1.74 from the exact step laws) = 0.056 tokens at ~9600 tokens per verifier, i.e. 2.2
    points of relative gain. The interval's lower end is <= 0 only if the estimate falls more than 6 such
    errors below its mean, and the estimate misses the exact gain by 12 points only at > 5.4 errors:
    false-positive rate < 1e-7 (normal approximation).
    """
    records, target, draft = two_symbol
    block, token = (exact.block_efficiency(target, draft, 4, method) for method in ("block", "token"))
    exact_gain = float(block / token - 1)
    row = analysis.gain_table(records, metrics=("be",), n_boot=1000, seed=0).iloc[0]
    message = f"BE gain {row.be_gain:+.2%} [{row.be_gain_lo:+.2%}, {row.be_gain_hi:+.2%}], exact {exact_gain:+.2%}"
    print(message)
    assert row.be_gain_lo > 0, message
    assert abs(row.be_gain - exact_gain) < 0.12, message
    assert row.be_gain_lo <= row.be_gain <= row.be_gain_hi


def _check_closed_form(records, alpha: Fraction, gamma: int, tolerance: float, alpha_tolerance: float) -> None:
    table = analysis.metric_table(records[records["verifier"] == "token"], metrics=("be", "alpha"), n_boot=10)
    row = table.iloc[0]
    assert abs(row.be - float(theory.expected_tokens(alpha, gamma))) < tolerance, row
    assert abs(row.alpha - float(alpha)) < alpha_tolerance, row
    assert abs(row.be - float(theory.expected_tokens(Fraction(row.alpha), gamma))) < 2 * tolerance, row


def test_token_be_matches_closed_form_two_symbol(two_symbol):
    """alpha = 2/3, gamma = 4: BE = 211/81. ~3700 steps, sd 1.51: SE 0.025, tolerance 0.15 = 6 SE; alpha SE
    <= sqrt(2/9 / 8000) = 0.0053, tolerance 0.04 = 7.5 SE. False-positive rate < 1e-8."""
    records, target, draft = two_symbol
    alpha = theory.acceptance_rate(target, draft)
    assert alpha == Fraction(2, 3)
    _check_closed_form(records, alpha, 4, 0.15, 0.04)


def test_token_be_matches_closed_form_with_zero_probabilities(tmp_path):
    """theory.iid_example(1/2): p = (1/2, 1/2, 0), q = (1/2, 0, 1/2), gamma = 3, BE = 15/8. 40 x 150 tokens
    = ~3200 steps, sd 1.05: SE 0.019, tolerance 0.12 = 6.4 SE; alpha SE <= sqrt(1/4 / 5000) = 0.0071,
    tolerance 0.04 = 5.6 SE. False-positive rate < 1e-7."""
    target, draft = theory.iid_example(Fraction(1, 2))
    config = BenchConfig(verifiers=("token",), temperatures=(1.0,), gammas=(3,), max_new_tokens=150)
    records = run_bench(_toy(target), _toy(draft), _prompts(40), config, tmp_path / "iid.csv", progress=False)
    _check_closed_form(records, Fraction(1, 2), 3, 0.12, 0.04)


def test_records_are_resumable(tmp_path):
    config = BenchConfig(temperatures=(0.0, 1.0), gammas=(1, 2), max_new_tokens=10)
    target, draft = _toy([0.5, 0.3, 0.2]), _toy([0.2, 0.3, 0.5])
    path = tmp_path / "resume.csv"
    first = run_bench(target, draft, _prompts(3), config, path, progress=False)
    assert len(first) == 3 * 2 * (1 + 2 * 2) and list(first.columns) == list(RECORD_COLUMNS)
    content = path.read_text()
    again = run_bench(target, draft, _prompts(3), config, path, progress=False)
    assert path.read_text() == content and len(again) == len(first)
    lines = content.splitlines()
    path.write_text("\n".join(lines[:-3]) + "\n")  # lose the last rows, as a crash would
    resumed = run_bench(target, draft, _prompts(3), config, path, progress=False)
    keys = ["prompt_id", "verifier", "temperature", "gamma", "seed"]
    assert len(resumed) == len(first) and not resumed.duplicated(keys).any()
    assert set(map(tuple, resumed[keys].to_numpy())) == set(map(tuple, first[keys].to_numpy()))


def _synthetic() -> pd.DataFrame:
    """4 prompts, one (T, gamma): token BE = 36/16, block BE = 44/16; WS token 2, block 2.5 (block 0.8x time)."""
    rows = []
    for i, accepted in enumerate([2, 4, 6, 8]):
        for verifier, extra, seconds in (("token", 0, 1.0 + i), ("block", 2, 0.8 * (1.0 + i))):
            rows.append({"run_id": "s", "prompt_id": f"p{i}", "category": "c", "verifier": verifier,
                         "temperature": 1.0, "gamma": 4, "seed": 0, "new_tokens": 10, "target_calls": 4,
                         "draft_calls": 16, "accepted_tokens": accepted + extra, "examined_drafts": accepted + 2,
                         "seconds": seconds, "ar_seconds": 2.0 * (1.0 + i), "ar_tokens": 10, "output_hash": "x"})
    return pd.DataFrame(rows)


def test_analysis_point_estimates_and_paired_bootstrap():
    records = _synthetic()
    table = analysis.metric_table(records, n_boot=500, seed=1).set_index("verifier")
    assert table.loc["token", "be"] == pytest.approx(36 / 16) and table.loc["block", "be"] == pytest.approx(44 / 16)
    assert table.loc["token", "ws"] == pytest.approx(2.0) and table.loc["block", "ws"] == pytest.approx(2.5)
    assert table.loc["token", "alpha"] == pytest.approx(20 / 28)
    assert (table["be_lo"] <= table["be"]).all() and (table["be"] <= table["be_hi"]).all()
    assert table.loc["token", "be_lo"] < table.loc["token", "be_hi"]  # prompts differ: a real interval
    gain = analysis.gain_table(records, n_boot=500, seed=1).iloc[0]
    assert gain.be_gain == pytest.approx(44 / 36 - 1) and gain.ws_gain == pytest.approx(0.25)
    # Block time is 0.8x token time on every prompt: every paired resample gives exactly +25%.
    assert gain.ws_gain_lo == pytest.approx(0.25) and gain.ws_gain_hi == pytest.approx(0.25)
    again = analysis.gain_table(records, n_boot=500, seed=1).iloc[0]
    assert again.be_gain_lo == gain.be_gain_lo and again.be_gain_hi == gain.be_gain_hi  # seeded
    paper = analysis.paper_table(records, n_boot=200)
    assert paper.loc[0, "be_block"] == pytest.approx(44 / 16) and "BE gain" in analysis.format_paper_table(paper)


def test_bootstrap_weights_resample_prompts():
    weights = analysis.bootstrap_weights(7, n_boot=300, seed=2)
    assert weights.shape == (300, 7) and (weights.sum(1) == 7).all()
    assert np.array_equal(weights, analysis.bootstrap_weights(7, n_boot=300, seed=2))


def test_config_and_prompt_selection_validate():
    with pytest.raises(ValueError, match="gammas"):
        BenchConfig(gammas=(0,))
    with pytest.raises(ValueError, match="temperatures"):
        BenchConfig(temperatures=(-0.1,))
    with pytest.raises(ValueError, match="verifiers"):
        BenchConfig(verifiers=("tokn",))
    assert BenchConfig.from_name("quick").gammas == (2, 4)
    prompts = [{"id": f"{c}-{i}", "category": c, "turns": ["x"]} for c in "abc" for i in range(4)]
    assert [p["id"] for p in bench.select_prompts(prompts, num_prompts=3)] == ["a-0", "b-0", "c-0"]
    assert [p["id"] for p in bench.select_prompts(prompts, ["b"], 2)] == ["b-0", "b-2"]
    with pytest.raises(ValueError, match="categories"):
        bench.select_prompts(prompts, ["z"])


def test_cli_builds_the_bench_command():
    from specresearch.cli import build_parser

    args = build_parser().parse_args(["bench", "--quick", "--gammas", "2", "8", "--prompts", "7"])
    assert args.func.__name__ == "_run_bench" and args.gammas == [2, 8] and args.prompts == 7


def test_expected_be_matches_exact_two_symbol(two_symbol):
    """The per-step expected counts (both verifiers, on the steps of both runs) average to the exact BE.

    The model is i.i.d., so each step's block is drawn afresh from q and its E[accepted | block] (in [0, 4])
    are independent across steps: Hoeffding at 1e-8 per verifier gives the tolerance (false-positive rate
    < 2e-8). The expected gain's interval is also narrower than the realised one (the uniforms' noise is
    integrated out); that is checked on these seeded records, not as a probability statement.
    """
    records, target, draft = two_symbol
    row = analysis.expected_gain_table(records, n_boot=1000, seed=0).iloc[0]
    tolerance = 4 * np.sqrt(np.log(2 / 1e-8) / (2 * row.steps))
    for method in ("token", "block"):
        assert abs(row[f"be_{method}_exp"] - float(exact.block_efficiency(target, draft, 4, method))) < tolerance, row
    assert row.alpha_overlap == pytest.approx(2 / 3)  # sum_x min(p, q) is the same at every position
    realised = analysis.gain_table(records, metrics=("be",), n_boot=1000, seed=0).iloc[0]
    assert row.exp_gain_hi - row.exp_gain_lo < realised.be_gain_hi - realised.be_gain_lo
    assert row.exp_gain_lo > 0


def test_two_symbol_gain_is_exact():
    token, block = analysis.two_symbol_gain(2 / 3, 4)
    target, draft = exact.two_symbol_example()  # p = (1/3, 2/3), q = (2/3, 1/3): the family at alpha = 2/3
    assert token == pytest.approx(float(exact.block_efficiency(target, draft, 4, "token")), abs=1e-12)
    assert block == pytest.approx(float(exact.block_efficiency(target, draft, 4, "block")), abs=1e-12)
    assert analysis.two_symbol_gain(1.0, 8) == pytest.approx((9.0, 9.0))


@pytest.mark.parametrize("verifiers", [("token",), ("block",), ("token", "block")])
def test_summary_for_any_subset_of_verifiers(tmp_path, verifiers):
    """What ``specresearch bench`` prints at the end: never a traceback for a subset of verifiers."""
    config = BenchConfig(verifiers=verifiers, temperatures=(0.0, 1.0), gammas=(2, 3), max_new_tokens=12)
    records = run_bench(_toy([0.5, 0.3, 0.2]), _toy([0.2, 0.3, 0.5]), _prompts(3), config, tmp_path / "s.csv",
                        progress=False)
    text = analysis.summary(records, n_boot=50)
    assert "Expected BE given each drafted block" in text and "be_block_exp" in text
    assert ("BE gain" in text) == (len(verifiers) == 2)
    if len(verifiers) == 1:
        assert f"| {verifiers[0]} |" in text and "ws" in text
    assert "(3 prompts: intervals from resampling so few cover well below 95 %)" in text  # < FEW_PROMPTS
    many = pd.concat([records.assign(prompt_id=records["prompt_id"] + f"-{k}") for k in range(4)])  # 12 prompts
    assert "intervals from resampling so few" not in analysis.summary(many, n_boot=50)


def test_batched_sweep_matches_one_prompt_at_a_time(tmp_path):
    """Per-row seeds: the batched records equal the timed ones (tokens, counts, expectations up to float)."""
    target, draft = _tiny_pair()
    prompts = [BenchPrompt(f"p{i}", "c", tuple(range(i + 1, i + 5 + i))) for i in range(3)]
    config = BenchConfig(temperatures=(1.0,), gammas=(3,), max_new_tokens=10)
    batched = bench.run_batched(target, draft, prompts, config, tmp_path / "b.csv", progress=False)
    records = run_bench(target, draft, prompts, config, tmp_path / "u.csv", progress=False)
    single = records[records["verifier"] != AUTOREGRESSIVE]
    keys = ["prompt_id", "verifier"]
    left, right = batched.set_index(keys).sort_index(), single.set_index(keys).sort_index()
    assert len(left) == 6 and (left["batch"] == 3).all() and left["seconds"].isna().all()
    for column in ("output_hash", "accepted_tokens", "target_calls", "shared_steps"):
        assert (left[column] == right[column]).all(), column
    for column in ("expected_token", "expected_block", "overlap_sum"):
        np.testing.assert_allclose(left[column], right[column], rtol=1e-4)
    again = bench.run_batched(target, draft, prompts, config, tmp_path / "b.csv", progress=False)
    assert len(again) == 6  # resumed: nothing run twice


def test_records_of_an_older_format_are_not_appended_to(tmp_path):
    path = tmp_path / "old.csv"
    path.write_text(",".join(RECORD_COLUMNS[:-4]) + "\n")
    with pytest.raises(ValueError, match="other columns"):
        run_bench(_toy([0.5, 0.5]), _toy([0.5, 0.5]), _prompts(1), BenchConfig(temperatures=(1.0,), gammas=(1,),
                  max_new_tokens=2), path, progress=False)


def test_cli_bench_accepts_a_batched_dial_sweep():
    from specresearch.cli import build_parser

    args = build_parser().parse_args(["bench", "--draft", "dial-mix:0.5", "--verifiers", "token", "--batched"])
    assert args.batched and args.draft == "dial-mix:0.5" and args.verifiers == ["token"]


def test_score_seconds_times_every_k_and_leaves_the_context_as_it_found_it():
    """A benchmark helper: no timing is asserted, only that each k is timed and every call was rolled back."""
    from specresearch.models.toy import tiny_llama

    lm = tiny_llama(32)
    seconds = bench.score_seconds(lm, (1, 2, 3), context_length=8, repeats=2, warmup=1)
    assert sorted(seconds) == [1, 2, 3] and all(s > 0 for s in seconds.values())
    assert lm.cache_length == 8
    with pytest.raises(ValueError, match="ks must be"):
        bench.score_seconds(lm, (0, 1))


def test_machine_info_names_the_cpu_and_torch(tmp_path):
    """What a timing depends on besides the code is recorded beside it (wall-clock records, run info)."""
    info = machine_info()
    assert isinstance(info["cpu"], str) and info["cpu"] and info["cpu_count"] == os.cpu_count()
    assert info["torch"] == torch.__version__ and info["torch_threads"] == torch.get_num_threads()
    assert set(info["cpu_flags"]) <= {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"}
    session, = json.loads(write_run_info(tmp_path / "run.jsonl", draft="d").read_text())
    assert session["draft"] == "d" and session["cpu"] == info["cpu"] and "started" in session


def test_per_machine_caches_tell_cpus_of_one_name_apart(monkeypatch):
    """Two CPUs named alike ("AMD EPYC", with and without AVX-512) get different cache keys (paths.cpu_key, which the
    skinny-rows answer, the cost curve and the compiled kernel's file use): timed or built again, not reused."""
    from specresearch import paths
    from specresearch.models import kernels

    keys = {}
    for flags in ("fpu sse2 avx2", "fpu sse2 avx2 avx512f avx512_bf16"):
        monkeypatch.setattr(paths, "cpu_fields", lambda flags=flags: {"model name": "AMD EPYC", "flags": flags})
        keys[flags] = (paths.cpu_key(), kernels._machine_key((((4, 4),), 1)))
    (avx2, avx2_rows), (avx512, avx512_rows) = keys.values()
    assert avx2.startswith("AMD EPYC flags ") and avx2 != avx512 and avx2_rows != avx512_rows
    monkeypatch.setattr(paths, "cpu_fields", lambda: {})
    assert paths.cpu_key() == paths.cpu_name()


def test_record_files_keep_dots_in_the_stem(tmp_path):
    """A benchmark's ``--out`` stem named after a draft such as ``dial-mix:0.5`` keeps its text after the dot (Path's
    ``with_suffix`` would have cut ``trees_dial-mix0.5_amd`` to ``trees_dial-mix0``); a given ending is dropped."""
    from specresearch.experiments.records import record_files

    stem = tmp_path / "trees_dial-mix0.5_amd"
    assert record_files(stem) == (tmp_path / "trees_dial-mix0.5_amd.csv", tmp_path / "trees_dial-mix0.5_amd.json")
    assert record_files(f"{stem}.csv") == record_files(stem) == record_files(f"{stem}.json")


def test_a_json_record_is_written_where_asked_in_its_folder(tmp_path):
    """``write_json_record`` makes the record's folder and writes the object that reads back, indented or on one line."""
    from specresearch.experiments.records import write_json_record

    record = {"command": "benchmarks/x.py", "rows": [{"a": 1, "b": [0.5, None]}]}
    path = write_json_record(tmp_path / "new" / "deeper" / "x.json", record)
    assert json.loads(path.read_text()) == record and len(path.read_text().splitlines()) > 2
    flat = write_json_record(tmp_path / "flat.json", record, indent=None).read_text()
    assert flat.endswith("\n") and flat.count("\n") == 1 and json.loads(flat) == record


def test_a_record_header_names_command_commit_machine_and_weights():
    """Every record's header: the command as typed, the checkout's commit, the machine, and a sha256 per shipped
    weight file the draft name uses (none for weightless drafts)."""
    import subprocess

    from specresearch.drafts.registry import shipped_drafts
    from specresearch.experiments.records import record_header

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    header = record_header("benchmarks/x.py", ["--prompt", "a b"], draft="ngram", seed=3)
    assert header["command"] == "benchmarks/x.py --prompt 'a b'" and header["commit"] in (head, f"{head}+dirty")
    assert header["machine"]["cpu"] == machine_info()["cpu"] and header["seed"] == 3
    assert header["draft_sha256"] == {}
    name = sorted(shipped_drafts())[0]
    digests = record_header("benchmarks/x.py", [], draft=f"ngram+{name}")["draft_sha256"]
    assert list(digests) == [name] and len(digests[name]) == 16  # store.draft_digest: 16 hex digits of sha256
    assert "draft" not in record_header("benchmarks/x.py", [])
    import hashlib
    import importlib.metadata

    from specresearch.models.embedded import EMBEDDED, _wheel_dir

    spec = EMBEDDED["smollm2-135m-instruct"]
    gguf = hashlib.sha256((_wheel_dir(spec) / spec.gguf_file).read_bytes()).hexdigest()[:16]
    assert header["target"] == "smollm2-135m-instruct" and header["target_sha256"] == gguf
    assert header["machine"]["transformers"] == importlib.metadata.version("transformers")
    assert "target_sha256" not in record_header("benchmarks/x.py", [], target=None)


def test_a_record_names_a_checkout_with_uncommitted_code_dirty(tmp_path, monkeypatch):
    """``git_commit``: the short hash of HEAD; ``+dirty`` where a tracked file of code differs from it; a changed
    record or page leaves it clean (runs write records, and the prose says nothing a run computes)."""
    import shutil
    import subprocess

    from specresearch.experiments import records

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              capture_output=True, text=True, check=True).stdout.strip()

    for path in ("specresearch/mod.py", "benchmarks/records/r.json", "docs/page.md", "README.md"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("0\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "x")
    head = git("rev-parse", "--short", "HEAD")
    monkeypatch.setattr("specresearch.paths.repo_root", lambda: tmp_path)
    monkeypatch.delenv("SPECRESEARCH_COMMIT", raising=False)
    for path in ("benchmarks/records/r.json", "docs/page.md", "README.md"):
        (tmp_path / path).write_text("1\n")
    (tmp_path / "scratch.py").write_text("untracked\n")
    assert records.git_commit() == head
    (tmp_path / "specresearch/mod.py").write_text("1\n")
    assert records.git_commit() == f"{head}+dirty"
    monkeypatch.setenv("SPECRESEARCH_COMMIT", "feedbee")  # a copy sent to a GPU machine says its commit
    assert records.git_commit() == "feedbee"
    monkeypatch.delenv("SPECRESEARCH_COMMIT")
    shutil.rmtree(tmp_path / ".git")
    assert records.git_commit() == ""  # no checkout: nothing to name


def test_paired_gain_is_a_ratio_of_sums_with_a_bootstrap_over_prompts():
    from specresearch.experiments.analysis import paired_gain

    base = np.array([1.0, 2.0, 3.0, 4.0])
    doubled = paired_gain(2 * base, base)
    assert doubled["gain"] == pytest.approx(1.0) and doubled["low"] == pytest.approx(1.0) and doubled["high"] == pytest.approx(1.0)
    mixed = paired_gain(base + np.array([0.5, -0.5, 1.0, 0.0]), base, n_boot=500)
    assert mixed["gain"] == pytest.approx(1.0 / 10) and mixed["low"] < mixed["gain"] < mixed["high"] and mixed["prompts"] == 4
    with pytest.raises(ValueError, match="one value per prompt"):
        paired_gain(base, base[:3])


def test_pooled_speed_is_total_tokens_over_total_seconds_against_the_base():
    from specresearch.experiments.analysis import pooled_speed

    seconds, tokens = np.array([1.0, 2.0, 3.0]), np.array([10.0, 10.0, 20.0])
    same = pooled_speed(seconds, tokens, 2 * seconds, tokens)  # half the time for every prompt: twice as fast
    assert (same["speed"], same["low"], same["high"], same["prompts"]) == (pytest.approx(2.0), pytest.approx(2.0),
                                                                          pytest.approx(2.0), 3)
    base = np.array([2.0, 2.0, 9.0])  # pooled: (13 / 40) / (6 / 40), not the mean of the ratios (2, 1, 3)
    mixed = pooled_speed(seconds, tokens, base, tokens, n_boot=500)
    assert mixed["speed"] == pytest.approx(13 / 6) and mixed["low"] < mixed["speed"] < mixed["high"]
    with pytest.raises(ValueError, match="one value per prompt"):
        pooled_speed(seconds, tokens, base[:2], tokens)


def test_bench_trees_table_pools_replicates(tmp_path):
    """``bench_trees.py --table A.csv B.csv``: the records are replicates of one design, told apart by ``repeat``; a
    record given twice pools to its own speeds and tau, and a file that is not a bench_trees record is named."""
    import importlib.util

    from specresearch.paths import repo_root

    root = repo_root()
    spec = importlib.util.spec_from_file_location("bench_trees", root / "benchmarks" / "bench_trees.py")
    bench_trees = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_trees)
    record = root / "benchmarks" / "records" / "trees_head_h100.csv"
    once, twice = bench_trees.read_replicates([record]), bench_trees.read_replicates([record, record])
    assert len(twice) == 2 * len(once) and twice["repeat"].nunique() == 2
    alone, pooled = bench_trees.summarise(once), bench_trees.summarise(twice)
    assert np.allclose(alone[["tau", "pooled"]], pooled[["tau", "pooled"]])
    other = tmp_path / "other.csv"
    other.write_text("prompt_id,temperature\nx,0\n")
    with pytest.raises(ValueError, match="not a bench_trees record"):
        bench_trees.read_replicates([record, other])


def test_bench_commits_summary_pairs_the_sides_prompt_by_prompt(tmp_path):
    """``bench_commits.py``'s speed-ups are each side's own speculative over autoregressive tokens per second, and
    head - base gets a paired interval: a head 10% faster at speculative decoding on every prompt, on prompts whose
    speed-ups spread (0.8-1.25x, seeded), has a difference near +0.1 x the base's speed-up with an interval far
    narrower than either side's own (the prompts' spread cancels in the pairs); equal sides give 0 exactly. A file
    without the header row is named."""
    import importlib.util

    from specresearch.paths import repo_root

    spec = importlib.util.spec_from_file_location("bench_commits", repo_root() / "benchmarks" / "bench_commits.py")
    bench_commits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_commits)
    rows = []
    spread = np.random.default_rng(0).uniform(0.8, 1.25, 12)
    for i, scale in enumerate(np.linspace(1.0, 3.0, 12)):
        for side, faster in (("base", 1.0), ("head", 1.1)):
            rows.append({"prompt": f"p{i}", "temperature": 0.0, "side": side, "method": "autoregressive", "tokens": 48, "seconds": 4.8 * scale})
            rows.append({"prompt": f"p{i}", "temperature": 0.0, "side": side, "method": "speculative", "tokens": 48,
                         "seconds": 3.2 * scale * spread[i] / faster})
    (row,) = bench_commits.summary(rows)
    assert row["prompts"] == 12 and row["head_speedup"] == pytest.approx(1.1 * row["base_speedup"])
    assert row["difference"] == pytest.approx(0.1 * row["base_speedup"])
    assert row["difference_low"] <= row["difference"] <= row["difference_high"]
    assert row["difference_high"] - row["difference_low"] < (row["base_high"] - row["base_low"]) / 5
    assert row["base_low"] < row["base_speedup"] < row["base_high"] and row["head_low"] < row["head_speedup"] < row["head_high"]
    assert row["spec_faster"] == pytest.approx(1.1) and row["ar_faster"] == pytest.approx(1.0)  # head / base, paired
    assert row["spec_faster_low"] == pytest.approx(1.1) == pytest.approx(row["spec_faster_high"])  # 1.1x every prompt
    same = [dict(r, seconds=next(b["seconds"] for b in rows if b["prompt"] == r["prompt"] and b["method"] == r["method"]
                                 and b["side"] == "base")) for r in rows]
    (row,) = bench_commits.summary(same)
    assert row["difference"] == 0 and row["difference_low"] == 0 == row["difference_high"]
    record = tmp_path / "record.jsonl"
    record.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(ValueError, match="not a bench_commits record"):
        bench_commits.load_rows(record)


def test_bench_commits_table_names_a_missing_or_foreign_record(tmp_path, monkeypatch, capsys):
    """``bench_commits.py --table`` of a missing file, or of a file that is not its record, exits 2 naming the flag."""
    import importlib.util

    from specresearch.paths import repo_root

    spec = importlib.util.spec_from_file_location("bench_commits", repo_root() / "benchmarks" / "bench_commits.py")
    bench_commits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_commits)
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text(json.dumps({"method": "speculative"}) + "\n")
    for path, says in ((tmp_path / "missing.jsonl", "no such file"), (foreign, "not a bench_commits record")):
        monkeypatch.setattr(sys, "argv", ["bench_commits.py", "--table", str(path)])
        with pytest.raises(SystemExit) as exit_:
            bench_commits.main()
        assert exit_.value.code == 2
        error = capsys.readouterr().err
        assert "--table" in error and says in error
