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
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from specresearch.checks import check_int
from specresearch.training.distill import TrainConfig, cache_dir, generate_corpus, sparse_kl, sparse_tv
from specresearch.drafts.distilled import check_field

__all__ = [
    "FeatureCorpusConfig",
    "FeatureChunk",
    "chunk_prompt_order",
    "collect_feature_corpus",
    "corpora_dir",
    "save_corpus_tokens",
    "load_corpus_tokens",
    "corpus_token_file",
    "stored_corpus_tokens",
    "stored_chunk_count",
    "load_feature_chunks",
    "as_distill_corpus",
    "target_features",
    "FeatureTrainConfig",
    "FeatureTrainResult",
    "feature_loss",
    "train_feature_head",
    "FeatureMeasurement",
    "loop_expectations",
    "planned_loop_expectations",
    "measure_lookup_rules",
    "measure_feature_draft",
    "measure_feature_cost",
    "run_feature_distillation",
]


@dataclass(frozen=True)
class FeatureCorpusConfig:
    """How the cached corpus is sampled and what is stored of the target at each position.

    Attributes:
        seed: shuffles the prompts (one shuffle per pass over them) and seeds chunk i's sampling with ``seed + i``.
        store_layers: ``hidden_states`` indices stored (0 = embeddings, i = after decoder layer i, the
            last index = after the final norm, i.e. the feature the LM head reads). Negative indices
            count from the end. A head may read any subset of them.
        chunk_prompts: prompts per cached chunk; temperature / max_new_tokens / batch_size: sampling.
        teacher_top_k: teacher tokens kept per position.
    """

    seed: int = 0
    store_layers: tuple[int, ...] = (4, 15, 26, -1)
    chunk_prompts: int = 64
    temperature: float = 1.0
    max_new_tokens: int = 128
    batch_size: int = 32
    teacher_top_k: int = 64

    def key(self, prompts_name: str) -> str:
        """Cache directory name of this corpus for a prompt file."""
        layers = "_".join(str(i) for i in self.store_layers)
        return (f"{Path(prompts_name).stem}-s{self.seed}-L{layers}-c{self.chunk_prompts}-T{self.temperature}"
                f"-n{self.max_new_tokens}-b{self.batch_size}-k{self.teacher_top_k}")


@dataclass(frozen=True)
class FeatureChunk:
    """One cached chunk of the corpus.

    Attributes:
        sequences: ``[L_i]`` int64 token ids (prompt, then the target's continuation).
        prompt_lengths: ``P_i``.
        features: ``[L_i, len(store_layers) * H]`` bfloat16: the target's hidden states at every position.
        teacher_ids / teacher_probs: ``[L_i - P_i, k]`` top-k of p at positions ``P_i - 1 .. L_i - 2``
            (the positions whose next token the target generated), int32 / float16.
    """

    sequences: tuple[torch.Tensor, ...]
    prompt_lengths: tuple[int, ...]
    features: tuple[torch.Tensor, ...]
    teacher_ids: tuple[torch.Tensor, ...]
    teacher_probs: tuple[torch.Tensor, ...]

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(s) - p for s, p in zip(self.sequences, self.prompt_lengths))


def _resolve_layers(layers: Sequence[int], count: int) -> tuple[int, ...]:
    resolved = tuple(i % count if i < 0 else i for i in layers)
    if any(not 0 <= i < count for i in resolved):
        raise ValueError(f"layers must be hidden_states indices in [-{count}, {count}), got {tuple(layers)}")
    return resolved


