"""Block vs token verification on real models: the sweep that writes one record per run.

Reproduces the experiment of Sun et al., ICLR 2025 (arXiv 2403.10444; rebuttal Table "BE/WS": Vicuna-7B
target + Vicuna-68M draft on Spec-Bench, T in {0.2, 0.6, 1.0}, gamma = 8; BE = block efficiency, tokens
per target call; WS = wall-clock speed-up over autoregressive decoding) on any target/draft pair, by
default the embedded SmolLM2-135M-Instruct with the shipped distilled draft ``v8k-4l``.

Sweep (``run_bench``): for every prompt x temperature x seed, one autoregressive baseline run, then for
every gamma one run per verifier (``config.verifiers``, default token and block). Every run is written
as one CSV row (``RECORD_COLUMNS``) to ``<results>/<run>.csv``; analysis (``specresearch.experiments.analysis``)
reads the rows. The sweep is resumable: a (prompt, verifier, temperature, gamma, seed) already in the
file is not run again (the baseline row of a (prompt, temperature, seed) is reused).

Prompts: ``data/prompts.jsonl``, the FIRST user turn of each prompt in the model's chat template (the
generation prompt added). Multi-turn prompts (category ``multi_turn_chat``) are cut to their first turn:
a second turn would have to follow the model's own first answer, which differs between verifiers,
temperatures and seeds, so the two verifiers would no longer see the same prompt.

Seeds. The generator seed of a run is derived from (prompt id, ``seed``) by ``run_seed``, so different
prompts get independent random streams (with i.i.d. toy models, identical prompts would otherwise give
identical runs) while every verifier and the baseline of one (prompt, seed) use the same stream.

Common random numbers. Each run gets ``seed=[run_seed(prompt, seed)]`` (a one-element list): the engine
then uses one ``torch.Generator`` seeded with it for the row and never shortens gamma at the end
(``specresearch.engine.generate``). Per step it draws the gamma draft tokens (``sampling.sample_tokens``: one
uniform per row, so the generator advances by the same amount whatever the probabilities; checked in
``tests/test_bench.py``) and then the gamma + 1 verification uniforms. So the verifiers of one unit
consume the same random stream step by step, and they share:

* the first step's draft block AND its uniforms, always;
* every later step's draft block and uniforms, as long as all earlier steps had the same outcome
  (accepted count and next token) in both runs, since the contexts are then equal too.

From the first step whose outcome differs, the runs continue on different contexts: the streams stay
aligned but drive different distributions, so the coupling is lost. The record column
``shared_steps`` counts the steps that saw identical drafts and uniforms in both runs (the identical
steps plus the first divergent one); ``common_prefix_tokens`` is the length of the common output
prefix. At T = 0 nothing is random and the two verifiers give the same tokens.

Expected counts. Every run also records, summed over its steps, E[accepted | the step's drafted block]
of token AND block verification (``verify.expected_num_accepted`` on the same rows p_0..p_gamma,
q_0..q_{gamma-1}: one is the expectation of the realised count, the other a counterfactual costing only
its closed form; computed outside the timed part of the step) and the block's mean overlap
sum_x min(p_i, q_i), the measured alpha. ``analysis.expected_gain_table`` turns them into a paired expected
gain; ``docs/block_gain.md`` says what it estimates.

Batched sweeps (``run_batched``): every prompt of a setting in one generate call, each row with its own
seed as above (same tokens up to float differences of batched logits), no timings and no baseline: for
drafts whose wall-clock means nothing, such as ``specresearch.drafts.dial`` (they run the target).

Timing: each unit's runs alternate their order (token first, then block first in the next unit) so a
drift in machine load does not favour one verifier; ``load_avg`` records the 1-minute load average.
A short untimed warm-up run precedes the sweep. ``seconds`` include the prefill of both models.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from specresearch.checks import named_preset
from specresearch.config import COMPILE_CHOICES, GENERATE_DRAFT, SamplingConfig
from specresearch.core.verify import VERIFIERS
from specresearch.engine.cost import score_seconds
from specresearch.engine.generate import (
    GenerationResult,
    autoregressive_generate,
    speculative_generate,
)
from specresearch.engine.tree import parse_verifier
from specresearch.experiments.records import (
    AUTOREGRESSIVE,
    RECORD_COLUMNS,
    git_commit,
    read_records,
    write_run_info,
)

__all__ = ["BENCH_PRESETS", "EXPECTED_METHODS", "BenchConfig", "BenchPrompt", "default_prompts_path", "default_run_id", "load_bench_draft", "load_bench_prompts", "score_seconds", "run_batched", "run_bench", "run_named", "run_seed", "select_prompts"]


EXPECTED_METHODS = ("token", "block")  # the verifiers whose per-step expectations every run records


def _check_tuple(field: str, values, kind, low, message: str) -> None:
    if not values or not all(isinstance(v, kind) and not isinstance(v, bool) and v >= low for v in values):
        raise ValueError(f"{field} must be a non-empty tuple of {message}, got {values!r}")


@dataclass(frozen=True)
class BenchConfig:
    """What a sweep runs: the settings grid, the generation length and the prompt selection."""

    verifiers: tuple[str, ...] = ("token", "block")
    temperatures: tuple[float, ...] = (0.0, 0.2, 0.6, 1.0)
    gammas: tuple[int, ...] = (2, 4, 6, 8)
    seeds: tuple[int, ...] = (0,)
    max_new_tokens: int = 32
    num_prompts: int | None = None  # evenly spaced over the selected prompts; None = all of them
    categories: tuple[str, ...] | None = None  # None = every category
    compile: str = "off"  # speculative_generate's: "off" the growing loop, "on" / "static" / ... captured steps

    def __post_init__(self) -> None:
        if not self.verifiers or isinstance(self.verifiers, str):
            raise ValueError(f"verifiers must be a non-empty tuple of {sorted(VERIFIERS)} or tree rules NAME:K[:LAW], got {self.verifiers!r}")
        for verifier in self.verifiers:
            try:
                parse_verifier(verifier)
            except ValueError as error:
                raise ValueError(f"verifiers: {error}") from None
        if len(set(self.verifiers)) != len(self.verifiers):
            raise ValueError(f"verifiers must not repeat, got {self.verifiers!r}")
        _check_tuple("temperatures", self.temperatures, (int, float), 0, "numbers >= 0")
        _check_tuple("gammas", self.gammas, int, 1, "integers >= 1")
        _check_tuple("seeds", self.seeds, int, 0, "integers >= 0")
        _check_tuple("max_new_tokens", (self.max_new_tokens,), int, 1, "an integer >= 1 (one value)")
        if self.num_prompts is not None:
            _check_tuple("num_prompts", (self.num_prompts,), int, 1, "an integer >= 1 or None (one value)")
        if self.categories is not None and not self.categories:
            raise ValueError("categories must be None (all) or a non-empty tuple of category names")
        if self.compile not in COMPILE_CHOICES:
            raise ValueError(f"compile must be one of {COMPILE_CHOICES}, got {self.compile!r}")

    @classmethod
    def from_name(cls, name: str) -> "BenchConfig":
        """A named preset of ``BENCH_PRESETS`` (``"full"``, ``"quick"``, ``"paper"``)."""
        return named_preset(BENCH_PRESETS, name)


BENCH_PRESETS: dict[str, BenchConfig] = {
    "full": BenchConfig(),
    # A few minutes on a 2-core CPU: 3 prompts (one per category) x T {0, 1} x gamma {2, 4}, 24 tokens.
    "quick": BenchConfig(temperatures=(0.0, 1.0), gammas=(2, 4), max_new_tokens=24, num_prompts=3,
                         categories=("translation", "question_answering", "code")),
    # Sun et al. 2025's table: gamma = 8, T in {0, 0.2, 0.6, 1.0}.
    "paper": BenchConfig(gammas=(8,)),
}


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt, already encoded."""

    id: str
    category: str
    token_ids: tuple[int, ...]


