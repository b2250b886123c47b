"""Seed blocks and sweeps on Ray (``experiments.executor``): local Ray with 2 CPUs.

* A lossless test split over Ray workers gives the counts of one process with the same seed (seed blocks).
* A worker killed (SIGKILL) in the middle of its block: Ray runs the block again; every block's rows arrive once.
* A blocks file: finished blocks are appended as they land, and a rerun runs only the missing ones.
* Without an executor nothing imports Ray.
"""

import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import ray  # noqa: F401 -- a dev dependency (pyproject's [dev]): its absence fails here, loudly
import torch

from specresearch.config import SamplingConfig
from specresearch.experiments.stats import SampleBlock, lossless_test, sample_block, sequence_law
from specresearch.models.families import tiny_family_pair

ROOT = Path(__file__).resolve().parents[1]
PAIR = functools.partial(tiny_family_pair, "llama", "eager")
PROMPT = [5, 9, 3]
SAMPLING = SamplingConfig(temperature=1.0)
TEST = dict(sampling=SAMPLING, gamma=2, k=2, num_samples=600, seed=7, batch_size=100, min_expected=5.0)


@pytest.fixture(scope="module")
def executor():
    from ray import cloudpickle

    from specresearch.experiments.executor import RayExecutor

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the tests' functions travel by value
    made = RayExecutor(workers=2)
    yield made
    made.shutdown()


def _dying(marker: str, victim: int, block: SampleBlock) -> dict:
    """``sample_block``, except that the first attempt at seed ``victim`` kills its own worker process."""
    if block.seed == victim and not os.path.exists(marker):
        Path(marker).write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    return sample_block(block) | {"pid": os.getpid()}


def test_a_test_split_over_workers_counts_what_one_process_counts(executor, tmp_path):
    target, draft = PAIR()
    law = sequence_law(target, PROMPT, sampling=SAMPLING, k=2, num_samples=600)
    alone = lossless_test(target, draft, "block", PROMPT, law=law, **TEST)
    split = lossless_test(None, None, "block", PROMPT, law=law, executor=executor, models=PAIR, **TEST)
    assert split.counts == alone.counts and split.num_samples == 600
    assert split.p_value == alone.p_value
    other = lossless_test(target, draft, "block", PROMPT, law=law, **{**TEST, "seed": 8})
    assert other.counts != alone.counts  # the seed decides the counts: the equality above is not vacuous


def test_a_killed_worker_loses_and_duplicates_no_block(executor, tmp_path):
    blocks = [SampleBlock(PAIR, "block", tuple(PROMPT), SAMPLING, 2, 2, 50, seed, 2) for seed in (11, 12, 13, 14)]
    marker = str(tmp_path / "killed")
    landed = []
    results = executor.run(functools.partial(_dying, marker, 13), blocks, on_result=lambda i, r: landed.append(i))
    killed = int(Path(marker).read_text())
    assert sorted(landed) == [0, 1, 2, 3]  # each block once
    assert results[2]["pid"] != killed  # the victim's block finished in another process
    expected = [sample_block(block)["sequences"] for block in blocks]  # this process, the same seeds
    assert [r["sequences"] for r in results] == expected


def test_a_rerun_runs_only_the_blocks_its_file_lacks(executor, tmp_path):
    target, _ = PAIR()
    law = sequence_law(target, PROMPT, sampling=SAMPLING, k=2, num_samples=600)
    blocks_file = tmp_path / "blocks.jsonl"
    first = lossless_test(None, None, "block", PROMPT, law=law, executor=executor, models=PAIR,
                          blocks_file=blocks_file, **TEST)
    rows = blocks_file.read_text().splitlines()
    assert len(rows) == 6 and len({json.loads(r)["seed"] for r in rows}) == 6
    blocks_file.write_text("\n".join(rows[:4]) + "\n")  # as if the driver died after four blocks

    class Counting:
        blocks = 0

        def run(self, function, blocks, on_result=None):
            Counting.blocks += len(blocks)
            return executor.run(function, blocks, on_result)

    again = lossless_test(None, None, "block", PROMPT, law=law, executor=Counting(), models=PAIR,
                          blocks_file=blocks_file, **TEST)
    assert Counting.blocks == 2 and again.counts == first.counts
    assert len(blocks_file.read_text().splitlines()) == 6


