"""Would broader training prompts lift a feature head's alpha? Its alpha on three prompt sets, side by side.

* ``seen``: prompts its corpus was sampled from (fresh continuations, other seeds than the corpus');
* ``unseen``: prompts of the same file (same templates) that its corpus never used;
* ``held-out``: the held-out chat prompts (``data/prompts.jsonl``), where the manifests measure.

seen - unseen is what the head memorised of its prompts; unseen - held-out is what the templates'
distribution costs on other prompts: the most that broader prompts (at the same corpus size) could bring
to the held-out alpha, if they made the held-out prompts as familiar as the templates' unseen ones. The
seen alpha is what the head reaches on its own training distribution, a ceiling for that lever.

Per prompt: depth-1 and depth-2 alpha at each temperature (``feature_distill.measure_feature_draft``, one
prompt at a time, seed = its index), pooled over positions, and the token-verification loop's expected
acceptance on the same sequences (``feature_distill.loop_expectations``: only the positions a loop
drafts count, so correlated acceptance shows); 95% bootstrap intervals over the prompts of each set
(1,000 resamples, seed 0), differences resampled independently. ``--paired A B`` compares two
records of two heads prompt by prompt (the same prompts and seeds give the same continuations, so the
difference is paired: one resample of prompts for both). A benchmark: nothing asserted.

    PYTHONPATH=. .venv/bin/python benchmarks/prompt_breadth.py --draft eagle3-v8k --out benchmarks/records/prompt_breadth_2026-11-24.json
    PYTHONPATH=. .venv/bin/python benchmarks/prompt_breadth.py --draft eagle3-v8k --sets held-out --count 70 --out A.json
    PYTHONPATH=. .venv/bin/python benchmarks/prompt_breadth.py --paired A.json B.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from specresearch.drafts.feature import load_feature_draft
from specresearch.drafts.registry import (
    with_weight_storage,
    without_weight_prefix,
)
from specresearch.drafts.store import drafts_dir, read_manifest, shipped_drafts
from specresearch.engine.prompts import encode_chat, load_prompts
from specresearch.experiments.draft_analysis import corpus_spans
from specresearch.experiments.records import record_header, write_json_record
from specresearch.models.embedded import load_embedded
from specresearch.training.feature_corpus import chunk_prompt_order
from specresearch.training.feature_measure import measure_feature_draft

ROOT = Path(__file__).resolve().parent.parent


def evenly(items: list, count: int) -> list:
    return [items[round(i * len(items) / count)] for i in range(count)] if count < len(items) else list(items)


SETS = ("seen", "unseen", "held-out")


def prompt_sets(manifest: dict, count: int, names=SETS) -> dict[str, list[dict]]:
    """The sets ``names``, ``count`` prompts each, evenly spaced (in the corpus' shuffled order for the first two)."""
    held_out = evenly(load_prompts(ROOT / "data" / "prompts.jsonl"), count)
    if set(names) == {"held-out"}:
        return {"held-out": held_out}
    corpus, config = manifest["corpus"], manifest["corpus_config"]
    prompts, size = load_prompts(ROOT / "data" / corpus["prompts_file"]), config["chunk_prompts"]
    spans = [s for s in corpus_spans(manifest) if s["cache_key"] == corpus["cache_key"]]  # a continued head's chain too
    order = chunk_prompt_order(len(prompts), config["seed"], max(max(s["end_chunk"] for s in spans) * size, len(prompts)))
    seen = list(dict.fromkeys(i for s in spans for i in order[s["first_chunk"] * size : s["end_chunk"] * size]))
    unseen = [i for i in order[: len(prompts)] if i not in set(seen)]
    if len(unseen) < count:
        raise SystemExit(f"the corpus used {len(seen)} of the {len(prompts)} prompts of {corpus['prompts_file']}: "
                         f"{len(unseen)} unseen, fewer than --count {count}")
    sets = {"seen": [prompts[i] for i in evenly(seen, count)], "unseen": [prompts[i] for i in evenly(unseen, count)], "held-out": held_out}
    return {name: sets[name] for name in names}


def pooled(sums: np.ndarray, counts: np.ndarray, rng: np.random.Generator, n_boot: int) -> tuple[float, np.ndarray]:
    """The pooled ratio over prompts and its bootstrap replicates (prompts resampled)."""
    picks = rng.integers(0, len(sums), size=(n_boot, len(sums)))
    return float(sums.sum() / counts.sum()), sums[picks].sum(1) / counts[picks].sum(1)


def per_prompt_sums(rows: list[dict], key: str, depth: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Each prompt's summed alpha and its positions at ``key`` (a temperature or "greedy") and depth index ``depth``."""
    counts = np.array([max(r["positions"][key] - depth, 0) for r in rows], dtype=float)
    return np.array([r["alpha"][key][depth] * n if n else 0.0 for r, n in zip(rows, counts)]), counts


def per_prompt_loop_sums(rows: list[dict], key: str, gamma: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Each prompt's expected accepted and examined drafts of the token-verification loop at ``gamma``."""
    values = np.array([r["loop"][key][gamma - 1] for r in rows], dtype=float)  # (examined, accepted, steps)
    return values[:, 1], values[:, 0]


def paired(path_a: str, path_b: str, n_boot: int = 1000) -> None:
    """Depth-1 alpha of record A minus record B on the prompts both measured, resampling prompts once for both."""
    missing = [p for p in (path_a, path_b) if not Path(p).is_file()]
    if missing:
        raise SystemExit(f"no such record: {', '.join(missing)}")
    a, b = (json.loads(Path(p).read_text()) for p in (path_a, path_b))
    index_b = {(r["set"], r["prompt"]): r for r in b["per_prompt"]}
    common = [(r, index_b[r["set"], r["prompt"]]) for r in a["per_prompt"] if (r["set"], r["prompt"]) in index_b]
    if not common:
        raise SystemExit(f"{path_a} and {path_b} share no (set, prompt)")
    if a["max_new_tokens"] != b["max_new_tokens"]:
        raise SystemExit("the records were measured with different --max-new-tokens: not paired")
    rng = np.random.default_rng(0)
    print(f"{a['draft']} - {b['draft']}, depth 1, paired over prompts (95% bootstrap, {n_boot} resamples, seed 0):\n")
    for name in dict.fromkeys(r["set"] for r, _ in common):
        rows = [(ra, rb) for ra, rb in common if ra["set"] == name]
        measures = [("alpha", per_prompt_sums)] + [("loop g1", per_prompt_loop_sums)] * all("loop" in r for pair in rows for r in pair)
        for label, sums in measures:
            for key in rows[0][0]["alpha"]:
                (sa, na), (sb, nb) = sums([ra for ra, _ in rows], key), sums([rb for _, rb in rows], key)
                picks = rng.integers(0, len(rows), size=(n_boot, len(rows)))
                boot = sa[picks].sum(1) / na[picks].sum(1) - sb[picks].sum(1) / nb[picks].sum(1)
                low, high = np.quantile(boot, [0.025, 0.975])
                print(f"  {name} ({len(rows)} prompts) {label} {key:>6}: {sa.sum() / na.sum():.3f} - {sb.sum() / nb.sum():.3f} = "
                      f"{sa.sum() / na.sum() - sb.sum() / nb.sum():+.3f} [{low:+.3f}, {high:+.3f}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--draft", default="eagle3-v8k", help="a shipped feature head or the directory of one (fp16:NAME: float16 weights)")
    parser.add_argument("--count", type=int, default=20, help="prompts per set")
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.6, 1.0])
    parser.add_argument("--depths", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS)
    parser.add_argument("--out", default="reports/prompt_breadth.json")
    parser.add_argument("--paired", nargs=2, metavar=("A", "B"), help="only compare two finished records prompt by prompt")
    args = parser.parse_args()
    if args.paired:
        paired(*args.paired)
        return
    if args.count < 2 or args.depths < 1 or args.max_new_tokens < 1 or any(t <= 0 for t in args.temperatures):
        parser.error("--count must be >= 2, --depths and --max-new-tokens >= 1, --temperatures > 0")
    torch.set_num_threads(args.threads)
    base = without_weight_prefix(args.draft)
    directory = drafts_dir() / base if base in shipped_drafts() else Path(base)
    manifest = read_manifest(directory)
    sets = prompt_sets(manifest, args.count, args.sets)
    target, tokenizer = load_embedded(device="cpu")
    draft = load_feature_draft(target, directory)
    head = with_weight_storage(draft, args.draft, target).head
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    rows = [0.0, *args.temperatures]
    started = time.perf_counter()
    per_prompt = []
    with tqdm(total=sum(map(len, sets.values())), desc="prompts") as bar:
        for name, prompts in sets.items():
            for i, (prompt, ids) in enumerate(zip(prompts, encode_chat(prompts, tokenizer))):
                m = measure_feature_draft(target.model, head, [ids], temperatures=args.temperatures, depths=args.depths,
                                          max_new_tokens=args.max_new_tokens, seed=i, eos_token_ids=eos, progress=False)
                alphas = {**{f"{t:g}": m.alpha[t] for t in args.temperatures}, "greedy": m.greedy_agreement}
                per_prompt.append({"set": name, "prompt": prompt["id"], "alpha": alphas,
                                   "positions": {("greedy" if t == 0 else f"{t:g}"): m.positions[t] for t in rows},
                                   "loop": {("greedy" if t == 0 else f"{t:g}"): [list(v) for v in m.loop[t]] for t in rows}})
                bar.update()
    rng = np.random.default_rng(0)
    summary, replicates, loop_summary = {}, {}, {}
    for name in sets:
        part = [r for r in per_prompt if r["set"] == name]
        for key in [f"{t:g}" for t in args.temperatures] + ["greedy"]:
            for depth in range(args.depths):
                sums, counts = per_prompt_sums(part, key, depth)
                point, boot = pooled(sums, counts, rng, 1000)
                summary[name, key, depth + 1] = (point, *np.quantile(boot, [0.025, 0.975]))
                replicates[name, key, depth + 1] = boot
            point, boot = pooled(*per_prompt_loop_sums(part, key), rng, 1000)
            loop_summary[name, key] = (point, *np.quantile(boot, [0.025, 0.975]))
    print(f"\n{args.draft}: alpha per prompt set ({args.count} prompts each, {args.max_new_tokens} tokens), "
          "95% bootstrap intervals over prompts:\n")
    print("| set | " + " | ".join(f"{k} depth {d}" for k in [f"T = {t:g}" for t in args.temperatures] + ["greedy"]
                                 for d in range(1, args.depths + 1)) + " |")
    print("|---|" + "---|" * ((len(args.temperatures) + 1) * args.depths))
    keys = [f"{t:g}" for t in args.temperatures] + ["greedy"]
    for name in sets:
        cells = [summary[name, k, d] for k in keys for d in range(1, args.depths + 1)]
        print(f"| {name} | " + " | ".join(f"{p:.3f} [{lo:.3f}, {hi:.3f}]" for p, lo, hi in cells) + " |")
    print("\nthe token-verification loop's acceptance at gamma 1 on the same sequences (feature_distill.loop_expectations):\n")
    for name in sets:
        print(f"  {name}: " + ", ".join(f"{k} {p:.3f} [{lo:.3f}, {hi:.3f}]" for k in keys for p, lo, hi in [loop_summary[name, k]]))
    differences = {}
    print("\ndifferences at depth 1 (independent resamples):\n")
    for a, b in [(a, b) for a, b in (("seen", "unseen"), ("unseen", "held-out"), ("seen", "held-out")) if a in sets and b in sets]:
        for k in keys:
            boot = replicates[a, k, 1] - replicates[b, k, 1]
            d = (summary[a, k, 1][0] - summary[b, k, 1][0], *np.quantile(boot, [0.025, 0.975]))
            differences[f"{a} - {b}", k] = d
            print(f"  {k:>6} {a} - {b}: {d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}]")
    record = {**record_header("benchmarks/prompt_breadth.py", sys.argv[1:], draft=args.draft), "corpus": manifest["corpus"],
              "count": args.count, "max_new_tokens": args.max_new_tokens, "threads": args.threads, "seconds": round(time.perf_counter() - started, 1), "per_prompt": per_prompt,
              "summary": [{"set": s, "key": k, "depth": d, "alpha": v[0], "low": v[1], "high": v[2]} for (s, k, d), v in summary.items()],
              "loop_gamma1": [{"set": s, "key": k, "acceptance": v[0], "low": v[1], "high": v[2]} for (s, k), v in loop_summary.items()],
              "differences": [{"pair": p, "key": k, "difference": v[0], "low": v[1], "high": v[2]} for (p, k), v in differences.items()]}
    write_json_record(args.out, record)
    print(f"\n{len(per_prompt)} prompts in {record['seconds']:.0f} s; record in {args.out}")


if __name__ == "__main__":
    main()