def default_prompts_path() -> Path:
    """The repository's ``data/prompts.jsonl`` (next to the shipped drafts)."""
    from specresearch.training.distill import drafts_dir

    return drafts_dir().parent / "prompts.jsonl"


def select_prompts(prompts: Sequence[dict], categories: Sequence[str] | None = None,
                   num_prompts: int | None = None) -> list[dict]:
    """Keep ``categories`` (all if None), then ``num_prompts`` evenly spaced ones (index round(i * n / k)).

    With the 70-prompt set sorted by category, ``num_prompts`` = 7 takes one prompt per category and 14
    takes two (the same held-out choice as ``benchmarks/bench_draft.py``).
    """
    known = sorted({p["category"] for p in prompts})
    unknown = sorted(set(categories or ()) - set(known))
    if unknown:
        raise ValueError(f"categories {unknown} are not in the prompt set; known: {known}")
    kept = [p for p in prompts if categories is None or p["category"] in categories]
    if num_prompts is None or num_prompts >= len(kept):
        return kept
    return [kept[round(i * len(kept) / num_prompts)] for i in range(num_prompts)]


def load_bench_prompts(tokenizer, config: BenchConfig, path: str | os.PathLike | None = None) -> list[BenchPrompt]:
    """Read, select and encode the prompts: first user turn, chat template if the tokenizer has one."""
    from specresearch.engine.prompts import encode_chat, load_prompts

    rows = select_prompts(load_prompts(path or default_prompts_path()), config.categories, config.num_prompts)
    if getattr(tokenizer, "chat_template", None):
        encoded = [tuple(t.tolist()) for t in encode_chat(rows, tokenizer)]
    else:
        encoded = [tuple(tokenizer(r["turns"][0], add_special_tokens=False)["input_ids"]) for r in rows]
    return [BenchPrompt(r["id"], r["category"], ids) for r, ids in zip(rows, encoded)]


