"""Data scaling: alpha vs corpus tokens for the feature head and the distilled LM, on the same data.

Each point trains on the first N chunks of ONE cached feature corpus (``specresearch feature-distill``'s:
``data/distill_prompts_xl.jsonl`` shuffled with seed 0, 64 prompts per chunk, 128 tokens sampled from the
target at T = 1 per prompt; its 1,278 prompts fill 20 chunks, and chunks beyond them sample the reshuffled
prompts again) with the steps given for that point, so a point's training passes over its
data ~4.6 times whatever N is (same recipe, more data). Two drafts per point:

* ``feature``: the ``eagle3-v8k`` head, trained exactly as ``specresearch feature-distill --preset eagle3-v8k
  --chunks N --steps S --batch-size 8 --lr 2e-3 --warmup-steps 10 --rollout 2 --checkpoint-every 10`` would
  (same run key, so the two share checkpoints);
* ``distill``: the 4-layer ``v8k-4l`` small LM (``specresearch distill``'s recipe: lr 1e-3, 20 warm-up
  steps, batch 8, seq_len 256) trained on the very same tokens and teacher top-64
  (``feature_distill.as_distill_corpus``).

Both are measured on the same 14 held-out prompts of ``data/prompts.jsonl`` (64 tokens per temperature,
seed 0; alpha at T = 0.2 / 0.6 / 1.0, and per depth for the feature head) with c timed at the end of the
run. One manifest per (draft, N, S) in ``--out``; weights stay in the cache. Resumable: finished points
are skipped, an interrupted training resumes from its checkpoint.

    nohup python benchmarks/run_data_scaling.py --threads 1 --kinds feature > results/scaling_feature.log 2>&1 &
    nohup python benchmarks/run_data_scaling.py --threads 1 --kinds distill > results/scaling_distill.log 2>&1 &
    python benchmarks/run_data_scaling.py --table   # the table of the finished points (notebook 09 plots them)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

POINTS = ("2:74", "6:220", "17:640", "34:1280")  # chunks:steps, ~4.6 passes over the data each


def _points(specs: list[str]) -> list[tuple[int, int]]:
    out = []
    for spec in specs:
        chunks, _, steps = spec.partition(":")
        if not (chunks.isdigit() and steps.isdigit() and int(chunks) > 0 and int(steps) > 0):
            raise SystemExit(f"error: --points takes CHUNKS:STEPS with both positive integers, got {spec!r}")
        out.append((int(chunks), int(steps)))
    return out


def _manifest_path(out: Path, kind: str, chunks: int, steps: int) -> Path:
    return out / f"{kind}_{chunks}chunks_{steps}steps.json"


def run_feature(lm, tokenizer, chunks: int, steps: int, args) -> dict:
    from specresearch.drafts.feature import FeatureHeadConfig
    from specresearch.training.feature_corpus import FeatureCorpusConfig
    from specresearch.training.feature_distill import (
        FeatureTrainConfig,
        run_feature_distillation,
    )
    from specresearch.training.loop import cache_dir

    config = FeatureTrainConfig(steps=steps, batch_size=8, lr=2e-3, warmup_steps=10, rollout=2, checkpoint_every=10)
    command = (f"specresearch feature-distill --preset eagle3-v8k --prompts {args.prompts} --chunks {chunks} --steps {steps} "
               f"--batch-size 8 --lr 2e-3 --warmup-steps 10 --rollout 2 --checkpoint-every 10 --threads {args.threads}")
    return run_feature_distillation(lm, tokenizer, FeatureHeadConfig.from_name("eagle3-v8k"), config, FeatureCorpusConfig(),
                                    prompts_path=args.prompts, heldout_path=args.heldout, chunks=chunks,
                                    out_dir=cache_dir() / "scaling" / f"feature-{chunks}-{steps}",
                                    max_seconds=None if args.max_minutes is None else 60 * args.max_minutes, command=command)


def run_distill(lm, tokenizer, chunks: int, steps: int, args) -> dict:
    from specresearch.drafts.distilled import DraftConfig
    from specresearch.training.distill import distill_on_corpus
    from specresearch.training.feature_corpus import (
        FeatureCorpusConfig,
        as_distill_corpus,
        load_feature_chunks,
    )
    from specresearch.training.loop import TrainConfig, cache_dir

    key = FeatureCorpusConfig().key(args.prompts)
    chunk = load_feature_chunks(cache_dir() / "features" / key, chunks)  # run the feature points first to collect it
    config = TrainConfig(steps=steps, batch_size=8, seq_len=256, lr=1e-3, warmup_steps=20, checkpoint_every=20)
    corpus, teacher = as_distill_corpus(chunk, config.seq_len)
    del chunk
    record = {"prompts_file": Path(args.prompts).name, "cache_key": key, "chunks": chunks, "sequences": len(corpus.sequences),
              "generated_tokens": corpus.num_generated_tokens}
    return distill_on_corpus(lm.model, tokenizer, DraftConfig.from_name("v8k-4l"), config, corpus, teacher, corpus_record=record,
                             run_dir=cache_dir() / "scaling" / f"distill-{chunks}-{steps}-run",
                             out_dir=cache_dir() / "scaling" / f"distill-{chunks}-{steps}", heldout_path=args.heldout,
                             max_seconds=None if args.max_minutes is None else 60 * args.max_minutes,
                             command=" ".join(["python", *sys.argv]))


def table(out: Path) -> None:
    from specresearch.experiments.draft_analysis import read_scaling

    rows = read_scaling(out)
    print("| draft | corpus tokens | steps | alpha T = 0.2 | T = 0.6 | T = 1.0 | greedy agreement | c |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for _, r in rows.iterrows():
        name = "eagle3-v8k (feature head)" if r["kind"] == "feature" else "v8k-4l (distilled LM)"
        alphas = " | ".join(f"{r[f'alpha_T{t}']:.3f}" for t in ("0.2", "0.6", "1.0"))
        print(f"| {name} | {r['tokens']:,} | {r['steps']} | {alphas} | {r['greedy']:.3f} | {r['c']:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--points", nargs="+", default=list(POINTS), help="CHUNKS:STEPS per point")
    parser.add_argument("--kinds", nargs="+", choices=("feature", "distill"), default=["feature", "distill"])
    parser.add_argument("--prompts", default="data/distill_prompts_xl.jsonl")
    parser.add_argument("--heldout", default="data/prompts.jsonl")
    parser.add_argument("--out", default="benchmarks/records/scaling", help="directory of the per-point manifests")
    parser.add_argument("--max-minutes", type=float, help="per point: stop and checkpoint after this long (rerun to resume)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--table", action="store_true", help="only print the table of the finished points (manifests in --out)")
    args = parser.parse_args()
    out = Path(args.out)
    if args.table:
        table(out)
        return
    points = _points(args.points)
    torch.set_num_threads(args.threads)
    from specresearch.models.embedded import load_embedded

    lm, tokenizer = load_embedded(device="cpu")
    out.mkdir(parents=True, exist_ok=True)
    for chunks, steps in points:
        for kind in args.kinds:
            path = _manifest_path(out, kind, chunks, steps)
            if path.exists() and json.loads(path.read_text()).get("finished"):
                print(f"{path} exists, skipped", flush=True)
                continue
            start = time.perf_counter()
            manifest = (run_feature if kind == "feature" else run_distill)(lm, tokenizer, chunks, steps, args)
            if manifest.get("finished"):
                path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            print(f"{kind} {chunks} chunks {steps} steps: finished={manifest.get('finished')} "
                  f"({time.perf_counter() - start:.0f} s) -> {path}", flush=True)


if __name__ == "__main__":
    main()
