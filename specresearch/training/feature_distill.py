"""Training of feature drafts (:class:`specresearch.drafts.feature.FeatureHead`): corpus, loss, rollout.

Notation as in the package docstring: p = target, q = draft, alpha = E[sum_x min(p, q)], c = cost of
one draft step over one target step.

Pipeline (``specresearch feature-distill`` runs it, resumably, from one seed):

1. **Corpus, cached in chunks** (:func:`collect_feature_corpus`): the prompts are shuffled (seeded)
   and cut into chunks of ``chunk_prompts``; asking for more chunks than one pass over the prompts holds
   continues with the next shuffle of the same generator, so later passes are new samples of the same
   prompts and the first pass's chunks stay what they were. Each chunk is sampled from the target with
   ``distill.generate_corpus`` (seed ``seed + chunk``), then ONE batched target forward computes, at
   every position, the target's hidden states at ``store_layers`` (bfloat16) and, at each position
   whose next token the target generated, the top ``teacher_top_k`` of p (the teacher). A chunk is one
   file: an interrupted collection resumes at the first missing chunk, and training can start on the
   chunks that exist (the data-scaling curve trains on prefixes of them). The cache lives outside the
   repository (~4 KB per token); the sampled token ids alone are committed under ``data/corpora/``
   (:func:`save_corpus_tokens`), and a chunk they hold is rebuilt by the teacher-forced forward alone
   instead of being sampled again (sampling is nearly all of a chunk's time).
2. **Training** (:func:`train_feature_head`): AdamW on the head's layers (the target's embedding and
   head rows stay frozen). The loss, averaged over rollout passes k = 0..``rollout``-1, is
   ``KL(p~ || q_k) + feature_loss_weight * SmoothL1(h_k, f_next)``: p~ the teacher's top k renormalised
   over the head's support, q_k the head's law at depth k+1, h_k its predicted (post-norm) feature,
   f_next the target's true last feature at that position. Pass k feeds the head its own features of
   pass k-1 (EAGLE-3's "training-time test", Li et al. 2025, arXiv 2503.01840): pass k at position j
   attends to true-feature slots up to j-k and to the slots of passes 1..k on its own draft path, which
   is exactly what the head sees when drafting the (k+1)-th token after the last verified one. So
   drafting several tokens ahead is trained, not only the first (plain teacher forcing, EAGLE-1,
   collapses after the first token); uniform noise on the true input features (EAGLE-1) is an option.
3. Measurement (:func:`measure_feature_draft`) and shipping (``feature_drafts.save_feature_head``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from specresearch.checks import check_field
from specresearch.training.feature_corpus import (
    FeatureChunk,
    FeatureCorpusConfig,
    _load_chunk,
    _resolve_layers,
    collect_feature_corpus,
    load_feature_chunks,
    stored_corpus_tokens,
)
from specresearch.training.feature_measure import (
    measure_feature_cost,
    measure_feature_draft,
)
from specresearch.training.loop import (
    batch_schedule,
    cache_dir,
    learning_rate,
    load_checkpoint,
    save_checkpoint,
)
from specresearch.training.teacher import sparse_kl, sparse_tv

__all__ = ["FeatureTrainConfig", "FeatureTrainResult", "feature_loss", "train_feature_head", "run_feature_distillation"]


@dataclass(frozen=True)
class FeatureTrainConfig:
    """Optimisation settings (AdamW, linear warm-up then cosine decay to 10 %).

    Attributes:
        seed: batch order and noise. steps, batch_size (sequences), seq_len (sequences are cut), lr,
            warmup_steps, weight_decay, grad_clip (max global grad norm): as for ``distill.TrainConfig``.
        rollout: training-time-test passes D (depths 1..D are trained; 1 = teacher forcing only).
        feature_loss_weight: weight of SmoothL1(predicted feature, the target's final feature) per pass.
        feature_noise: half-width of uniform noise on the true input features.
        checkpoint_every: steps between checkpoints.
        tv_loss_weight: weight of TV(p~, q_k) = 1 - alpha per pass, added to the KL (0: KL alone).
        bf16_autocast: run the forward and backward passes under bfloat16 autocast (weights, optimiser state,
            KL and regression stay float32); faster on CPUs with bfloat16 matrix units.
    """

    seed: int = 0
    steps: int = 400
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    rollout: int = 3
    feature_loss_weight: float = 0.1
    feature_noise: float = 0.0
    checkpoint_every: int = 20
    tv_loss_weight: float = 0.0
    bf16_autocast: bool = False

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "rollout", "checkpoint_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.seq_len, int) or self.seq_len < 2:
            raise ValueError(f"seq_len must be an int >= 2, got {self.seq_len!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr!r}")
        for name in ("weight_decay", "feature_loss_weight", "feature_noise", "warmup_steps", "tv_loss_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class FeatureTrainResult:
    """step: optimiser steps done; finished: ``step == config.steps``; losses / kls per step; seconds (summed over resumes)."""

    step: int
    finished: bool
    losses: tuple[float, ...]
    kls: tuple[float, ...]
    seconds: float


def _feature_columns(head, store_layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Columns of the stored features the head reads, and those of the final feature (regression target)."""
    stored = _resolve_layers(store_layers, head.num_hidden_states)
    final = head.num_hidden_states - 1
    missing = [i for i in (*head.feature_layers, final) if i not in stored]
    if missing:
        raise ValueError(f"store_layers {tuple(store_layers)} lack hidden_states {missing} that the head needs (and the final one)")
    H = head.hidden_size
    columns = torch.cat([torch.arange(stored.index(i) * H, (stored.index(i) + 1) * H) for i in head.feature_layers])
    return columns, torch.arange(stored.index(final) * H, (stored.index(final) + 1) * H)


def _feature_batch(chunk: FeatureChunk, indices: Sequence[int], seq_len: int, columns, final_columns):
    """Right-padded ``tokens [B, L]``, ``mask [B, L]``, ``features [B, L, F]``, ``final [B, L, H]``, and per row
    ``(prompt length, teacher ids [n, k], teacher probs [n, k])`` cut to ``seq_len``."""
    rows = [chunk.sequences[i][:seq_len] for i in indices]
    L = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    features = torch.zeros(len(rows), L, len(columns))
    final = torch.zeros(len(rows), L, len(final_columns))
    teachers = []
    for b, (row, i) in enumerate(zip(rows, indices)):
        n, plen = len(row), chunk.prompt_lengths[i]
        tokens[b, :n], mask[b, :n] = row, 1
        stored = chunk.features[i][:n].float()
        features[b, :n], final[b, :n] = stored[:, columns], stored[:, final_columns]
        teachers.append((plen, chunk.teacher_ids[i][: n - plen].long(), chunk.teacher_probs[i][: n - plen].float()))
    return tokens, mask, features, final, teachers


def _positions(teachers, depth: int, L: int):
    """Loss slots of draft depth ``depth`` (0-based): j in [P - 1 + depth, n - 2] per row, as (rows, cols,
    teacher rows ids, probs); the draft path starts at a true slot at or after the last prompt token."""
    rows, cols, ids, probs = [], [], [], []
    for b, (plen, tid, tprob) in enumerate(teachers):
        j = torch.arange(plen - 1 + depth, plen - 1 + len(tid))
        rows.append(torch.full_like(j, b))
        cols.append(j)
        ids.append(tid[depth:])
        probs.append(tprob[depth:])
    return torch.cat(rows), torch.cat(cols), torch.cat(ids), torch.cat(probs)


def feature_loss(head, batch, config: FeatureTrainConfig, generator: torch.Generator | None = None) -> tuple[torch.Tensor, list[float]]:
    """The training loss of one batch (module docstring): mean over passes of KL + weight * SmoothL1
    (+ ``tv_loss_weight`` * TV).

    Returns the differentiable loss and the KL of each pass (floats, for the logs).
    """
    tokens, mask, features, final, teachers = batch
    hidden = head.rollout(features, tokens, mask, config.rollout, config.feature_noise, generator)
    total, kls = 0.0, []
    for depth, h in enumerate(hidden):
        rows, cols, ids, probs = _positions(teachers, depth, tokens.shape[1])
        if len(rows) == 0:
            continue
        predicted = h[rows, cols]  # [N, H]
        logits, index_of = head.support_logits(predicted)
        index = ids if index_of is None else index_of[ids]
        kl = sparse_kl(logits, index, probs)
        regression = F.smooth_l1_loss(predicted.float(), final[rows, cols]) if config.feature_loss_weight else 0.0
        tv = sparse_tv(logits, index, probs) if config.tv_loss_weight else 0.0
        total = total + kl + config.feature_loss_weight * regression + config.tv_loss_weight * tv
        kls.append(float(kl.detach()))
    return total / len(hidden), kls






def train_feature_head(head, chunk: FeatureChunk, store_layers: Sequence[int], config: FeatureTrainConfig, *,
                       checkpoint_dir: str | os.PathLike | None = None, max_seconds: float | None = None,
                       progress: bool = True) -> FeatureTrainResult:
    """Train ``head`` in place on the cached corpus ``chunk`` (features stored at ``store_layers``); resumable.

    With ``checkpoint_dir`` training resumes from ``checkpoint.pt`` there and saves every
    ``config.checkpoint_every`` steps and when it stops (``max_seconds`` of wall time in this call).
    """
    if any(len(s[: config.seq_len]) <= p for s, p in zip(chunk.sequences, chunk.prompt_lengths)):
        raise ValueError(f"seq_len {config.seq_len} cuts some sequence before its first generated token; raise it")
    columns, final_columns = _feature_columns(head, store_layers)
    parameters = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=config.lr, weight_decay=config.weight_decay)
    trained = {name: p for name, p in head.named_parameters() if p.requires_grad}
    state = load_checkpoint(checkpoint_dir, trained, optimizer, config, defaults=_LATER_FIELDS)
    step, losses, kls, seconds = state["step"], state["losses"], [list(k) for k in state.get("kls", [])], state["seconds"]
    schedule = batch_schedule(len(chunk.sequences), config.steps, config.batch_size, config.seed)
    generator = torch.Generator().manual_seed(config.seed + 1)
    started = time.perf_counter()
    bar = tqdm(total=config.steps, initial=step, desc="feature head", disable=not progress)
    head.train()
    while step < config.steps and (max_seconds is None or time.perf_counter() - started < max_seconds):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, config.lr, config.warmup_steps, config.steps)
        generator.manual_seed(config.seed * 1_000_003 + step)  # noise depends on the step only: resumes reproduce it
        batch = _feature_batch(chunk, schedule[step].tolist(), config.seq_len, columns, final_columns)
        with torch.autocast(parameters[0].device.type, dtype=torch.bfloat16, enabled=config.bf16_autocast):
            loss, pass_kls = feature_loss(head, batch, config, generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, config.grad_clip)
        optimizer.step()
        losses.append(float(loss.detach()))
        kls.append(pass_kls)
        step += 1
        bar.update(1)
        bar.set_postfix(kl="/".join(f"{k:.2f}" for k in pass_kls))
        if checkpoint_dir is not None and step % config.checkpoint_every == 0:
            save_checkpoint(checkpoint_dir, trained, optimizer, config, step=step, losses=losses, kls=kls,
                            seconds=seconds + time.perf_counter() - started)
    bar.close()
    head.eval()
    seconds += time.perf_counter() - started
    if checkpoint_dir is not None:
        save_checkpoint(checkpoint_dir, trained, optimizer, config, step=step, losses=losses, kls=kls, seconds=seconds)
    return FeatureTrainResult(step, step == config.steps, tuple(losses), tuple(tuple(k) for k in kls), seconds)







