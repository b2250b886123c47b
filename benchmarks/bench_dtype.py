"""The target in float32 or bfloat16 on this CPU: autoregressive decoding and the head's chains side by side in one run.

On a CPU with AVX512-BF16 a bfloat16 target scores several tokens in one call for little more than one (records
``trees_head_bf16_amd`` / ``trees_head_fp32_amd``: a call scoring 8 tokens costs 1.17 one-token calls against 2.0),
while one token costs about what float32's does; so longer chains may pay. Both targets are loaded in one process and,
for each prompt, temperature and repeat, every run (autoregressive decoding and gamma-1..3 chains of the shipped head,
block verification, for each dtype) is timed in a shuffled order, so drift on a shared machine falls on all alike.
Speeds are over **float32** autoregressive decoding of the same prompt (total tokens over total seconds, pooled over
prompts and repeats), with 95 % bootstrap intervals over the prompts. A bfloat16 target is another model numerically
(its greedy text can differ from float32's); each run is lossless for its own target. A benchmark: nothing is asserted.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_dtype.py --prompts 8 --threads 1
    PYTHONPATH=. .venv/bin/python benchmarks/bench_dtype.py --table benchmarks/records/dtype_amd.csv   (reprint)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from specresearch.config import SamplingConfig
from specresearch.drafts.registry import load_pair
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.engine.prompts import encode_chat, evenly_spaced, load_prompts
from specresearch.experiments.analysis import pooled_speed
from specresearch.experiments.records import machine_info, record_files, record_header
from specresearch.paths import data_dir, repo_root

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _pooled(values: np.ndarray, n_boot: int) -> tuple[float, float, float]:
    """(b's seconds per token) / (a's) pooled over the prompts, from per-prompt sums ``values [P, 4]`` (a's seconds,
    a's tokens, b's seconds, b's tokens), with a 95 % bootstrap interval over the prompts."""
    speed = pooled_speed(*values.T, n_boot=n_boot)
    return speed["speed"], speed["low"], speed["high"]


def _sums(frame: pd.DataFrame, temperature: float, variant: str, run: str, column: str = "dtype") -> pd.DataFrame:
    cell = frame[(frame.temperature == temperature) & (frame[column] == variant) & (frame.run == run)]
    return cell.groupby("prompt_id")[["seconds", "tokens"]].sum()


def paired(frame: pd.DataFrame, a: tuple[str, str], b: tuple[str, str], n_boot: int = 2000, column: str = "dtype") -> pd.DataFrame:
    """Per temperature: run ``a`` = (variant, run) over run ``b``, tokens per second pooled over the same prompts; the
    variant (a dtype here, ``bench_native``'s product) is the value of ``column``."""
    rows = []
    for temperature in sorted(frame.temperature.unique()):
        values = pd.concat([_sums(frame, temperature, *a, column), _sums(frame, temperature, *b, column)], axis=1, join="inner")
        point, low, high = _pooled(values.to_numpy(), n_boot)
        rows.append({"temperature": temperature, "a": " ".join(a), "b": " ".join(b), "a_over_b": point, "low": low,
                     "high": high})
    return pd.DataFrame(rows)


def speeds(frame: pd.DataFrame, n_boot: int = 2000, column: str = "dtype", base: str = "float32") -> pd.DataFrame:
    """Per temperature, variant (``column``) and run: tokens per second over autoregressive decoding of variant ``base``
    on the same prompts and repeats (pooled, column ``vs_<base>_ar``), with a 95 % bootstrap interval over the prompts."""
    rows = []
    for (temperature, variant, run), cell in frame.groupby(["temperature", column, "run"]):
        baseline = _sums(frame, temperature, base, "autoregressive", column)
        values = pd.concat([_sums(frame, temperature, variant, run, column), baseline], axis=1, join="inner")
        point, low, high = _pooled(values.to_numpy(), n_boot)
        rows.append({"temperature": temperature, column: variant, "run": run, "tau": cell.tau.mean(),
                     "ms_per_token": 1000 * cell.seconds.sum() / cell.tokens.sum(), f"vs_{base}_ar": point,
                     "low": low, "high": high})
    return pd.DataFrame(rows)


def common_arguments(parser: argparse.ArgumentParser, stem: str) -> None:
    """The options this benchmark shares with ``bench_native``: prompts, temperatures, tokens, repeats, threads, the
    draft, the record stem (default ``benchmarks/records/<stem>_<cpu>``) and ``--table``."""
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2, help="times each run is timed per prompt and temperature")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--draft", default="fp16:eagle3-v8k")
    parser.add_argument("--out", default=None, help=f"record stem (default benchmarks/records/{stem}_<cpu>)")
    parser.add_argument("--table", default=None, help="reprint a record's CSV (runs nothing)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_arguments(parser, "dtype")
    parser.add_argument("--gammas", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args()
    if args.table:
        report(pd.read_csv(args.table))
        return 0
    if args.prompts < 1 or args.repeats < 1 or min(args.gammas) < 1:
        parser.error("--prompts, --repeats and every --gammas must be >= 1")
    torch.set_num_threads(args.threads)
    pairs = {name: load_pair(draft=args.draft, dtype=dtype) for name, dtype in DTYPES.items()}
    tokenizer = pairs["float32"][2]
    prompts = evenly_spaced(load_prompts(data_dir() / "prompts.jsonl"), args.prompts)
    runs = [(name, None) for name in DTYPES] + [(name, g) for name in DTYPES for g in args.gammas]
    machine = machine_info()
    cpu = machine.get("cpu", "cpu").split()[0].lower()
    stem = Path(args.out) if args.out else repo_root() / "benchmarks" / "records" / f"dtype_{cpu}"
    csv_path, json_path = record_files(stem)  # the stem may hold dots
    rows = []
    for i, prompt in enumerate(prompts):
        ids = encode_chat([prompt], tokenizer)[0].tolist()
        for temperature in args.temperatures:
            sampling = SamplingConfig(temperature=temperature)
            for repeat in range(args.repeats):
                order = random.Random(f"{i} {temperature} {repeat}").sample(runs, len(runs))
                for name, gamma in order:
                    target, draft, _ = pairs[name]
                    common = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=[1000 + i],
                                  eos_token_id=tokenizer.eos_token_id)
                    out = (autoregressive_generate(target, [ids], **common) if gamma is None else
                           speculative_generate(target, draft, [ids], verifier="block", gamma=gamma, **common))
                    rows.append({"prompt_id": prompt["id"], "temperature": temperature, "repeat": repeat, "dtype": name,
                                 "run": "autoregressive" if gamma is None else f"chain block g{gamma}",
                                 "tau": out.block_efficiency, "tokens": out.num_tokens, "seconds": out.seconds})
        pd.DataFrame(rows).to_csv(csv_path, index=False)  # after each prompt: a stopped run keeps them
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
    table = report(pd.DataFrame(rows))
    header = record_header("benchmarks/bench_dtype.py", sys.argv[1:], draft=args.draft,
                           summary=json.loads(table.to_json(orient="records")))
    json_path.write_text(json.dumps(header, indent=2) + "\n")
    return 0


def report(frame: pd.DataFrame) -> pd.DataFrame:
    """Print the speeds and bfloat16's fastest chain against float32's gamma-1 chain, paired; return the speeds."""
    table = speeds(frame)
    print(table.round(3).to_string(index=False))
    chains = table[(table.dtype == "bfloat16") & (table.run != "autoregressive")]
    best = chains.groupby("run").vs_float32_ar.mean().idxmax()
    print(paired(frame, ("bfloat16", best), ("float32", "chain block g1")).round(3).to_string(index=False))
    return table


if __name__ == "__main__":
    sys.exit(main())