@torch.no_grad()
def target_features(model, sequences: Sequence[torch.Tensor], layers: Sequence[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One batched (right-padded) target forward: hidden states at ``layers`` and logits, per sequence.

    Returns ``features`` (each ``[L_i, len(layers) * H]`` float32) and ``logits`` (each ``[L_i, V]`` float32).
    """
    length = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), length, dtype=torch.long)
    mask = torch.zeros(len(sequences), length, dtype=torch.long)
    for b, s in enumerate(sequences):
        ids[b, : len(s)], mask[b, : len(s)] = s, 1
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    chosen = _resolve_layers(layers, len(out.hidden_states))
    hidden = torch.cat([out.hidden_states[i] for i in chosen], dim=-1).float()  # [B, L, n*H]
    return [hidden[b, : len(s)] for b, s in enumerate(sequences)], [out.logits[b, : len(s)].float() for b, s in enumerate(sequences)]


def _chunk_path(directory: Path, index: int) -> Path:
    return directory / f"chunk-{index:04d}.pt"


def _load_chunk(directory: Path, index: int) -> dict:
    """Chunk ``index`` memory-mapped: its tensors are read from disk when touched, and the page cache may drop them."""
    return torch.load(_chunk_path(directory, index), weights_only=True, mmap=True)


def _collect_chunk(model, prompts: Sequence[torch.Tensor], config: FeatureCorpusConfig, index: int, eos) -> dict:
    sampling = TrainConfig(seed=config.seed + index, corpus_temperature=config.temperature, corpus_max_new_tokens=config.max_new_tokens,
                           corpus_samples_per_prompt=1, corpus_batch_size=config.batch_size)
    corpus = generate_corpus(model, prompts, sampling, eos, progress=False)
    return _chunk_payload(model, corpus.sequences, corpus.prompt_lengths, config)


def _chunk_payload(model, sequences: Sequence[torch.Tensor], prompt_lengths: Sequence[int], config: FeatureCorpusConfig) -> dict:
    """The stored chunk of sampled ``sequences``: one teacher-forced target forward per 8 of them."""
    out = {"sequences": [], "prompt_lengths": [], "features": [], "teacher_ids": [], "teacher_probs": []}
    for start in range(0, len(sequences), 8):
        batch = sequences[start : start + 8]
        features, logits = target_features(model, batch, config.store_layers)
        for seq, plen, feat, logit in zip(batch, prompt_lengths[start : start + 8], features, logits):
            top = logit[plen - 1 : len(seq) - 1].softmax(-1).topk(config.teacher_top_k, dim=-1)
            out["sequences"].append(seq.clone())
            out["prompt_lengths"].append(plen)
            out["features"].append(feat.to(torch.bfloat16).clone())
            out["teacher_ids"].append(top.indices.to(torch.int32).clone())
            out["teacher_probs"].append(top.values.to(torch.float16).clone())
    return out


def chunk_prompt_order(num_prompts: int, seed: int, count: int) -> list[int]:
    """The first ``count`` prompt indices the corpus' chunks are cut from: successive shuffles of
    ``range(num_prompts)`` by one generator seeded with ``seed``, end to end (so the first shuffle is the
    same however many passes follow, and a chunk may straddle two passes)."""
    check_int("num_prompts", num_prompts)
    check_int("count", count, minimum=0)
    generator = torch.Generator().manual_seed(seed)
    order: list[int] = []
    while len(order) < count:
        order += torch.randperm(num_prompts, generator=generator).tolist()
    return order[:count]


def collect_feature_corpus(model, prompt_ids: Sequence[torch.Tensor], config: FeatureCorpusConfig, directory: str | os.PathLike,
                           *, eos_token_ids: Sequence[int] = (), max_chunks: int | None = None, max_seconds: float | None = None,
                           stored: Sequence[dict] = (), first: int = 0, progress: bool = True) -> int:
    """Sample and cache the corpus chunk by chunk (resumable; see the module docstring). Returns the chunks on disk
    from ``first`` on.

    Args:
        model: the target, a transformers causal LM.
        prompt_ids: encoded prompts (``distill.encode_prompts``); shuffled with ``config.seed``.
        directory: the chunk cache; chunks already there are kept.
        max_chunks: the chunks wanted in total (default: enough to hold every prompt once). The chunks are
            cut from successive shuffles of the prompts, end to end (:func:`chunk_prompt_order`), so more
            chunks than one pass holds sample the same prompts again, with new seeds.
        max_seconds: stop starting new chunks after this.
        stored: the corpus' sampled token ids (:func:`load_corpus_tokens`): a missing chunk that ``stored``
            holds is rebuilt from them by the teacher-forced pass alone (features and teacher), not sampled
            again. Each stored chunk must start with the prompts this chunk is cut from (else ``ValueError``).
        first: the first chunk wanted; the chunks before it are neither collected nor counted (a run that trains
            on chunks ``first..max_chunks - 1`` only, e.g. one continuing a head on new data).
    """
    check_field(len(prompt_ids) > 0, "prompt_ids", "must hold at least one prompt")
    check_field(max_chunks is None or max_chunks >= 0, "max_chunks", f"must be >= 0, got {max_chunks}")
    check_field(first >= 0, "first", f"must be >= 0, got {first}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    total = -(-len(prompt_ids) // config.chunk_prompts) if max_chunks is None else max_chunks
    order = chunk_prompt_order(len(prompt_ids), config.seed, total * config.chunk_prompts)
    shuffled = [prompt_ids[i] for i in order]
    started = time.perf_counter()
    for index in tqdm(range(first, total), desc="feature corpus chunks", disable=not progress):
        path = _chunk_path(directory, index)
        if path.exists():
            continue
        if max_seconds is not None and time.perf_counter() - started > max_seconds:
            break
        chunk_started = time.perf_counter()
        prompts = shuffled[index * config.chunk_prompts : (index + 1) * config.chunk_prompts]
        if index < len(stored):
            chunk = stored[index]
            _check_stored_prompts(chunk, prompts, index)
            payload = _chunk_payload(model, chunk["sequences"], chunk["prompt_lengths"], config)
            payload.update(seconds=chunk["seconds"], rebuild_seconds=time.perf_counter() - chunk_started)
        else:
            payload = _collect_chunk(model, prompts, config, index, eos_token_ids)
            payload["seconds"] = time.perf_counter() - chunk_started
        tmp = path.with_suffix(".tmp")
        torch.save(payload, tmp)
        os.replace(tmp, path)
    return sum(1 for i in range(first, total) if _chunk_path(directory, i).exists())


def _check_stored_prompts(chunk: dict, prompts: Sequence[torch.Tensor], index: int) -> None:
    ok = len(chunk["sequences"]) == len(prompts) and all(
        plen == len(ids) and torch.equal(seq[:plen], ids) for seq, plen, ids in zip(chunk["sequences"], chunk["prompt_lengths"], prompts))
    if not ok:
        raise ValueError(f"stored corpus tokens, chunk {index}: its sequences do not start with the prompts this chunk is cut from "
                         "(another prompt file, seed or tokenizer?)")


def corpora_dir() -> Path:
    """``data/corpora`` of the source checkout: the committed token files of feature corpora (:func:`save_corpus_tokens`)."""
    from specresearch.drafts.distilled import drafts_dir

    return drafts_dir().parent / "corpora"


def save_corpus_tokens(directory: str | os.PathLike, path: str | os.PathLike, key: str, count: int | None = None,
                       stored: Sequence[dict] = ()) -> int:
    """Write the sampled token ids of the first ``count`` (default: all) consecutive chunks to ``path`` (a
    compressed ``.npz``: uint16 ids when the vocabulary allows), with the corpus ``key``
    (``FeatureCorpusConfig.key``) and each chunk's sampling seconds; returns the chunks written. Chunk ``i``
    is ``stored[i]`` (the ids already committed, :func:`load_corpus_tokens`) when there is one, else the
    chunk cached in ``directory``: the file grows by what was sampled since, and the chunks it already
    holds need not be in the cache.

    About 1 byte per token on disk, small enough to commit: the features and teacher (~4 KB per token) are
    recomputed from it by one teacher-forced pass per chunk (``collect_feature_corpus(stored=...)``), which
    takes seconds where sampling took minutes.
    """
    import numpy as np

    directory = Path(directory)
    chunks = []
    while count is None or len(chunks) < count:
        index = len(chunks)
        if index < len(stored):
            chunks.append(stored[index])
        elif _chunk_path(directory, index).exists():
            chunks.append(_load_chunk(directory, index))
        else:
            break
    if not chunks or (count is not None and len(chunks) < count):
        raise ValueError(f"{len(stored)} stored chunks and directory {directory} hold {len(chunks)} consecutive chunks, "
                         f"{count or 1} needed")
    sequences = [s for c in chunks for s in c["sequences"]]
    tokens = torch.cat(sequences)
    dtype = np.uint16 if int(tokens.max()) < 2**16 and int(tokens.min()) >= 0 else np.int64
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".tmp"), "wb") as handle:
        np.savez_compressed(handle, key=np.array(key), tokens=tokens.numpy().astype(dtype),
                            lengths=np.array([len(s) for s in sequences], dtype=np.int64),
                            prompt_lengths=np.array([p for c in chunks for p in c["prompt_lengths"]], dtype=np.int64),
                            chunk_sizes=np.array([len(c["sequences"]) for c in chunks], dtype=np.int64),
                            seconds=np.array([c["seconds"] for c in chunks], dtype=np.float64))
    os.replace(path.with_suffix(".tmp"), path)
    return len(chunks)


def load_corpus_tokens(path: str | os.PathLike, key: str) -> list[dict]:
    """The chunks :func:`save_corpus_tokens` wrote, each ``{"sequences", "prompt_lengths", "seconds"}``; a
    file written for another corpus ``key`` raises ``ValueError``."""
    import numpy as np

    with np.load(Path(path), allow_pickle=False) as data:
        _check_corpus_key(data, path, key)
        tokens = torch.from_numpy(data["tokens"].astype(np.int64))
        lengths, prompt_lengths = data["lengths"].tolist(), data["prompt_lengths"].tolist()
        sizes, seconds = data["chunk_sizes"].tolist(), data["seconds"].tolist()
    sequences = list(torch.split(tokens, lengths))
    chunks, start = [], 0
    for size, spent in zip(sizes, seconds):
        chunks.append({"sequences": sequences[start : start + size], "prompt_lengths": prompt_lengths[start : start + size], "seconds": spent})
        start += size
    return chunks


def _check_corpus_key(data, path: str | os.PathLike, key: str) -> None:
    """Raise ``ValueError`` unless the opened token file ``data`` (at ``path``) was written for corpus ``key``."""
    if str(data["key"]) != key:
        raise ValueError(f"{path} holds the tokens of corpus {str(data['key'])!r}, not {key!r}")


def corpus_token_file(key: str) -> Path:
    """``data/corpora/<key>.npz``: where the sampled token ids of corpus ``key`` are committed."""
    return corpora_dir() / f"{key}.npz"


def stored_corpus_tokens(key: str) -> list[dict]:
    """The committed token ids of corpus ``key`` (:func:`corpus_token_file`, :func:`load_corpus_tokens`), or ``[]``."""
    path = corpus_token_file(key)
    return load_corpus_tokens(path, key) if path.exists() else []


def stored_chunk_count(key: str) -> int:
    """How many chunks :func:`stored_corpus_tokens` would return, read from the file's chunk sizes alone
    (the token ids stay compressed); 0 without a committed file. A file of another corpus raises ``ValueError``."""
    import numpy as np

    path = corpus_token_file(key)
    if not path.exists():
        return 0
    with np.load(path, allow_pickle=False) as data:
        _check_corpus_key(data, path, key)
        return len(data["chunk_sizes"])


def load_feature_chunks(directory: str | os.PathLike, count: int | None = None, first: int = 0) -> FeatureChunk:
    """``count`` consecutive cached chunks from chunk ``first`` on (all consecutive ones if None), merged into one.

    The chunks are memory-mapped, not read: their tensors stay on disk and the page cache holds what is
    touched, so a corpus larger than RAM (544 chunks of the shipped preset take ~25 GB) still trains, one
    batch's rows read at a time.
    """
    directory = Path(directory)
    merged = {"sequences": [], "prompt_lengths": [], "features": [], "teacher_ids": [], "teacher_probs": []}
    index = first
    while _chunk_path(directory, index).exists() and (count is None or index < first + count):
        payload = _load_chunk(directory, index)
        for name in merged:
            merged[name] += list(payload[name])
        index += 1
    if not merged["sequences"] or (count is not None and index < first + count):
        raise ValueError(f"directory {directory} holds {index - first} consecutive chunks from chunk {first} on, {count or 1} needed: "
                         "collect the corpus first")
    return FeatureChunk(*(tuple(merged[name]) for name in ("sequences", "prompt_lengths", "features", "teacher_ids", "teacher_probs")))


def as_distill_corpus(chunk: FeatureChunk, seq_len: int):
    """The same tokens and teacher as a ``distill.Corpus`` and ``distill.TeacherTargets`` cut to ``seq_len``, so a
    separate small LM (``distill.train_draft``) trains on exactly the data a feature head trains on.

    The chunk's teacher rows are positions ``P_i - 1 .. L_i - 2``; ``distill._collate`` keeps positions
    ``P_i - 1 .. min(L_i, seq_len) - 2``, so the first ``min(L_i, seq_len) - P_i`` rows are kept.
    """
    from specresearch.training.distill import Corpus, TeacherTargets

    keep = [max(0, min(len(s), seq_len) - p) for s, p in zip(chunk.sequences, chunk.prompt_lengths)]
    teacher = TeacherTargets(tuple(t[:k].long() for t, k in zip(chunk.teacher_ids, keep)),
                             tuple(t[:k].float() for t, k in zip(chunk.teacher_probs, keep)), seq_len)
    return Corpus(chunk.sequences, chunk.prompt_lengths), teacher


# --------------------------------------------------------------------------------------------------
# Training


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


def _learning_rate(step: int, config: FeatureTrainConfig) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def _schedule(num_sequences: int, config: FeatureTrainConfig) -> torch.Tensor:
    generator = torch.Generator().manual_seed(config.seed)
    needed = config.steps * config.batch_size
    epochs = [torch.randperm(num_sequences, generator=generator) for _ in range(-(-needed // num_sequences))]
    return torch.cat(epochs)[:needed].view(config.steps, config.batch_size)


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
    step, losses, kls, seconds = _load_checkpoint(checkpoint_dir, head, optimizer, config)
    schedule = _schedule(len(chunk.sequences), config)
    generator = torch.Generator().manual_seed(config.seed + 1)
    started = time.perf_counter()
    bar = tqdm(total=config.steps, initial=step, desc="feature head", disable=not progress)
    head.train()
    while step < config.steps and (max_seconds is None or time.perf_counter() - started < max_seconds):
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(step, config)
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
            _save_checkpoint(checkpoint_dir, head, optimizer, config, step, losses, kls, seconds + time.perf_counter() - started)
    bar.close()
    head.eval()
    seconds += time.perf_counter() - started
    if checkpoint_dir is not None:
        _save_checkpoint(checkpoint_dir, head, optimizer, config, step, losses, kls, seconds)
    return FeatureTrainResult(step, step == config.steps, tuple(losses), tuple(tuple(k) for k in kls), seconds)


def _save_checkpoint(directory, head, optimizer, config, step, losses, kls, seconds) -> None:
    state = {name: p.detach().clone() for name, p in head.named_parameters() if p.requires_grad}
    payload = {"step": step, "weights": state, "optimizer": optimizer.state_dict(), "losses": list(losses), "kls": [list(k) for k in kls],
               "seconds": seconds, "config": dataclasses.asdict(config)}
    path = Path(directory) / "checkpoint.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(payload, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)


def _load_checkpoint(directory, head, optimizer, config):
    path = None if directory is None else Path(directory) / "checkpoint.pt"
    if path is None or not path.exists():
        return 0, [], [], 0.0
    payload = torch.load(path, weights_only=True)
    if {**_LATER_FIELDS, **payload["config"]} != dataclasses.asdict(config):
        raise ValueError(f"checkpoint_dir {directory} holds a run with another FeatureTrainConfig ({payload['config']}); use another directory")
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.requires_grad:
                p.copy_(payload["weights"][name])
    optimizer.load_state_dict(payload["optimizer"])
    return payload["step"], list(payload["losses"]), [list(k) for k in payload["kls"]], payload["seconds"]


# --------------------------------------------------------------------------------------------------
# Measurement


def loop_expectations(accept: Sequence[Sequence[float]], gamma: int) -> tuple[float, float, float]:
    """Expected (examined, accepted, steps) of a token-verification loop at ``gamma`` along one sequence.

    ``accept[d][i]``: probability that a draft at depth d + 1 placed at continuation position i is accepted,
    given that the emitted token there is the sequence's token: ``min(p, q)(x_i) / p(x_i)`` (1 or 0 at
    T = 0). Conditional on the emitted sequence, acceptances are independent with these probabilities
    (each step's output law is p whatever was drafted), so walking the sequence with the loop's state
    (the depth a position is drafted at, or 0 for a step's bonus position) gives the loop's expectations
    exactly: a step drafts position i at depth 1 after a rejection or a bonus position; an accepted
    draft at depth d < gamma continues at depth d + 1; one at depth gamma is followed by a bonus position.
    A rejection ends the step (later drafts are not examined), as ``GenerationResult.acceptance_rate`` counts.
    The loop's acceptance (accepted / examined) differs from the per-position alpha when acceptance is
    correlated along the sequence: after an accepted run the loop skips a position it would accept easily.
    """
    check_field(gamma >= 1 and len(accept) >= gamma, "gamma", f"must be in 1..{len(accept)} (depths given), got {gamma}")
    return planned_loop_expectations(accept, [gamma] * len(accept[0]))[:3]


def planned_loop_expectations(accept: Sequence[Sequence[float]], lengths: Sequence[int],
                              counted: Sequence[float] | None = None) -> tuple[float, float, float, float]:
    """:func:`loop_expectations` of a loop whose step length depends on the context where the step starts.

    ``lengths[i]``: the draft length of a step whose first draft is at position i (a function of the tokens
    before i, as ``drafts.PlansLength`` chooses it: the step is then an ordinary step of that length);
    each in ``1..len(accept)``. Returns the expected (examined, accepted, steps, drafted): drafted sums
    ``counted[i]`` over the steps, by the position i where each starts; by default ``counted = lengths``,
    every drafted token, examined or not (a step of length g drafts g tokens).
    """
    check_field(len(lengths) == len(accept[0]), "lengths", f"must give one length per position ({len(accept[0])}), got {len(lengths)}")
    check_field(all(1 <= g <= len(accept) for g in lengths), "lengths", f"must be in 1..{len(accept)} (depths given)")
    counted = lengths if counted is None else counted
    check_field(len(counted) == len(lengths), "counted", f"must give one value per position ({len(lengths)}), got {len(counted)}")
    drafting: dict[tuple[int, int], float] = {}  # (depth d, step length g) -> P(position i is drafted at depth d of such a step)
    start, bonus = 1, 0  # P(a step's first draft is at position i), P(position i is a step's bonus position)
    examined = accepted = steps = drafted = 0  # exact with Fraction inputs, floats with floats
    for i, g in enumerate(lengths):
        if start:
            drafting[1, g] = drafting.get((1, g), 0) + start
            steps += start
            drafted += start * counted[i]
        nxt, start, bonus = {}, bonus, 0
        for (d, length), mass in drafting.items():
            if mass:
                b = accept[d - 1][i]
                examined += mass
                accepted += mass * b
                if d < length:
                    nxt[d + 1, length] = nxt.get((d + 1, length), 0) + mass * b
                else:
                    bonus += mass * b
                start += mass * (1 - b)
        drafting = nxt
    return examined, accepted, steps, drafted


@dataclass(frozen=True)
class FeatureMeasurement:
    """Acceptance of a feature head per draft depth on target-generated continuations of held-out prompts.

    Attributes:
        alpha: temperature -> [depth 1..D] mean over positions of sum_x min(p_T, q_T), q at depth d
            computed on the head's own features for the d - 1 previous tokens (the tokens themselves are
            the target's sample, i.e. given that the previous drafts were accepted: EAGLE's n-alpha).
        greedy_agreement: [depth 1..D] fraction of positions of the greedy continuations with argmax q == argmax p.
        positions: temperature (0.0 = greedy) -> positions at depth 1.
        loop: temperature (0.0 = greedy) -> [gamma 1..D] expected (examined, accepted, steps) of the
            token-verification loop on the same sequences (:func:`loop_expectations`, summed over them).
    """

    alpha: dict[float, list[float]]
    greedy_agreement: list[float]
    positions: dict[float, int]
    loop: dict[float, list[tuple[float, float, float]]] = field(default_factory=dict)

    def loop_acceptance(self, temperature: float) -> list[float]:
        """[gamma 1..D] the loop's expected acceptance: accepted / examined drafts."""
        return [a / n if n else float("nan") for n, a, _ in self.loop[temperature]]

    def loop_tokens_per_step(self, temperature: float) -> list[float]:
        """[gamma 1..D] the loop's expected tokens per step: (accepted + steps) / steps."""
        return [(a + s) / s if s else float("nan") for _, a, s in self.loop[temperature]]

    def as_dict(self) -> dict:
        out = {"alpha_by_depth": {str(t): a for t, a in self.alpha.items()}, "greedy_agreement_by_depth": self.greedy_agreement,
               "positions": {str(t): n for t, n in self.positions.items()}}
        if self.loop:
            out["loop_acceptance_by_gamma"] = {str(t): self.loop_acceptance(t) for t in self.loop}
            out["loop_tokens_per_step_by_gamma"] = {str(t): self.loop_tokens_per_step(t) for t in self.loop}
        return out


@torch.no_grad()
def measure_feature_draft(target, head, prompt_ids: Sequence[torch.Tensor], *, temperatures: Sequence[float] = (0.2, 0.6, 1.0),
                          depths: int = 4, max_new_tokens: int = 64, seed: int = 0, eos_token_ids: Sequence[int] = (),
                          prompts_per_batch: int = 2, progress: bool = True) -> FeatureMeasurement:
    """alpha per depth at each temperature and greedy agreement per depth on held-out prompts.

    The continuations are sampled exactly as ``distill.measure_draft`` samples them (same generator, row
    order and batching), so depth 1 here and ``measure_draft`` of a distilled draft with the same
    arguments are measured on the same token sequences.
    """
    from specresearch.training.distill import sample_continuations
    from specresearch.core.sampling import SamplingConfig, logits_to_probs

    if any(t <= 0 for t in temperatures):
        raise ValueError(f"temperatures must all be > 0 (greedy agreement is always measured), got {temperatures}")
    rows = (0.0, *temperatures)
    generator = torch.Generator().manual_seed(seed)
    sums = {t: [0.0] * depths for t in rows}
    counts = {t: [0] * depths for t in rows}
    loop = {t: [[0.0, 0.0, 0.0] for _ in range(depths)] for t in rows}
    for start in tqdm(range(0, len(prompt_ids), prompts_per_batch), desc="measure", disable=not progress):
        prompts = [ids for ids in prompt_ids[start : start + prompts_per_batch] for _ in rows]
        continuations = sample_continuations(target, prompts, rows * (len(prompts) // len(rows)), max_new_tokens, generator, eos_token_ids)
        sequences = [torch.cat([ids, c]) for ids, c in zip(prompts, continuations)]
        features, logits = target_features(target, sequences, head.feature_layers)
        for b, (seq, prompt) in enumerate(zip(sequences, prompts)):
            t = rows[b % len(rows)]
            hidden = head.rollout(features[b][None], seq[None], torch.ones(1, len(seq), dtype=torch.long), depths)
            accept = torch.zeros(depths, len(seq) - len(prompt), dtype=torch.float64)  # [depth, continuation position]
            for depth, h in enumerate(hidden):
                slots = torch.arange(len(prompt) - 1 + depth, len(seq) - 1)
                if len(slots) == 0:
                    continue
                p_logits, q_logits = logits[b][slots], head.logits(h[0, slots])
                if t == 0:
                    values = (p_logits.argmax(-1) == q_logits.argmax(-1)).double()
                    accept[depth, depth:] = values
                else:
                    cfg = SamplingConfig(temperature=t)
                    p, q = logits_to_probs(p_logits, cfg), logits_to_probs(q_logits, cfg)
                    values = torch.minimum(p, q).sum(-1).double()
                    x = seq[slots + 1, None]
                    px, qx = p.gather(-1, x)[:, 0].double(), q.gather(-1, x)[:, 0].double()
                    accept[depth, depth:] = torch.where(px > 0, torch.minimum(px, qx) / px.clamp_min(1e-300), 1.0)
                sums[t][depth] += float(values.sum())
                counts[t][depth] += len(values)
            if accept.shape[1]:
                for gamma in range(1, depths + 1):
                    for k, v in enumerate(loop_expectations(accept.tolist(), gamma)):
                        loop[t][gamma - 1][k] += v
    ratio = {t: [s / n if n else float("nan") for s, n in zip(sums[t], counts[t])] for t in rows}
    return FeatureMeasurement({t: ratio[t] for t in temperatures}, ratio[0.0], {t: counts[t][0] for t in rows},
                              {t: [tuple(v) for v in loop[t]] for t in rows})


@torch.no_grad()
def measure_lookup_rules(target, head, prompt_ids: torch.Tensor, *, temperature: float = 1.0, mixes: Sequence[float] = (0.5,),
                         depths: int = 4, draft_gamma: int = 1, min_match: int = 2, max_ngram: int = 3, floor: float = 0.02,
                         max_new_tokens: int = 64, seed: int = 0, eos_token_ids: Sequence[int] = ()) -> dict[str, dict]:
    """How the combined draft (``drafts.LookupOrDraft``) could use the head where prompt lookup matches, untimed.

    One continuation of one prompt sampled from the target at ``temperature`` (> 0) with generator seed
    ``seed``; at each position i the target's p, the head's q at depths 1..``depths`` (its own features for
    the previous d - 1 tokens, as :func:`measure_feature_draft`) and prompt lookup's q (``drafts.ngram_probs``
    of the tokens before i; it depends on the tokens alone, so it is the same at every depth), all after the
    same temperature. Where the tokens before i end in a lookup match of ``min_match`` or more tokens, the rules draft

    * ``"head"``: the head's q (it drafts everywhere);
    * ``"combined"``: lookup's q (``LookupOrDraft``);
    * ``"mix:LAM"``: ``LAM * lookup + (1 - LAM) * head`` for each LAM in ``mixes`` (a law the draft can
      sample from and hand to the verifier; since min is concave, its acceptance at a position is at least
      the LAM-weighted mean of the two);
    * ``"oracle"``: whichever of the two accepts more there (it needs p: a bound on choosing, not a draft);

    and the head's q elsewhere. Per rule: ``alpha``, ``positions`` (per depth: summed sum_x min(p, q) and
    positions), the same on the matched positions (``alpha_matched``, ``matched``), and ``loop``: per
    gamma 1..``depths``, :func:`planned_loop_expectations` (examined, accepted, steps, drafted) of a loop
    that drafts gamma tokens in a step that starts after a match and ``min(gamma, draft_gamma)`` in any
    other (``LookupOrDraft``'s plan with ``plan_match = min_match``), then the head's drafted tokens: all
    of them, except for ``"combined"``: those of the steps that start without a match (a lower bound, as
    a step whose match ends part-way drafts the head's tokens too).
    """
    from specresearch.training.distill import sample_continuations
    from specresearch.drafts.distilled import ngram_match_length, ngram_probs
    from specresearch.core.sampling import SamplingConfig, logits_to_probs

    check_field(temperature > 0, "temperature", f"must be > 0 (the rules differ only in the law sampled from), got {temperature}")
    check_field(all(0 < m < 1 for m in mixes), "mixes", f"must be in (0, 1) (0 and 1 are the head and the combined rule), got {list(mixes)}")
    check_int("depths", depths)
    check_int("draft_gamma", draft_gamma)
    generator = torch.Generator().manual_seed(seed)
    continuation = sample_continuations(target, [prompt_ids], [temperature], max_new_tokens, generator, eos_token_ids)[0]
    seq, n, P = torch.cat([prompt_ids, continuation]), len(continuation), len(prompt_ids)
    features, logits = target_features(target, [seq], head.feature_layers)
    hidden = head.rollout(features[0][None], seq[None], torch.ones(1, len(seq), dtype=torch.long), depths)
    config = SamplingConfig(temperature=temperature)
    slots = torch.arange(P - 1, len(seq) - 1)  # slot j predicts x_{j+1}: continuation position i = j - P + 1
    p = logits_to_probs(logits[0][slots], config).double()  # [n, V]
    matched = torch.tensor([ngram_match_length(seq[: P + i], max_ngram) >= min_match for i in range(n)])
    lookup = torch.stack([ngram_probs(seq[: P + i], head.vocab_size, max_ngram, floor) for i in range(n)])
    lookup = logits_to_probs(lookup.log(), config).double()  # [n, V]: the law the engine samples lookup drafts from
    x = seq[P:, None]
    rules = ["head", "combined", *[f"mix:{m:g}" for m in mixes], "oracle"]
    values = {r: torch.zeros(depths, n, dtype=torch.float64) for r in rules}  # sum_x min(p, q) at (depth, position)
    accept = {r: torch.ones(depths, n, dtype=torch.float64) for r in rules}  # min(p, q)(x_i) / p(x_i)
    px = p.gather(-1, x)[:, 0]

    def score(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qx = q.gather(-1, x)[:, 0]
        return torch.minimum(p, q).sum(-1), torch.where(px > 0, torch.minimum(px, qx) / px.clamp_min(1e-300), 1.0)

    for depth, h in enumerate(hidden):
        q_head = logits_to_probs(head.logits(h[0, slots]).float(), config).double()  # [n, V] (rows i < depth unused)
        laws = {"head": q_head, "combined": torch.where(matched[:, None], lookup, q_head)}
        laws.update({f"mix:{m:g}": torch.where(matched[:, None], m * lookup + (1 - m) * q_head, q_head) for m in mixes})
        for rule, q in laws.items():
            values[rule][depth], accept[rule][depth] = score(q)
        better = values["combined"][depth] >= values["head"][depth]
        values["oracle"][depth] = torch.where(better, values["combined"][depth], values["head"][depth])
        accept["oracle"][depth] = torch.where(better, accept["combined"][depth], accept["head"][depth])
    out = {}
    for rule in rules:
        alpha = [float(values[rule][d, d:].sum()) for d in range(depths)]
        on_match = [float(values[rule][d, d:][matched[d:]].sum()) for d in range(depths)]
        loop = []
        for gamma in range(1, depths + 1):
            lengths = [gamma if bool(m) else min(gamma, draft_gamma) for m in matched]
            head_tokens = [0 if bool(m) else g for m, g in zip(matched, lengths)]  # a step after a match drafts lookup's tokens
            walk = accept[rule][:gamma].tolist()
            expected = list(planned_loop_expectations(walk, lengths)) if n else [0.0] * 4
            if rule == "combined" and n:
                expected.append(planned_loop_expectations(walk, lengths, head_tokens)[3])
            else:  # the head computes every drafted token (the oracle: at most every one)
                expected.append(expected[3])
            loop.append(expected)
        out[rule] = {"alpha": alpha, "positions": [max(n - d, 0) for d in range(depths)], "alpha_matched": on_match,
                     "matched": [int(matched[d:].sum()) for d in range(depths)], "loop": loop}
    return out


@torch.no_grad()
def measure_feature_cost(target_lm, draft, context_length: int = 64, repeats: int = 30, warmup: int = 5) -> dict:
    """c = the feature draft's one-token drafting step / the target's one-token forward, both with a cache of
    ``context_length`` tokens, B = 1, timed alternately (a benchmark figure, never asserted on)."""
    ids = ((torch.arange(context_length) % 1000 + 100) % draft.vocab_size)[None]  # any token ids; in range of a small vocabulary too
    mask = torch.ones_like(ids)
    _, features = target_lm.prefill(ids, mask, hidden_layers=draft.feature_layers)
    draft.observe(torch.cat([torch.zeros_like(features[:, :1]), features[:, :-2]], 1))
    draft.prefill(ids[:, :-1], mask[:, :-1])
    target_times, draft_times = [], []
    for _ in range(warmup + repeats):
        start = time.perf_counter()
        target_lm.score(ids[:, -1:])
        target_times.append(time.perf_counter() - start)
        target_lm.rollback(1)
        draft.observe(features[:, -2:-1])
        draft.score(ids[:, -1:])  # the pending token, on a true feature (untimed)
        start = time.perf_counter()
        draft.score(ids[:, -1:])  # a drafting step: on its own feature of the previous slot
        draft_times.append(time.perf_counter() - start)
        draft.rollback(2)
    target_s, draft_s = statistics.median(target_times[warmup:]), statistics.median(draft_times[warmup:])
    return {"c": draft_s / target_s, "draft_ms": 1e3 * draft_s, "target_ms": 1e3 * target_s, "context_length": context_length,
            "torch_threads": torch.get_num_threads()}


# --------------------------------------------------------------------------------------------------
# End to end


_LATER_FIELDS = {"tv_loss_weight": 0.0, "bf16_autocast": False}  # added after runs were keyed: hashed only when not at this default, so keys stay


def _run_key(head_config, train_config: FeatureTrainConfig, corpus_key: str, chunks: int, first_chunk: int = 0,
             init_weights: str | None = None) -> str:
    """The run's checkpoint directory name. ``first_chunk`` and ``init_weights`` (the starting head's weights
    digest) are hashed only when set, so the keys of runs from chunk 0 and a fresh head stay."""
    import hashlib

    train = {k: v for k, v in dataclasses.asdict(train_config).items() if not (k in _LATER_FIELDS and v == _LATER_FIELDS[k])}
    parts = [dataclasses.asdict(head_config), train, corpus_key, chunks]
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
    from specresearch.drafts.distilled import read_manifest
    from specresearch.drafts.feature import feature_head_digest, feature_head_dir, load_feature_head

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
    from specresearch.training.distill import encode_prompts, head_token_ids, load_prompts
    from specresearch.drafts.distilled import drafts_dir
    from specresearch.drafts.feature import FeatureDraft, FeatureHead, round_head_to_storage, save_feature_head

    check_field(chunks >= 1, "chunks", f"must be >= 1, got {chunks}")
    check_field(first_chunk >= 0, "first_chunk", f"must be >= 0, got {first_chunk}")
    started = time.perf_counter()
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    target = target_lm.model
    key = corpus_config.key(prompts_path)
    directory = cache_dir() / "features" / key
    stored = stored_corpus_tokens(key)
    available = collect_feature_corpus(target, encode_prompts(tokenizer, load_prompts(prompts_path)), corpus_config, directory,
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
        head = FeatureHead(target, head_config, head_token_ids=head_ids, seed=train_config.seed)
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
    from specresearch.training.distill import encode_prompts, evenly_spaced, load_prompts
    from specresearch.drafts.feature import FeatureDraft

    prompts = load_prompts(heldout_path)
    chosen = evenly_spaced(prompts, count)
    ids = encode_prompts(tokenizer, chosen)
    full = measure_feature_draft(target_lm.model, head, ids, depths=depths, max_new_tokens=max_new_tokens, eos_token_ids=eos, progress=progress)
    check = measure_feature_draft(target_lm.model, head, ids[:3], depths=depths, max_new_tokens=16, eos_token_ids=eos, progress=False)
    draft = FeatureDraft(head, max_context=target_lm.max_context, device=target_lm.device)
    return {"measurement": {"heldout_file": Path(heldout_path).name, "prompt_ids": [p["id"] for p in chosen], "max_new_tokens": max_new_tokens,
                            "seed": 0, **full.as_dict()},
            "check_measurement": {"prompt_ids": [p["id"] for p in chosen[:3]], "max_new_tokens": 16, "seed": 0, **check.as_dict()},
            "cost": measure_feature_cost(target_lm, draft)}
