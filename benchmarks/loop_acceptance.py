"""The engine's acceptance rate of drafts, untimed: many prompts and seeds, one draft per process.

In the loop a draft is queried only where a step starts, so its acceptance there is not the held-out
alpha of ``prompt_breadth.py`` (which averages over every position of the target's sequences): after an
accepted draft the bonus token's position is never drafted. This counts accepted / examined drafted
tokens of ``speculative_generate`` (token verification) on the chat prompts of ``data/prompts.jsonl``
(``--per-category`` evenly spaced per category), ``--seeds`` per prompt (``bench.run_seed``, as
``bench_wallclock.py`` seeds its runs), and writes one row per (prompt, seed). ``--paired A B`` compares
two records prompt by prompt (95% bootstrap over prompts, seeds pooled). ``--predicted ENGINE BREADTH``
sets the engine's counts (a record of this script, or a ``bench_wallclock.py`` JSON-lines record with
``--method``) beside what a ``prompt_breadth.py`` record of the same draft predicts for the loop at gamma
1 on its own sequences (``feature_distill.loop_expectations``), and beside its alpha. At T = 0 both are
counts on the same greedy sequences, so they are compared prompt by prompt. A benchmark: nothing asserted.

    PYTHONPATH=. .venv/bin/python benchmarks/loop_acceptance.py --draft fp16:eagle3-v8k --out A.json
    PYTHONPATH=. .venv/bin/python benchmarks/loop_acceptance.py --paired A.json B.json
    PYTHONPATH=. .venv/bin/python benchmarks/loop_acceptance.py --predicted A.json BREADTH.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from specresearch.config import SamplingConfig
from specresearch.drafts.registry import draft_from_name
from specresearch.engine.generate import speculative_generate
from specresearch.experiments import bench
from specresearch.experiments.records import write_json_record
from specresearch.models.embedded import load_embedded

CATEGORIES = ("code", "math_reasoning", "multi_turn_chat", "question_answering", "retrieval_augmented", "summarization",
              "translation")


def per_prompt(record: dict) -> dict[str, tuple[int, int]]:
    """(accepted, examined) per prompt, seeds pooled."""
    out: dict[str, list[int]] = {}
    for r in record["rows"]:
        pair = out.setdefault(r["prompt"], [0, 0])
        pair[0] += r["accepted"]
        pair[1] += r["examined"]
    return {k: (a, n) for k, (a, n) in out.items()}


def pooled_difference(x: np.ndarray, y: np.ndarray, n_boot: int = 2000) -> tuple[tuple[float, float], tuple[float, float]]:
    """Pooled ratios ``sum(a) / sum(n)`` of two per-prompt ``[P, 2]`` arrays of (a, n), paired by row, and the
    95% interval of their difference by a bootstrap over prompts (seed 0). -> ((ratio x, ratio y), (low, high))."""
    picks = np.random.default_rng(0).integers(0, len(x), size=(n_boot, len(x)))
    boot = x[picks, 0].sum(1) / x[picks, 1].sum(1) - y[picks, 0].sum(1) / y[picks, 1].sum(1)
    low, high = np.quantile(boot, [0.025, 0.975])
    return (x[:, 0].sum() / x[:, 1].sum(), y[:, 0].sum() / y[:, 1].sum()), (float(low), float(high))


def paired(path_a: str, path_b: str, n_boot: int = 2000) -> None:
    missing = [p for p in (path_a, path_b) if not Path(p).is_file()]
    if missing:
        raise SystemExit(f"no such record: {', '.join(missing)}")
    a, b = (json.loads(Path(p).read_text()) for p in (path_a, path_b))
    if (a["temperature"], a["gamma"], a["seeds"]) != (b["temperature"], b["gamma"], b["seeds"]):
        raise SystemExit("the records differ in temperature, gamma or seeds: not paired")
    pa, pb = per_prompt(a), per_prompt(b)
    ids = sorted(set(pa) & set(pb))
    x, y = (np.array([p[i] for i in ids], dtype=float) for p in (pa, pb))
    (ra, rb), (low, high) = pooled_difference(x, y, n_boot)
    print(f"{a['draft']} - {b['draft']} ({len(ids)} prompts x {len(a['seeds'])} seeds, T = {a['temperature']:g}, gamma {a['gamma']}): "
          f"{ra:.3f} - {rb:.3f} = {ra - rb:+.3f} [{low:+.3f}, {high:+.3f}] (paired bootstrap over prompts, seed 0)")


def engine_counts(path: str, method: str | None, temperature: float | None) -> tuple[float, dict[str, tuple[int, int]]]:
    """(temperature, prompt -> (accepted, examined)) of a record of this script or, with ``method``, of the
    gamma-1 runs of ``method`` at ``temperature`` in a bench_wallclock record (each step examines one draft)."""
    if not Path(path).is_file():
        raise SystemExit(f"no such record: {path}")
    if not path.endswith(".jsonl"):
        record = json.loads(Path(path).read_text())
        if record["gamma"] != 1:
            raise SystemExit(f"{path} was run at gamma {record['gamma']}: the prediction is for gamma 1")
        return record["temperature"], per_prompt(record)
    if method is None or temperature is None:
        raise SystemExit("a bench_wallclock record needs --method (the draft's name in it) and --temperature")
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    runs = [r for r in rows if r.get("method") == method and r.get("gamma") == 1 and r.get("temperature") == temperature]
    return temperature, {r["prompt"]: (round(r["acceptance_rate"] * r["steps"]), r["steps"]) for r in runs}


def predicted(engine_path: str, breadth_path: str, method: str | None, temperature: float | None, n_boot: int = 2000) -> None:
    """The engine's acceptance minus the loop's expectation, and minus alpha, of a prompt_breadth record (paired over prompts)."""
    if not Path(breadth_path).is_file():
        raise SystemExit(f"no such record: {breadth_path}")
    t, engine = engine_counts(engine_path, method, temperature)
    key = "greedy" if t == 0 else f"{t:g}"
    breadth = {r["prompt"]: r for r in json.loads(Path(breadth_path).read_text())["per_prompt"] if r["set"] == "held-out"}
    ids = sorted(set(engine) & set(breadth))
    if not ids or any("loop" not in breadth[i] or key not in breadth[i]["loop"] for i in ids):
        raise SystemExit(f"{engine_path} and {breadth_path} share no held-out prompt with the loop's expectations at {key}")
    e = np.array([engine[i] for i in ids], dtype=float)
    loop = np.array([breadth[i]["loop"][key][0][1::-1] for i in ids])  # (accepted, examined)
    alpha = np.array([(breadth[i]["alpha"][key][0] * breadth[i]["positions"][key], breadth[i]["positions"][key]) for i in ids])
    print(f"T = {t:g}, gamma 1, {len(ids)} prompts; engine {e[:, 0].sum() / e[:, 1].sum():.3f} (accepted / examined drafts)")
    for name, x in (("the loop's expectation on the breadth record's sequences", loop), ("alpha on those sequences", alpha)):
        (re, rx), (low, high) = pooled_difference(e, x, n_boot)
        print(f"  engine - {name} {rx:.3f}: {re - rx:+.3f} [{low:+.3f}, {high:+.3f}] (paired bootstrap over prompts, seed 0)")
    if t == 0:
        differ = [i for i, a, b in zip(ids, e, loop) if not np.allclose(a, b)]
        print(f"  greedy: the engine's counts equal the expected counts on {len(ids) - len(differ)} of {len(ids)} prompts; "
              f"differ on {', '.join(differ) or 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--draft", default="fp16:eagle3-v8k")
    parser.add_argument("--gamma", type=int, default=1)
    parser.add_argument("--temperature", type=float, help="default 1")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--per-category", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="reports/loop_acceptance.json")
    parser.add_argument("--paired", nargs=2, metavar=("A", "B"), help="only compare two finished records prompt by prompt")
    parser.add_argument("--predicted", nargs=2, metavar=("ENGINE", "BREADTH"),
                        help="only set an engine record beside the loop's expectation of a prompt_breadth record")
    parser.add_argument("--method", help="with --predicted and a bench_wallclock record: the draft's name in it")
    args = parser.parse_args()
    if args.paired:
        paired(*args.paired)
        return
    if args.predicted:
        predicted(*args.predicted, args.method, args.temperature)
        return
    args.temperature = 1.0 if args.temperature is None else args.temperature
    if args.gamma < 1 or args.per_category < 1 or args.max_new_tokens < 1 or args.temperature <= 0:
        parser.error("--gamma, --per-category and --max-new-tokens must be >= 1 and --temperature > 0 (at T = 0 use bench_wallclock)")
    torch.set_num_threads(args.threads)
    lm, tokenizer = load_embedded(device="cpu")
    draft = draft_from_name(args.draft, lm, tokenizer)
    config = bench.BenchConfig(categories=CATEGORIES, temperatures=(args.temperature,), gammas=(args.gamma,), max_new_tokens=args.max_new_tokens)
    prompts = [p for c in CATEGORIES for p in bench.load_bench_prompts(tokenizer, dataclasses.replace(config, categories=(c,), num_prompts=args.per_category))]
    rows, started = [], time.perf_counter()
    for prompt, seed in tqdm([(p, s) for p in prompts for s in args.seeds], desc=args.draft):
        out = speculative_generate(lm, draft, [list(prompt.token_ids)], verifier="token", gamma=args.gamma, max_new_tokens=args.max_new_tokens,
                                   sampling=SamplingConfig(temperature=args.temperature), seed=[bench.run_seed(prompt.id, seed)],
                                   eos_token_id=tokenizer.eos_token_id)
        steps = [(n, step.gamma) for step in out.steps for n, active in zip(step.num_accepted, step.active) if active and step.gamma]
        accepted = sum(n for n, _ in steps)  # examined as GenerationResult.acceptance_rate counts: a rejection ends a step
        rows.append({"prompt": prompt.id, "seed": seed, "accepted": accepted, "examined": accepted + sum(n < g for n, g in steps)})
    record = {"draft": args.draft, "gamma": args.gamma, "temperature": args.temperature, "seeds": args.seeds,
              "max_new_tokens": args.max_new_tokens, "seconds": round(time.perf_counter() - started, 1), "rows": rows}
    write_json_record(args.out, record, indent=None)
    accepted, examined = sum(r["accepted"] for r in rows), sum(r["examined"] for r in rows)
    print(f"{args.draft}: {accepted} of {examined} drafted tokens accepted = {accepted / examined:.3f} "
          f"({len(prompts)} prompts x {len(args.seeds)} seeds, {record['seconds']:.0f} s); record in {args.out}")


if __name__ == "__main__":
    main()