def test_without_an_executor_ray_is_not_imported():
    code = ("import sys, functools; from specresearch.experiments.stats import lossless_test; "
            "from specresearch.experiments.executor import make_executor, LocalExecutor; "
            "from specresearch.models.families import tiny_family_pair; from specresearch.config import SamplingConfig; "
            "t, d = tiny_family_pair(); "
            "r = lossless_test(t, d, 'block', [5, 9, 3], sampling=SamplingConfig(temperature=1.0), gamma=2, k=2, "
            "num_samples=50, seed=0, executor=LocalExecutor(), models=functools.partial(tiny_family_pair)); "
            "assert r.num_samples == 50; print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_a_bench_sweep_on_ray_writes_the_rows_of_one_process(executor, tmp_path):
    """``run_bench`` with the prompts as Ray tasks: the same rows (tokens, tau, acceptance; not the seconds) as the
    sweep in this process, appended to the same kind of file; a rerun finds nothing left to run."""
    from specresearch.experiments.bench import BenchConfig, BenchPrompt, run_bench

    prompts = [BenchPrompt(f"p{i}", "c", tuple(range(2 + i, 6 + 2 * i))) for i in range(3)]
    config = BenchConfig(verifiers=("token", "block"), temperatures=(0.0, 1.0), gammas=(2,), max_new_tokens=8)
    target, draft = PAIR()
    alone = run_bench(target, draft, prompts, config, tmp_path / "alone.csv", progress=False)
    split = run_bench(None, None, prompts, config, tmp_path / "ray.csv", progress=False, executor=executor, models=PAIR)
    columns = ["prompt_id", "verifier", "temperature", "gamma", "output_hash", "new_tokens", "accepted_tokens"]
    order = ["prompt_id", "verifier", "temperature"]
    assert len(alone) == len(split) == 3 * 2 * 3  # prompts x temperatures x (two verifiers and the baseline)
    assert (alone[columns].sort_values(order).reset_index(drop=True)
            .equals(split[columns].sort_values(order).reset_index(drop=True)))

    class Nothing:
        def run(self, function, blocks, on_result=None):
            assert not blocks
            return []

    again = run_bench(None, None, prompts, config, tmp_path / "ray.csv", progress=False, executor=Nothing(), models=PAIR)
    assert len(again) == len(split)


def test_run_into_csv_keeps_a_finished_prompt_and_runs_the_rest(executor, tmp_path):
    from specresearch.experiments.executor import LocalExecutor, run_into_csv

    path = tmp_path / "sweep.csv"
    blocks = [("a", 1), ("b", 2), ("c", 3)]
    first = run_into_csv(LocalExecutor(), _rows, blocks[:1], ["a"], path, key_column="prompt_id")
    assert [r["prompt_id"] for r in first] == ["a", "a"]
    rows = run_into_csv(executor, _rows, blocks, ["a", "b", "c"], path, key_column="prompt_id")
    assert [r["prompt_id"] for r in rows] == ["a", "a", "b", "b", "c", "c"]
    assert [r["value"] for r in rows] == [1, 2, 2, 4, 3, 6]
    import pandas as pd

    assert pd.read_csv(path)["prompt_id"].tolist() == ["a", "a", "b", "b", "c", "c"]


def _rows(block):
    name, value = block
    return [{"prompt_id": name, "value": value}, {"prompt_id": name, "value": 2 * value}]


def test_the_executor_flags_are_checked_before_anything_starts():
    import argparse

    from specresearch.experiments.executor import LocalExecutor, add_executor_arguments, make_executor

    parser = argparse.ArgumentParser()
    add_executor_arguments(parser)
    assert isinstance(make_executor(parser.parse_args([])), LocalExecutor)
    assert make_executor(parser.parse_args([]), local=None) is None
    for flags in (["--workers", "2"], ["--address", "10.0.0.1:6379"]):
        with pytest.raises(ValueError, match="go with --executor ray"):
            make_executor(parser.parse_args(flags))
    with pytest.raises(ValueError, match="--workers must be >= 1"):
        make_executor(parser.parse_args(["--executor", "ray", "--workers", "0"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--executor", "dask"])


def _tiny_hf_pair():
    """The tiny pair as plain transformers models (audit.execute's kind), a recipe the workers build."""
    from specresearch.models.families import perturbed_copy, tiny_family_model

    target = tiny_family_model("llama", "sdpa", seed=0, init_std=0.5)
    return target, perturbed_copy(target, noise=1.0, seed=3)


def test_an_engine_run_split_into_seed_blocks_counts_the_same_anywhere(executor):
    """audit.execute with seed blocks: Ray workers count what this process counts block by block (and the verdict of
    transformers' own speculative sampling stays: the target's law not rejected; seed fixed, a chance rejection of a
    lossless run at 1e-3 is a false-positive rate of 0.1%)."""
    from specresearch.audit.execute import execute
    from specresearch.experiments.executor import LocalExecutor

    target, draft = _tiny_hf_pair()
    common = dict(prompt=[5, 9, 3], n_tokens=1, num_samples=3000, seed=4, target=target, draft=draft, progress=False,
                  models=functools.partial(_tiny_hf_pair), batch_size=1000)
    here = execute("transformers-sampling", executor=LocalExecutor(), **common)
    there = execute("transformers-sampling", executor=executor, **common)
    assert here.counts == there.counts and sum(there.counts) == 3000
    assert there.target.p_value > 1e-3
    with pytest.raises(ValueError, match="pass models="):
        execute("transformers-sampling", executor=executor, **{**common, "models": None})


def _tiny_library_sampler():
    """A library's sampler as ``benchmarks/audit_libraries.py`` builds one in each worker: plain sampling from the tiny
    target (torch's global generator, which each seed block seeds), its model loaded once a process."""
    from specresearch.experiments.executor import loaded

    target, _ = loaded(_tiny_hf_pair)

    def sample(prompt, n_tokens):
        ids = list(prompt)
        for _ in range(n_tokens):
            with torch.no_grad():
                logits = target(input_ids=torch.tensor([ids])).logits[0, -1].double()
            ids.append(int(torch.multinomial(logits.softmax(-1), 1)))
        return ids[len(prompt):]
    return sample


def test_a_library_sampler_built_in_each_worker_counts_what_one_given_here_counts(executor):
    """engine 'python' with sampler= (a recipe each Ray worker builds once, for a library's sampler, which holds its
    models and does not travel) counts, block by block, what the same sampler handed over as sample= counts here
    (plain sampling keeps the target's law: seed fixed, rejected by chance at 1e-3, a 0.1% false-positive rate)."""
    from specresearch.audit.execute import execute
    from specresearch.experiments.executor import LocalExecutor

    target, _ = _tiny_hf_pair()
    common = dict(prompt=[5, 9, 3], n_tokens=2, num_samples=400, seed=4, target=target, progress=False,
                  models=functools.partial(_tiny_hf_pair), batch_size=100, min_expected=10, name="plain sampling")
    here = execute("python", executor=LocalExecutor(), sample=_tiny_library_sampler(), **common)
    there = execute("python", executor=executor, sampler=functools.partial(_tiny_library_sampler), **common)
    assert here.counts == there.counts and sum(there.counts) == 400 and len(there.counts) > 5
    assert there.target.p_value > 1e-3 and "sampler" not in there.options and there.options["name"] == "plain sampling"
    with pytest.raises(ValueError, match="one of the two"):
        execute("python", executor=executor, sample=_tiny_library_sampler(),
                sampler=functools.partial(_tiny_library_sampler), **common)


def test_ray_is_started_again_when_its_node_misses_the_startup_wait(monkeypatch):
    """Ray waits a fixed 30 s for its node to register; on a loaded machine it can miss it: RayExecutor starts Ray
    again (up to start_attempts), and any other error, or the last attempt's, is raised."""
    import ray as real

    from specresearch.experiments.executor import RayExecutor

    calls = []

    def init(**kwargs):
        calls.append("init")
        if calls.count("init") <= failures:
            raise Exception("The current node timed out during startup. This could happen because ...")

    monkeypatch.setattr(real, "is_initialized", lambda: False)
    monkeypatch.setattr(real, "init", init)
    monkeypatch.setattr(real, "shutdown", lambda: calls.append("shutdown"))
    failures = 2
    RayExecutor(workers=2, start_attempts=3)
    assert calls == ["init", "shutdown", "init", "shutdown", "init"]
    calls.clear()
    with pytest.raises(Exception, match="timed out during startup"):
        RayExecutor(workers=2, start_attempts=2)
    assert calls == ["init", "shutdown", "init"]

    def broken(**kwargs):
        raise ValueError("another failure")

    monkeypatch.setattr(real, "init", broken)
    with pytest.raises(ValueError, match="another failure"):
        RayExecutor(workers=2)
