"""``specresearch distill`` and ``specresearch feature-distill``: train a draft for the embedded target (resumable).

Kept beside ``cli.py``, which registers them, so that each stays one screenful of commands.
"""

from __future__ import annotations

import sys

from specresearch.cli_checks import check_prompts_file

__all__ = ["add_distill", "add_feature_distill"]


# The flags both commands share with their config's fields (each command adds its own after these)
_COMMON_FIELDS = [("--seed", int), ("--steps", int), ("--batch-size", int), ("--seq-len", int), ("--lr", float),
                  ("--warmup-steps", int), ("--checkpoint-every", int)]


def _training_command(sub, command, name: str, what: str, example: str, preset: str, presets: str, config: str,
                      fields: list):
    """A training command's parser: its preset (default ``preset``; ``presets``: that flag's help), the embedded
    target and one flag per field of its ``config`` dataclass (``_COMMON_FIELDS`` + ``fields``)."""
    p = command(sub, name, what, example)
    p.add_argument("--preset", default=preset, help=presets)
    p.add_argument("--target", default="smollm2-135m-instruct", help="embedded target model")
    for flag, kind in _COMMON_FIELDS + fields:
        p.add_argument(flag, type=kind, help=f"{config} field (default: the dataclass default)")
    return p


def add_distill(sub, command) -> None:
    p = _training_command(sub, command, "distill",
                          "train a KL-distilled draft for the embedded target (resumable; ships to data/drafts/)",
                          "  specresearch distill --preset v8k-1l --prompts data/distill_prompts.jsonl --steps 40 "
                          "--out /tmp/my-draft --max-minutes 10", "v8k-4l", "draft preset (specresearch.drafts.distilled.DRAFT_PRESETS)",
                          "TrainConfig",
                          [("--corpus-temperature", float), ("--corpus-max-new-tokens", int),
                           ("--corpus-samples-per-prompt", int), ("--corpus-batch-size", int), ("--teacher-top-k", int),
                           ("--weight-decay", float)])
    p.add_argument("--prompts", default="data/distill_prompts.jsonl", help="distillation prompts")
    p.add_argument("--measure-tokens", type=int, default=64, help="continuation length in the measurement")
    _add_run_flags(p)
    p.set_defaults(func=_run_distill)


def _add_run_flags(p) -> None:
    """The flags both training commands share: the held-out measurement, where the draft goes, time and threads."""
    p.add_argument("--heldout", default="data/prompts.jsonl", help="held-out prompts for the measurement")
    p.add_argument("--heldout-prompts", type=int, default=14, help="how many held-out prompts (evenly spaced)")
    p.add_argument("--out", help="output directory (default data/drafts/<preset>)")
    p.add_argument("--max-minutes", type=float, help="stop and checkpoint after this long; rerun the command to resume")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")


def _run_distill(args) -> int:
    import json

    import torch

    from specresearch.models.embedded import load_embedded
    from specresearch.training.distill import DraftConfig, run_distillation
    from specresearch.training.loop import TrainConfig

    check_prompts_file("--prompts", args.prompts)
    check_prompts_file("--heldout", args.heldout)
    torch.set_num_threads(args.threads)
    fields = {f: getattr(args, f) for f in TrainConfig.__dataclass_fields__ if getattr(args, f, None) is not None}
    draft_config, train_config = DraftConfig.from_name(args.preset), TrainConfig(**fields)  # validated before loading
    lm, tokenizer = load_embedded(args.target, device="cpu")
    manifest = run_distillation(
        lm.model, tokenizer, draft_config, train_config, prompts_path=args.prompts,
        heldout_path=args.heldout, out_dir=args.out, heldout_prompts=args.heldout_prompts,
        measure_tokens=args.measure_tokens, max_seconds=None if args.max_minutes is None else 60 * args.max_minutes,
        command="specresearch " + " ".join(sys.argv[1:]),
    )
    if not manifest["finished"]:
        print(f"stopped at step {manifest['training']['steps']}; rerun the same command to resume")
        return 0
    print(json.dumps({k: manifest[k] for k in ("measurement", "cost", "training")}, indent=2))
    return 0


def add_feature_distill(sub, command) -> None:
    p = _training_command(sub, command, "feature-distill",
                          "train an EAGLE-style feature draft for the embedded target (resumable; ships to data/drafts/)",
                          "  specresearch feature-distill --preset eagle3-v8k --chunks 1 --steps 20 --out /tmp/my-head "
                          "--max-minutes 10", "eagle3-v8k",
                          "feature head preset (specresearch.drafts.feature.FEATURE_PRESETS)", "FeatureTrainConfig",
                          [("--rollout", int), ("--feature-loss-weight", float), ("--feature-noise", float),
                           ("--tv-loss-weight", float)])
    p.add_argument("--bf16-autocast", action="store_true", default=None,
                   help="train under bfloat16 autocast (FeatureTrainConfig.bf16_autocast; float32 weights and optimiser)")
    p.add_argument("--prompts", default="data/distill_prompts_xl.jsonl", help="corpus prompts")
    p.add_argument("--chunks", type=int, default=5,
                   help="corpus chunks (64 prompts each) to collect and train on; beyond one pass over the prompts, "
                        "chunks are new samples of reshuffled prompts")
    p.add_argument("--first-chunk", type=int, default=0,
                   help="train on chunks FIRST_CHUNK .. FIRST_CHUNK + CHUNKS - 1 (the earlier ones are neither collected nor read)")
    p.add_argument("--init-from", metavar="DIR",
                   help="continue training a saved head (a directory, or a shipped draft's name) of this preset instead of "
                        "a new head: new optimiser and schedule, the head's token ids kept; recorded in the manifest")
    p.add_argument("--collect-only", action="store_true", help="collect (and cache) the corpus chunks, do not train")
    p.add_argument("--save-tokens", action="store_true",
                   help="with --collect-only: write the chunks' sampled token ids to data/corpora/<corpus key>.npz (small, "
                        "committed); collection and training rebuild the chunks it holds instead of sampling them. With "
                        "--first-chunk N (at most the chunks the file holds) only chunks N on are collected, and the file "
                        "keeps the ids it holds")
    _add_run_flags(p)
    p.set_defaults(func=_run_feature_distill)


