"""The teacher's distributions on a corpus and the KL / TV losses a draft is trained on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from specresearch.drafts.distilled import SubsetHead
from specresearch.training.corpus import Corpus

__all__ = ["TeacherTargets", "teacher_targets", "sparse_distill_kl", "sparse_kl", "sparse_tv", "distill_kl", "corpus_kl"]


def distill_kl(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(p || q) = sum_x p(x) (log p(x) - log q(x)), p = softmax(target_logits).

    Args: target_logits, draft_logits: ``[N, V]``. Returns: a scalar (float32), differentiable in draft_logits.
    """
    log_p = F.log_softmax(target_logits.float(), dim=-1)  # [N, V]
    log_q = F.log_softmax(draft_logits.float(), dim=-1)  # [N, V]
    return F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")


def _collate(corpus: Corpus, indices: Sequence[int], seq_len: int):
    """Right-padded batch: ``input_ids [B, L]``, ``attention_mask [B, L]``, ``loss_mask [B, L]``.

    ``loss_mask[b, i]`` is True where the token at ``i + 1`` is a target-generated token (i >= P - 1),
    i.e. the positions at which a draft would propose and the target verify.
    """
    rows = [corpus.sequences[i][:seq_len] for i in indices]
    length = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), length, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for b, (row, i) in enumerate(zip(rows, indices)):
        input_ids[b, : len(row)] = row
        attention_mask[b, : len(row)] = 1
        loss_mask[b, corpus.prompt_lengths[i] - 1 : len(row) - 1] = True
    return input_ids, attention_mask, loss_mask


def _masked_logits(model, input_ids, attention_mask, loss_mask) -> torch.Tensor:
    """Next-token logits ``[N, V]`` at the ``N = loss_mask.sum()`` selected positions (head applied there only)."""
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, L, H]
    return model.get_output_embeddings()(hidden[loss_mask])


def _batch_kl(target, draft, batch) -> torch.Tensor:
    with torch.no_grad():
        target_logits = _masked_logits(target, *batch)  # [N, V]
    return distill_kl(target_logits, _masked_logits(draft, *batch))


@dataclass(frozen=True)
class TeacherTargets:
    """The teacher's next-token distributions at a corpus' loss positions, truncated to their top k.

    Attributes:
        ids: per corpus sequence ``[n_i, k]`` int64 token ids, most likely first, at its ``n_i`` loss
            positions (:func:`_collate` order, sequences cut to ``seq_len``).
        probs: per sequence ``[n_i, k]`` float32 teacher probabilities of those ids (not renormalised:
            ``1 - probs.sum(-1)`` is the tail mass the truncation drops).
        seq_len: the cut the positions were computed with.
    """

    ids: tuple[torch.Tensor, ...]
    probs: tuple[torch.Tensor, ...]
    seq_len: int

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids [N, k]``, ``probs [N, k]`` of sequences ``indices`` in :func:`_collate`'s position order."""
        return torch.cat([self.ids[i] for i in indices]), torch.cat([self.probs[i] for i in indices])


@torch.no_grad()
def teacher_targets(target, corpus: Corpus, seq_len: int, top_k: int, batch_size: int = 8, progress: bool = True) -> TeacherTargets:
    """One teacher forward over the corpus: the top ``top_k`` of p(. | prefix) at every loss position."""
    ids, probs = [], []
    for start in tqdm(range(0, len(corpus.sequences), batch_size), desc="teacher", disable=not progress):
        batch = _collate(corpus, range(start, min(start + batch_size, len(corpus.sequences))), seq_len)
        p = _masked_logits(target, *batch).float().softmax(-1)  # [N, V]
        top = p.topk(min(top_k, p.shape[-1]), dim=-1)
        counts = batch[2].sum(-1).tolist()
        ids += [t.clone() for t in top.indices.split(counts)]
        probs += [t.clone() for t in top.values.split(counts)]
    return TeacherTargets(tuple(ids), tuple(probs), seq_len)


def sparse_distill_kl(draft, batch, teacher_ids: torch.Tensor, teacher_probs: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(p~ || q): p~ = the teacher's top-k probabilities restricted to the draft's
    support (all of V, or a :class:`SubsetHead`'s tokens) and renormalised; differentiable in the draft.

    Positions where no top-k token is in the support are skipped (no q can match them). With ``k >= V``
    and a full head this is :func:`distill_kl` exactly.
    """
    input_ids, attention_mask, loss_mask = batch
    hidden = draft.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[loss_mask]  # [N, H]
    head = draft.get_output_embeddings()
    if isinstance(head, SubsetHead):
        logits, index = head.subset_logits(hidden), head.index_of[teacher_ids]  # [N, K], [N, k] (-1 off the subset)
    else:
        logits, index = head(hidden), teacher_ids
    return sparse_kl(logits, index, teacher_probs)


def _teacher_on_support(index: torch.Tensor, teacher_probs: torch.Tensor):
    """The rows with teacher mass on the support (``keep [N]``), their teacher renormalised there (``p [N', k]``)
    and their support positions (``index [N', k]``, off-support entries pointing at 0 with p = 0)."""
    p = torch.where(index >= 0, teacher_probs.float(), 0.0)
    mass = p.sum(-1)
    keep = mass > 0
    return keep, p[keep] / mass[keep, None], index[keep].clamp(min=0)


def sparse_kl(logits: torch.Tensor, index: torch.Tensor, teacher_probs: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(p~ || q), q = softmax(``logits [N, K]``) over a support of K tokens,
    p~ = ``teacher_probs [N, k]`` at support positions ``index [N, k]`` (-1: off the support), renormalised.

    Positions with no teacher mass on the support are skipped. Differentiable in ``logits``.
    """
    keep, p, index = _teacher_on_support(index, teacher_probs)
    log_q = F.log_softmax(logits[keep].float(), dim=-1).gather(-1, index)  # [N', k]
    terms = torch.where(p > 0, p * (p.clamp(min=1e-30).log() - log_q), 0.0)
    return terms.sum(-1).mean()


def sparse_tv(logits: torch.Tensor, index: torch.Tensor, teacher_probs: torch.Tensor) -> torch.Tensor:
    """Mean over positions of TV(p~, q) = 1 - sum_x min(p~(x), q(x)), the rejection probability of one drafted
    token (1 - alpha), with p~ and q as in :func:`sparse_kl` (p~ is zero off the teacher's top k, so the sum
    runs over those k). Differentiable in ``logits`` (through q where q < p~)."""
    keep, p, index = _teacher_on_support(index, teacher_probs)
    q = F.softmax(logits[keep].float(), dim=-1).gather(-1, index)  # [N', k]
    return (1 - torch.minimum(p, q).sum(-1)).mean()


@torch.no_grad()
def corpus_kl(target, draft, corpus: Corpus, seq_len: int = 256, batch_size: int = 8) -> float:
    """Mean KL(p || q) over all loss positions of the corpus (position-weighted)."""
    total, count = 0.0, 0
    for start in range(0, len(corpus.sequences), batch_size):
        batch = _collate(corpus, range(start, min(start + batch_size, len(corpus.sequences))), seq_len)
        n = int(batch[2].sum())
        total += float(_batch_kl(target, draft, batch)) * n
        count += n
    return total / count