_LATER_FIELDS = {"tv_loss_weight": 0.0, "bf16_autocast": False}  # added after runs were keyed: hashed only when not at this default, so keys stay


def _run_key(head_config, train_config: FeatureTrainConfig, corpus_key: str, chunks: int, first_chunk: int = 0,
             init_weights: str | None = None) -> str:
    """The run's checkpoint directory name. ``first_chunk`` and ``init_weights`` (the starting head's weights
    digest) are hashed only when set, and the head's architecture only when it is not the default, so the keys of runs
    from chunk 0 and a fresh head of the toolkit's architecture stay."""
    import hashlib

    train = {k: v for k, v in dataclasses.asdict(train_config).items() if not (k in _LATER_FIELDS and v == _LATER_FIELDS[k])}
    head = {k: v for k, v in dataclasses.asdict(head_config).items() if not (k == "architecture" and v == "specresearch")}
    parts = [head, train, corpus_key, chunks]
    if first_chunk or init_weights is not None:
        parts.append({"first_chunk": first_chunk, "init_weights": init_weights})
    blob = json.dumps(parts, sort_keys=True)
    return f"{head_config.name}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def _starting_head(target, head_config, init_from) -> tuple:
    """The saved head in ``init_from`` (a directory or a shipped draft's name) to continue training, its
    weights' sha256 and what the manifest records of it.

    Its configuration must be ``head_config`` (the preset's), up to ``init_layer`` (a loaded head is not copied
    from the target's layer); its subset head's token ids are kept.
    """
    from specresearch.drafts.feature import (
        feature_head_digest,
        feature_head_dir,
        load_feature_head,
    )
    from specresearch.drafts.store import read_manifest

    directory = feature_head_dir(init_from)
    head = load_feature_head(target, directory)
    if dataclasses.replace(head.config, init_layer=None) != dataclasses.replace(head_config, init_layer=None):
        raise ValueError(f"init_from {directory}: its head config {dataclasses.asdict(head.config)} is not the preset's "
                         f"{dataclasses.asdict(head_config)}")
    digest = feature_head_digest(directory)
    saved = read_manifest(directory)
    record = {"directory": str(init_from), "weights_sha256": digest, "command": saved.get("command"),
              "corpus": saved.get("corpus"), "training_steps": saved.get("training", {}).get("steps"),
              "init_from": saved.get("init_from")}  # the chain of heads it continued in turn, if any
    return head, digest, record


