"""The compiled 1-8-row product (``models.native``) against MKL's, on the embedded target: the cost curve r_n and the
head's chains and trees, side by side in one run; or (``--layers draft``) the kernel in the draft's layers against the
products they take without it.

One target, one process: before each run the target's linear layers are given the kernel rows this machine chose
(``kernels.choose_kernel_rows``, variant ``native``) or none (variant ``mkl``: the products ``CausalLM`` used before the
kernel). First r_n, a cached call scoring n tokens over one scoring 1, for both variants, interleaved medians. Then for
each held-out chat prompt, temperature and repeat, autoregressive decoding and the ``--runs`` (labels of
``bench_trees.RUNS``) in both variants, in a shuffled order. Speeds are over the ``mkl`` variant's autoregressive
decoding of the same prompts (pooled, 95 % bootstrap intervals over the prompts, ``bench_dtype.speeds``); the two
variants' autoregressive runs both score one token a call, which the kernel leaves to MKL, so they differ by noise
alone. The kernel changes float rounding only, so the runs are lossless either way. A benchmark: nothing is asserted.

With ``--layers draft`` the target keeps the kernel rows it chose in both variants and the draft's layers (a feature
head's, a distilled draft's) are given the rows the draft chose (variant ``native``) or none (variant ``torch``: its
float16 weights then multiply as ``kernels.skinny_linear``'s float16 product); speeds are over the ``torch`` variant's
autoregressive decoding, which no draft touches, and there is no r_n curve (the target is the same in both).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_native.py --prompts 8 --threads 1
    PYTHONPATH=. .venv/bin/python benchmarks/bench_native.py --prompts 8 --threads 1 --layers draft \
        --runs 'chain block g1' 'chain block g2' --out benchmarks/records/native_draft_avx2_amd
    PYTHONPATH=. .venv/bin/python benchmarks/bench_native.py --table benchmarks/records/native_amd.csv   (reprint)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import pandas as pd
import torch
from bench_dtype import common_arguments, paired, speeds
from bench_trees import RUNS

from specresearch.config import SamplingConfig
from specresearch.drafts.registry import load_pair
from specresearch.engine.cost import score_seconds
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.engine.prompts import encode_chat, evenly_spaced, load_prompts
from specresearch.experiments.records import machine_info, record_files, record_header
from specresearch.models.kernels import use_kernel_rows
from specresearch.paths import data_dir, repo_root

DEFAULT_RUNS = ("chain block g1", "chain block g2", "dynamic K3 g1 n3", "dynamic K2 g2 n4", "dynamic K3 g3 n6")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_arguments(parser, "native")
    parser.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS), choices=sorted(RUNS))
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8], help="widths n of the r_n curve")
    parser.add_argument("--layers", choices=("target", "draft"), default="target",
                        help="whose linear layers the two variants give the kernel rows or none")
    args = parser.parse_args()
    if args.table:
        report(pd.read_csv(args.table))
        return 0
    if args.prompts < 1 or args.repeats < 1 or min(args.ks) < 1:
        parser.error("--prompts, --repeats and every --ks must be >= 1")
    torch.set_num_threads(args.threads)
    target, draft, tokenizer = load_pair(draft=args.draft)
    toggled = target.model if args.layers == "target" else draft_layers(draft)
    if toggled is None:
        parser.error(f"--layers draft: draft {args.draft!r} has no layers of its own")
    chosen = sorted({r for m in toggled.modules() if hasattr(m, "kernel_rows") for r in m.kernel_rows})
    if not chosen:
        print(f"the kernel is not used in the {args.layers}'s layers on this machine (not built here, or slower than "
              "their products for every row count): nothing to compare", file=sys.stderr)
        return 1
    print(f"kernel rows chosen here for the {args.layers}: {chosen}", flush=True)
    variants = {"mkl" if args.layers == "target" else "torch": (), "native": tuple(chosen)}
    curve = {}
    if args.layers == "target":
        score_seconds(target, args.ks, repeats=3)  # warm: the first timed calls of a process run slow
    for name, rows in variants.items() if args.layers == "target" else ():
        use_kernel_rows(target.model, rows)
        seconds = score_seconds(target, args.ks, repeats=15)
        curve[name] = {k: seconds[k] / seconds[1] for k in args.ks}
        ratios = ", ".join(f"r_{k} = {r:.2f}" for k, r in curve[name].items())
        print(f"{name}: one-token call {1000 * seconds[1]:.1f} ms; {ratios}", flush=True)
    prompts = evenly_spaced(load_prompts(data_dir() / "prompts.jsonl"), args.prompts)
    runs = [(variant, label) for variant in variants for label in ("autoregressive", *args.runs)]
    machine = machine_info()
    cpu = machine.get("cpu", "cpu").split()[0].lower()
    default = f"native_{cpu}" if args.layers == "target" else f"native_draft_{cpu}"
    stem = Path(args.out) if args.out else repo_root() / "benchmarks" / "records" / default
    csv_path, json_path = record_files(stem)  # the stem may hold dots
    rows = []
    for i, prompt in enumerate(prompts):
        ids = encode_chat([prompt], tokenizer)[0].tolist()
        for temperature in args.temperatures:
            for repeat in range(args.repeats):
                for variant, label in random.Random(f"{i} {temperature} {repeat}").sample(runs, len(runs)):
                    use_kernel_rows(toggled, variants[variant])
                    common = dict(max_new_tokens=args.max_new_tokens, sampling=SamplingConfig(temperature=temperature),
                                  seed=[1000 + i], eos_token_id=tokenizer.eos_token_id)
                    out = (autoregressive_generate(target, [ids], **common) if label == "autoregressive" else
                           speculative_generate(target, draft, [ids], **RUNS[label], **common))
                    rows.append({"prompt_id": prompt["id"], "temperature": temperature, "repeat": repeat,
                                 "variant": variant, "run": label, "tau": out.block_efficiency,
                                 "tokens": out.num_tokens, "seconds": out.seconds})
        pd.DataFrame(rows).to_csv(csv_path, index=False)  # after each prompt: a stopped run keeps them
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
    table = report(pd.DataFrame(rows))
    header = record_header("benchmarks/bench_native.py", sys.argv[1:], draft=args.draft, layers=args.layers,
                           kernel_rows=chosen,
                           r_n={name: {str(k): round(r, 4) for k, r in c.items()} for name, c in curve.items()},
                           summary=json.loads(table.to_json(orient="records")))
    json_path.write_text(json.dumps(header, indent=2) + "\n")
    return 0


def draft_layers(draft) -> torch.nn.Module | None:
    """The module holding a draft's linear layers: a feature head's, a distilled draft's model (inside a lookup-or-draft
    wrapper too); None for drafts without weights."""
    inner = getattr(draft, "draft", None) or draft  # drafts.combined.LookupOrDraft wraps one
    module = getattr(inner, "head", None)
    module = getattr(inner, "model", None) if module is None else module
    return module if isinstance(module, torch.nn.Module) else None


def report(frame: pd.DataFrame) -> pd.DataFrame:
    """Print every run's speed in both variants, each run's native over base speed and over native's autoregressive
    decoding, paired (the base: ``mkl``, or ``torch`` for the draft's layers); return the speeds."""
    base = "mkl" if "mkl" in set(frame.variant) else "torch"
    table = speeds(frame, column="variant", base=base)
    print(table.round(3).to_string(index=False))
    runs = [r for r in dict.fromkeys(frame.run) if r != "autoregressive"]
    pairs = pd.concat([paired(frame, ("native", r), (base, r), column="variant") for r in runs])
    print(pairs.round(3).to_string(index=False))
    # where the kernel takes one row too, its autoregressive decoding is the faster one: each run over it, paired
    print("native's runs over native's autoregressive decoding:")
    print(pd.concat([paired(frame, ("native", r), ("native", "autoregressive"), column="variant") for r in runs])
          .round(3).to_string(index=False))
    best = table[table.variant == "native"].groupby("run")[f"vs_{base}_ar"].mean().drop("autoregressive").idxmax()
    if "chain block g1" in runs:
        print(f"native's fastest run, {best}, over {base}'s gamma-1 chain:")
        print(paired(frame, ("native", best), (base, "chain block g1"), column="variant").round(3).to_string(index=False))
    return table


if __name__ == "__main__":
    sys.exit(main())
