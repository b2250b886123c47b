"""The feature corpus: target continuations with the target's hidden states, sampled in resumable chunks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specresearch.checks import check_field, check_int
from specresearch.training.corpus import generate_corpus
from specresearch.training.loop import TrainConfig

__all__ = ["FeatureCorpusConfig", "FeatureChunk", "chunk_prompt_order", "collect_feature_corpus", "corpora_dir", "save_corpus_tokens", "load_corpus_tokens", "corpus_token_file", "stored_corpus_tokens", "stored_chunk_count", "load_feature_chunks", "as_distill_corpus", "target_features"]


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
    from specresearch.drafts.store import drafts_dir

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
    from specresearch.training.corpus import Corpus
    from specresearch.training.teacher import TeacherTargets

    keep = [max(0, min(len(s), seq_len) - p) for s, p in zip(chunk.sequences, chunk.prompt_lengths)]
    teacher = TeacherTargets(tuple(t[:k].long() for t, k in zip(chunk.teacher_ids, keep)),
                             tuple(t[:k].float() for t, k in zip(chunk.teacher_probs, keep)), seq_len)
    return Corpus(chunk.sequences, chunk.prompt_lengths), teacher