def run_feature_distillation(target_lm, tokenizer, head_config, train_config: FeatureTrainConfig, corpus_config: FeatureCorpusConfig, *,
                             prompts_path, heldout_path, chunks: int, first_chunk: int = 0, init_from: str | os.PathLike | None = None,
                             out_dir: str | os.PathLike | None = None, heldout_prompts: int = 14,
                             measure_tokens: int = 64, depths: int = 4, max_seconds: float | None = None, command: str = "",
                             progress: bool = True) -> dict:
    """Corpus chunks (cached, resumable) -> head -> training (checkpointed) -> measurement -> ``save_feature_head``.

    ``chunks``: how many corpus chunks (``corpus_config.chunk_prompts`` prompts each) to train on, from chunk
    ``first_chunk`` on. ``init_from``: a saved head (directory) to continue training instead of a new head,
    with a new optimiser and learning-rate schedule; the manifest records it (``init_from``). Rerun the
    same call to resume; the returned manifest has ``finished: False`` (nothing shipped) until training ends.
    """
    from specresearch.drafts.feature import (
        build_feature_head,
        round_head_to_storage,
        save_feature_head,
    )
    from specresearch.drafts.store import drafts_dir
    from specresearch.engine.prompts import encode_chat, load_prompts
    from specresearch.training.corpus import head_token_ids

    check_field(chunks >= 1, "chunks", f"must be >= 1, got {chunks}")
    check_field(first_chunk >= 0, "first_chunk", f"must be >= 0, got {first_chunk}")
    started = time.perf_counter()
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    target = target_lm.model
    key = corpus_config.key(prompts_path)
    directory = cache_dir() / "features" / key
    stored = stored_corpus_tokens(key)
    available = collect_feature_corpus(target, encode_chat(load_prompts(prompts_path), tokenizer), corpus_config, directory,
                                       eos_token_ids=eos, max_chunks=first_chunk + chunks, max_seconds=max_seconds, stored=stored,
                                       first=first_chunk, progress=progress)
    manifest = {"command": command, "seed": train_config.seed, "finished": False, "train_config": dataclasses.asdict(train_config),
                "corpus_config": dataclasses.asdict(corpus_config), "corpus": {"prompts_file": Path(prompts_path).name, "cache_key": key,
                                                                              "chunks": chunks, "first_chunk": first_chunk,
                                                                              "chunks_available": available,
                                                                              "stored_token_chunks": len(stored)}}
    if available < chunks:
        return manifest
    corpus = load_feature_chunks(directory, chunks, first=first_chunk)
    collection = [_load_chunk(directory, i)["seconds"] for i in range(first_chunk, first_chunk + chunks)]
    manifest["corpus"].update({"sequences": len(corpus.sequences), "generated_tokens": corpus.num_generated_tokens,
                               "collection_seconds": round(sum(collection), 1)})
    init_weights = None
    if init_from is not None:
        head, init_weights, manifest["init_from"] = _starting_head(target, head_config, init_from)
    else:
        head_ids = None
        if head_config.head_tokens is not None:
            # the stored int32 / float16 rows as they are: no widened copy of every row (~1.7 GB at 272 chunks)
            head_ids = head_token_ids(corpus.teacher_ids, corpus.teacher_probs, target.config.get_text_config().vocab_size,
                                      head_config.head_tokens, required=eos)
        head = build_feature_head(target, head_config, head_token_ids=head_ids, seed=train_config.seed)
    budget = None if max_seconds is None else max(0.0, max_seconds - (time.perf_counter() - started))
    run = _run_key(head_config, train_config, key, chunks, first_chunk, init_weights)
    result = train_feature_head(head, corpus, corpus_config.store_layers, train_config, checkpoint_dir=cache_dir() / "feature_runs" / run,
                                max_seconds=budget, progress=progress)
    manifest["finished"] = result.finished
    manifest["training"] = {"steps": result.step, "seconds": round(result.seconds, 1), "loss_curve": [round(x, 4) for x in result.losses],
                            "kl_by_depth_last10": [round(statistics.fmean(k[d] for k in result.kls[-10:]), 4) for d in range(len(result.kls[-1]))]
                            if result.kls else None}
    if not result.finished:
        return manifest
    round_head_to_storage(head)
    manifest.update(_feature_measurements(target_lm, head, tokenizer, heldout_path, heldout_prompts, measure_tokens, depths, eos, progress))
    save_feature_head(head, target, Path(out_dir) if out_dir is not None else drafts_dir() / head_config.name, manifest)
    return manifest


def _feature_measurements(target_lm, head, tokenizer, heldout_path, count, max_new_tokens, depths, eos, progress) -> dict:
    from specresearch.drafts.feature import FeatureDraft
    from specresearch.engine.prompts import encode_chat, evenly_spaced, load_prompts

    prompts = load_prompts(heldout_path)
    chosen = evenly_spaced(prompts, count)
    ids = encode_chat(chosen, tokenizer)
    full = measure_feature_draft(target_lm.model, head, ids, depths=depths, max_new_tokens=max_new_tokens, eos_token_ids=eos, progress=progress)
    check = measure_feature_draft(target_lm.model, head, ids[:3], depths=depths, max_new_tokens=16, eos_token_ids=eos, progress=False)
    draft = FeatureDraft(head, max_context=target_lm.max_context, device=target_lm.device)
    return {"measurement": {"heldout_file": Path(heldout_path).name, "prompt_ids": [p["id"] for p in chosen], "max_new_tokens": max_new_tokens,
                            "seed": 0, **full.as_dict()},
            "check_measurement": {"prompt_ids": [p["id"] for p in chosen[:3]], "max_new_tokens": 16, "seed": 0, **check.as_dict()},
            "cost": measure_feature_cost(target_lm, draft)}