def _run_feature_distill(args) -> int:
    import json

    import torch

    from specresearch.drafts.feature import FeatureHeadConfig
    from specresearch.models.embedded import load_embedded
    from specresearch.training.feature_corpus import FeatureCorpusConfig
    from specresearch.training.feature_distill import (
        FeatureTrainConfig,
        run_feature_distillation,
    )

    check_prompts_file("--prompts", args.prompts)
    check_prompts_file("--heldout", args.heldout)
    if args.chunks < 1:
        raise ValueError(f"--chunks must be >= 1, got {args.chunks}")
    if args.first_chunk < 0:
        raise ValueError(f"--first-chunk must be >= 0, got {args.first_chunk}")
    if args.save_tokens and args.first_chunk:
        from specresearch.training.feature_corpus import (
            FeatureCorpusConfig,
            stored_chunk_count,
        )

        stored = stored_chunk_count(FeatureCorpusConfig().key(args.prompts))
        if stored < args.first_chunk:
            raise ValueError(f"--save-tokens writes the ids of every chunk from chunk 0 on, and the committed ids hold the "
                             f"first {stored} chunks only; pass --first-chunk {stored} or lower, or drop --first-chunk")
    if args.init_from is not None and args.collect_only:
        raise ValueError("--init-from goes with training, not with --collect-only")
    if args.init_from is not None:
        from specresearch.drafts.feature import feature_head_dir

        feature_head_dir(args.init_from)  # a saved feature head, checked before the target loads
    if args.save_tokens and not args.collect_only:
        raise ValueError("--save-tokens goes with --collect-only")
    torch.set_num_threads(args.threads)
    fields = {f: getattr(args, f) for f in FeatureTrainConfig.__dataclass_fields__ if getattr(args, f, None) is not None}
    head_config, train_config = FeatureHeadConfig.from_name(args.preset), FeatureTrainConfig(**fields)  # before loading
    lm, tokenizer = load_embedded(args.target, device="cpu")
    if args.collect_only:
        return _collect_chunks(lm, tokenizer, args)
    manifest = run_feature_distillation(
        lm, tokenizer, head_config, train_config, FeatureCorpusConfig(),
        prompts_path=args.prompts, heldout_path=args.heldout, chunks=args.chunks, first_chunk=args.first_chunk, init_from=args.init_from,
        out_dir=args.out, heldout_prompts=args.heldout_prompts,
        max_seconds=None if args.max_minutes is None else 60 * args.max_minutes, command="specresearch " + " ".join(sys.argv[1:]),
    )
    if not manifest["finished"]:
        print(f"stopped ({manifest['corpus']['chunks_available']} of {args.chunks} chunks, "
              f"{manifest.get('training', {}).get('steps', 0)} steps); rerun the same command to resume")
        return 0
    print(json.dumps({k: manifest[k] for k in ("measurement", "cost")}, indent=2))
    return 0


def _collect_chunks(lm, tokenizer, args) -> int:
    from specresearch.engine.prompts import encode_chat, load_prompts
    from specresearch.training.feature_corpus import (
        FeatureCorpusConfig,
        collect_feature_corpus,
        corpus_token_file,
        save_corpus_tokens,
        stored_corpus_tokens,
    )
    from specresearch.training.loop import cache_dir

    config = FeatureCorpusConfig()
    key = config.key(args.prompts)
    directory, token_file = cache_dir() / "features" / key, corpus_token_file(key)
    stored = stored_corpus_tokens(key)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    available = collect_feature_corpus(lm.model, encode_chat(load_prompts(args.prompts), tokenizer), config, directory, eos_token_ids=eos,
                                       max_chunks=args.first_chunk + args.chunks,
                                       max_seconds=None if args.max_minutes is None else 60 * args.max_minutes, stored=stored,
                                       first=args.first_chunk)
    print(f"{available} of {args.chunks} chunks in {directory}" + ("" if available == args.chunks else "; rerun the same command to resume")
          + (f" (the first {len(stored)} are rebuilt from {token_file} when missing, not sampled)" if stored else ""))
    if args.save_tokens:  # the committed chunks, then the consecutive ones sampled after them
        written = save_corpus_tokens(directory, token_file, key, count=args.first_chunk + available, stored=stored)
        print(f"token ids of {written} chunks written to {token_file}")
    return 0