def load_bench_draft(name: str, target):
    """A draft for ``target`` (a ``CausalLM``) from a short name (``drafts.registry.draft_from_name``): a shipped
    trained draft (``v8k-4l``, any name under ``data/drafts/``), ``ngram``, ``truncated:N`` or a path."""
    from specresearch.drafts.registry import draft_from_name

    return draft_from_name(name, target)


def default_run_id(target_name: str, draft_name: str, config: BenchConfig, prefix: str = "") -> str:
    """``<prefix><draft>-<8 hex of the settings>``: the same command maps to the same file (resumes)."""
    fields = dataclasses.asdict(config)
    if fields["compile"] == "off":  # the growing loop's runs keep the ids they had before captured steps existed
        del fields["compile"]
    settings = json.dumps([target_name, draft_name, fields], sort_keys=True)
    slug = "".join(c if c.isalnum() or c in "-_" else "_" for c in Path(draft_name).name or draft_name)
    return f"{prefix}{slug}-{hashlib.sha1(settings.encode()).hexdigest()[:8]}"


def run_seed(prompt_id: str, seed: int) -> int:
    """The generator seed of every run on (``prompt_id``, ``seed``): 31 bits of sha1("<prompt_id>:<seed>")."""
    return int(hashlib.sha1(f"{prompt_id}:{seed}".encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


def _key(prompt_id, verifier, temperature, gamma, seed) -> tuple:
    return (str(prompt_id), str(verifier), round(float(temperature), 9), int(gamma), int(seed))


def _done(records) -> dict[tuple, dict]:
    """Existing rows by key (``_key``)."""
    rows = records.to_dict("records")
    return {_key(r["prompt_id"], r["verifier"], r["temperature"], r["gamma"], r["seed"]): r for r in rows}


def _append(path: Path, rows: list[dict]) -> None:
    """Append rows to the CSV (header if the file is new); flushed at once so a crash loses one unit."""
    import pandas as pd

    if path.exists() and path.stat().st_size:
        with open(path) as handle:
            header = handle.readline().strip().split(",")
        if header != list(RECORD_COLUMNS):
            raise ValueError(f"path {path} holds records with other columns (an older format): pass a new --run "
                             "or move the file away")
    frame = pd.DataFrame(rows, columns=list(RECORD_COLUMNS))
    frame.to_csv(path, mode="a", header=not path.exists(), index=False)


def _output_hash(tokens: Sequence[int]) -> str:
    return hashlib.sha1(",".join(map(str, tokens)).encode()).hexdigest()[:12]


def _step_blocks(result: GenerationResult, row: int = 0) -> list[tuple[int, tuple[int, ...]]]:
    """Per step of ``row`` (while active): (accepted drafts, the tokens it kept). Speculative results only."""
    tokens, start, blocks = result.tokens[row], 0, []
    for step in result.steps:
        if not step.active[row]:
            break
        n = step.num_accepted[row]
        blocks.append((n, tuple(tokens[start : start + n + 1])))
        start += n + 1
    return blocks


def _shared_steps(a: GenerationResult, b: GenerationResult, row: int = 0) -> int:
    """Steps that saw the same drafts and uniforms: the identical leading steps plus the first divergent one."""
    blocks_a, blocks_b = _step_blocks(a, row), _step_blocks(b, row)
    same = next((i for i, (x, y) in enumerate(zip(blocks_a, blocks_b)) if x != y), None)
    return min(len(blocks_a), len(blocks_b)) if same is None else same + 1


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _record(result: GenerationResult, base: dict, verifier: str, gamma: int, order: int, row: int = 0,
            timed: bool = True) -> dict:
    """One CSV row of a run (``row`` of ``result``); CRN columns are filled in by the caller. Timings are
    NaN unless ``timed`` (a batched run has no per-prompt wall time)."""
    steps = [s for s in result.steps if s.active[row]]
    accepted = sum(s.num_accepted[row] for s in steps)
    rejections = sum(s.num_accepted[row] < s.gamma for s in steps if s.gamma)
    batch = len(result.tokens)
    nan = float("nan")
    return {
        **base, "verifier": verifier, "gamma": gamma, "new_tokens": len(result.tokens[row]),
        "target_calls": sum(s.target_calls for s in steps), "draft_calls": sum(s.draft_calls for s in steps),
        "accepted_tokens": accepted, "examined_drafts": accepted + rejections,
        "seconds": result.seconds if timed else nan,
        "target_seconds": sum(s.target_seconds for s in steps) if timed else nan,
        "draft_seconds": sum(s.draft_seconds for s in steps) if timed else nan,
        "prefill_seconds": result.prefill_seconds if timed else nan,
        "output_hash": _output_hash(result.tokens[row]), "order": order,
        "load_avg": os.getloadavg()[0] if hasattr(os, "getloadavg") else nan,
        **{f"expected_{m}": sum(s.expected[m][row] for s in steps) if steps and steps[0].expected else nan
           for m in EXPECTED_METHODS},
        "overlap_sum": sum(s.overlap[row] for s in steps) if steps and steps[0].overlap else nan, "batch": batch,
    }


def _run_baseline(target, prompt: BenchPrompt, base: dict, config: BenchConfig, eos) -> dict:
    result = autoregressive_generate(target, [list(prompt.token_ids)], max_new_tokens=config.max_new_tokens,
                                     sampling=SamplingConfig(temperature=base["temperature"]),
                                     seed=[run_seed(prompt.id, base["seed"])], eos_token_id=eos, compile=config.compile)
    row = _record(result, base, AUTOREGRESSIVE, 0, 0)
    return {**row, "ar_seconds": row["seconds"], "ar_tokens": row["new_tokens"]}


def _run_unit(target, draft, prompt: BenchPrompt, base: dict, gamma: int, order: Sequence[str],
              config: BenchConfig, eos) -> list[dict]:
    """Every verifier of ``order`` on one (prompt, temperature, seed, gamma), same seed (CRN)."""
    results = {}
    for verifier in order:
        name, num_drafts, draft_law, tree_nodes = parse_verifier(verifier)
        tree = name not in VERIFIERS
        results[verifier] = speculative_generate(
            target, draft, [list(prompt.token_ids)], verifier=name, gamma=1 if name == "kseq" else gamma,
            num_drafts=num_drafts, draft_law=draft_law, tree_nodes=tree_nodes, max_new_tokens=config.max_new_tokens,
            sampling=SamplingConfig(temperature=base["temperature"]), seed=[run_seed(prompt.id, base["seed"])],
            eos_token_id=eos, expectations=() if tree or config.compile != "off" else EXPECTED_METHODS,
            compile=config.compile)
    rows = []
    for position, verifier in enumerate(order):
        row = _record(results[verifier], base, verifier, gamma, position)
        others = [r for v, r in results.items() if v != verifier]
        mine = results[verifier]
        row["shared_steps"] = min((_shared_steps(mine, o) for o in others), default=float("nan"))
        row["common_prefix_tokens"] = min((_common_prefix(mine.tokens[0], o.tokens[0]) for o in others),
                                          default=float("nan"))
        rows.append(row)
    return rows


def _warmup(target, draft, prompt: BenchPrompt, config: BenchConfig) -> None:
    """Untimed: first forward passes allocate caches and pick kernels."""
    ids = [list(prompt.token_ids)]
    name, num_drafts, draft_law, tree_nodes = parse_verifier(config.verifiers[0])
    for temperature in config.temperatures:  # a compiled or captured step is built per sampling configuration
        sampling = SamplingConfig(temperature=temperature)
        speculative_generate(target, draft, ids, verifier=name, gamma=1 if name == "kseq" else max(config.gammas),
                             num_drafts=num_drafts, draft_law=draft_law, tree_nodes=tree_nodes, max_new_tokens=2,
                             sampling=sampling, seed=[0], compile=config.compile)
        autoregressive_generate(target, ids, max_new_tokens=2, sampling=sampling, seed=[0], compile=config.compile)
        if config.compile == "off":  # one warm-up is enough for the growing loop
            break


def _units(prompts, config: BenchConfig):
    """(prompt, temperature, seed) groups in sweep order, each with its gammas."""
    for prompt in prompts:
        for temperature in config.temperatures:
            for seed in config.seeds:
                yield prompt, float(temperature), seed


def run_bench(target, draft, prompts: Sequence[BenchPrompt], config: BenchConfig, path: str | os.PathLike, *,
              run_id: str | None = None, eos_token_id=None, progress: bool = True, executor=None, models=None):
    """Run the sweep (module docstring) and append its records to the CSV ``path``; skip rows already there.

    Args:
        target, draft: ``models.protocols.LanguageModel`` s with the same vocabulary (``CausalLM``, ``ToyLM``, ...).
        prompts: encoded prompts (``load_bench_prompts``, or ``BenchPrompt`` s of token ids).
        config: the grid; every verifier of ``config.verifiers`` runs at every (temperature, gamma, seed).
        path: the CSV file (created with its parent directory if missing).
        run_id: stored in every new row (default: the file name without ``.csv``).
        eos_token_id: ends a row early (e.g. ``tokenizer.eos_token_id``); None = always max_new_tokens.
        executor, models: an ``experiments.executor`` executor (``--executor ray``) that runs each prompt's missing
            settings as one block in a worker, which builds its pair with ``models`` (a picklable recipe returning
            ``(target, draft, ...)``) once; ``target`` and ``draft`` are then unused (None will do). Rows are appended
            as each prompt lands, so the file resumes as before.
    Returns:
        every record in the file after the sweep (pandas DataFrame, ``RECORD_COLUMNS``).
    """
    from tqdm.auto import tqdm

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    run_id = run_id or path.stem
    done = _done(read_records(path))
    units = list(_units(prompts, config))
    todo = [(u, g) for u in units for g in config.gammas
            if any(_key(u[0].id, v, u[1], g, u[2]) not in done for v in config.verifiers)]
    bar = tqdm(total=len(todo), desc=f"bench {run_id}", unit="setting", disable=not progress)

    def write(rows: list[dict]) -> None:
        _append(path, rows)
        done.update({_key(r["prompt_id"], r["verifier"], r["temperature"], r["gamma"], r["seed"]): r for r in rows})

    if executor is None:
        if todo:
            _warmup(target, draft, todo[0][0][0], config)
        _run_settings(target, draft, todo, done, config, eos_token_id, run_id, write, bar)
    else:
        if models is None:
            raise ValueError("an executor runs the prompts in its workers: pass models=, a picklable recipe that "
                             "returns (target, draft, ...) (e.g. functools.partial(bench_models, target, draft))")
        by_prompt: dict = {}
        for item in todo:
            by_prompt.setdefault(item[0][0].id, []).append(item)
        blocks = [BenchBlock(models, tuple(items), {k: v for k, v in done.items() if k[0] == str(prompt_id)}, config,
                             eos_token_id, run_id) for prompt_id, items in by_prompt.items()]

        def landed(index, rows):
            write(rows)
            bar.update(len(blocks[index].todo))

        executor.run(run_bench_block, blocks, on_result=landed)
    bar.close()
    return read_records(path)


def _run_settings(target, draft, todo, done, config, eos_token_id, run_id, write, bar=None) -> None:
    """The (prompt, temperature, seed) x gamma settings ``todo``: each one's baseline (unless ``done`` has it) and
    verifiers; ``write(rows)`` after each, which also records them in ``done``."""
    for index, ((prompt, temperature, seed), gamma) in enumerate(todo):
        base = {"run_id": run_id, "prompt_id": prompt.id, "category": prompt.category,
                "temperature": temperature, "seed": seed}
        baseline_key = _key(prompt.id, AUTOREGRESSIVE, temperature, 0, seed)
        if baseline_key not in done:
            write([_run_baseline(target, prompt, base, config, eos_token_id)])
        baseline = done[baseline_key]
        shift = index % len(config.verifiers)  # alternate which verifier runs first
        order = config.verifiers[shift:] + config.verifiers[:shift]
        rows = _run_unit(target, draft, prompt, base, gamma, order, config, eos_token_id)
        write([{**r, "ar_seconds": baseline["ar_seconds"], "ar_tokens": baseline["ar_tokens"]} for r in rows
               if _key(prompt.id, r["verifier"], temperature, gamma, seed) not in done])
        if bar is not None:
            bar.update(1)
            bar.set_postfix(prompt=prompt.id, T=temperature, gamma=gamma)


@dataclasses.dataclass(frozen=True)
class BenchBlock:
    """One prompt's missing settings, as a worker runs them (``run_bench_block``)."""

    models: object
    todo: tuple
    done: dict  # the rows the file already holds for this prompt (its baselines are reused)
    config: BenchConfig
    eos_token_id: object
    run_id: str


def run_bench_block(block: BenchBlock) -> list[dict]:
    """The new rows of one prompt's settings, computed with the worker's pair (built once: ``executor.loaded``)."""
    from specresearch.experiments.executor import loaded

    target, draft = loaded(block.models)[:2]
    _warmup(target, draft, block.todo[0][0][0], block.config)
    done, rows = dict(block.done), []

    def write(new):
        rows.extend(new)
        done.update({_key(r["prompt_id"], r["verifier"], r["temperature"], r["gamma"], r["seed"]): r for r in new})

    _run_settings(target, draft, list(block.todo), done, block.config, block.eos_token_id, block.run_id, write)
    return rows


def bench_models(target_name: str, draft_name: str, device: str = "cpu", chosen: tuple = ()):
    """``(target, draft)`` as ``run_named`` loads them (``chosen``: a default configuration's items, fitted to the
    draft as ``specresearch generate`` fits it): the recipe its Ray workers build."""
    from specresearch.models.embedded import load_model

    target, _ = load_model(target_name, device=device)
    draft = load_bench_draft(draft_name, target)
    if chosen:
        from specresearch.engine.cost import fit_default_draft

        fit_default_draft(draft, dict(chosen))
    return target, draft


def run_batched(target, draft, prompts: Sequence[BenchPrompt], config: BenchConfig, path: str | os.PathLike, *,
                run_id: str | None = None, eos_token_id=None, progress: bool = True):
    """``run_bench`` with every prompt of a (temperature, seed, gamma, verifier) in ONE generate call.

    Much cheaper per token on a CPU, and each row keeps its own seed (``run_seed``), so its tokens and the
    common random numbers between verifiers are those of ``run_bench`` up to float differences of batched
    logits. No wall-clock exists per prompt: ``seconds`` columns are NaN and no autoregressive baseline is
    run, so only BE, alpha and the expected counts are measured (what drafts that run the target allow,
    ``specresearch.drafts.dial``). Resumable: only the prompts of a (temperature, seed, gamma) that lack a
    row for some verifier are run (so adding prompts later runs just those). Returns every record in the file.
    """
    from tqdm.auto import tqdm

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    run_id = run_id or path.stem
    done = _done(read_records(path))
    settings = [(t, s, g) for t in map(float, config.temperatures) for s in config.seeds for g in config.gammas]
    todo = [x for x in settings if any(_key(p.id, v, x[0], x[2], x[1]) not in done
                                       for p in prompts for v in config.verifiers)]
    bar = tqdm(total=len(todo), desc=f"bench {run_id} (batched)", unit="setting", disable=not progress)
    for temperature, seed, gamma in todo:
        missing = [p for p in prompts
                   if any(_key(p.id, v, temperature, gamma, seed) not in done for v in config.verifiers)]
        results = {v: speculative_generate(
            target, draft, [list(p.token_ids) for p in missing], verifier=v, gamma=gamma,
            max_new_tokens=config.max_new_tokens, sampling=SamplingConfig(temperature=temperature),
            seed=[run_seed(p.id, seed) for p in missing], eos_token_id=eos_token_id, expectations=EXPECTED_METHODS)
            for v in config.verifiers}
        rows = []
        for b, prompt in enumerate(missing):
            base = {"run_id": run_id, "prompt_id": prompt.id, "category": prompt.category,
                    "temperature": temperature, "seed": seed, "ar_seconds": float("nan"), "ar_tokens": float("nan")}
            for position, (verifier, mine) in enumerate(results.items()):
                others = [r for v, r in results.items() if v != verifier]
                row = _record(mine, base, verifier, gamma, position, row=b, timed=False)
                row["shared_steps"] = min((_shared_steps(mine, o, b) for o in others), default=float("nan"))
                row["common_prefix_tokens"] = min((_common_prefix(mine.tokens[b], o.tokens[b]) for o in others),
                                                  default=float("nan"))
                if _key(prompt.id, verifier, temperature, gamma, seed) not in done:
                    rows.append(row)
        _append(path, rows)
        done.update({_key(r["prompt_id"], r["verifier"], temperature, gamma, seed): r for r in rows})
        bar.update(1)
        bar.set_postfix(T=temperature, gamma=gamma)
    bar.close()
    return read_records(path)


def run_named(target_name: str, draft_name: str, config: BenchConfig, path: str | os.PathLike, *,
              prompts_path: str | os.PathLike | None = None, run_id: str | None = None, device: str = "cpu",
              progress: bool = True, command: str | None = None, batched: bool = False, default_gamma: bool = False,
              announce=None, executor=None):
    """Load ``target_name`` (embedded name or checkpoint) and ``draft_name`` (``load_bench_draft``), encode
    the prompts (``load_bench_prompts``), record what runs (``write_run_info``) and ``run_bench`` into ``path``.

    ``batched``: ``run_batched`` (all prompts per call, BE only) instead of ``run_bench``. ``default_gamma``: at
    each temperature, run what ``specresearch generate`` picks for this pair on this machine
    (``engine.cost.default_config``: a gamma, or a dynamic tree) instead of ``config.verifiers`` and ``config.gammas``;
    ``announce(message)`` is told when that times the machine's step costs (as for ``specresearch generate``).
    ``executor``: run the prompts as its blocks (``run_bench``; each worker loads the pair once, ``bench_models``).
    Returns every record in the file (pandas DataFrame).
    """
    if executor is not None and batched:
        raise ValueError("a batched sweep runs every prompt in one call per setting: leave out the executor")
    from specresearch.drafts.registry import weights_digests
    from specresearch.engine.prompts import load_prompts
    from specresearch.models.embedded import EMBEDDED, load_model, weights_digest

    select_prompts(load_prompts(prompts_path or default_prompts_path()), config.categories)  # before a model loads
    target, tokenizer = load_model(target_name, device=device)
    draft = load_bench_draft(draft_name, target)
    configs, choices = [config], [None]
    if default_gamma:
        from specresearch.engine.cost import default_config

        configs, choices = [], []
        for temperature in config.temperatures:
            chosen = default_config(target, draft, temperature, trees=draft_name == GENERATE_DRAFT, announce=announce)
            verifier = (f"onehot:{chosen['num_drafts']}:dynamic:{chosen['tree_nodes']}" if "num_drafts" in chosen
                        else config.verifiers[0])
            configs.append(dataclasses.replace(config, temperatures=(temperature,), verifiers=(verifier,),
                                               gammas=(chosen["gamma"],)))
            choices.append(chosen)
    prompts = load_bench_prompts(tokenizer, config, prompts_path)
    write_run_info(path, command=command, commit=git_commit(), target=target_name, draft=draft_name,
                   target_sha256=weights_digest(target_name) if target_name in EMBEDDED else None,
                   draft_sha256=weights_digests(draft_name), batched=batched, config=dataclasses.asdict(config),
                   prompts=[p.id for p in prompts],
                   **({"chosen": [dataclasses.asdict(c) for c in configs]} if default_gamma else {}))
    run = run_batched if batched else run_bench
    for each, chosen in zip(configs, choices):
        if chosen is not None and draft_name == GENERATE_DRAFT:  # as generate runs its default draft
            from specresearch.engine.cost import fit_default_draft

            fit_default_draft(draft, chosen)
        options = {}
        if executor is not None:
            fitted = tuple(sorted(chosen.items())) if chosen is not None and draft_name == GENERATE_DRAFT else ()
            options = dict(executor=executor, models=functools.partial(bench_models, target_name, draft_name, device,
                                                                       fitted))
        records = run(target, draft, prompts, each, path, run_id=run_id, eos_token_id=tokenizer.eos_token_id,
                      progress=progress, **options)
    return records


