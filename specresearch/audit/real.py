"""The engines' rules on real next-token laws: one step over the full vocabulary, in float64.

For a batch of N prefixes with target rows p ``[N, V]`` and draft rows q ``[N, V]``, :func:`single_step` gives the
law r ``[N, V]`` of the first token a rule emits (gamma = 1) and its acceptance ``[N]`` (the probability that
the emitted token is a draft candidate accepted as such). Each rule here is the float form of its exact twin in
:mod:`specresearch.audit.engines` at gamma = 1, with the same candidate choice (q's top K, ties by token id);
tests/test_audit_real.py checks every one against the twin on small models. :func:`next_token_rows` draws the
prefixes from the embedded target and reads the shipped feature head's depth-1 rows there.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specresearch.exact.theory_multi import optimal_acceptance_iid, rrs_without_replacement_acceptance_mc

__all__ = ["TREE_RULES", "StepPoint", "distances", "list_aligned", "llamacpp_chain", "next_token_rows", "one_hot_cost", "single_step", "summarise", "topk_tokens",
           "vllm_law"]

TREE_RULES = ("eagle2", "eagle1", "medusa-typical", "medusa-nucleus", "sglang", "llamacpp-example")


def topk_tokens(q: torch.Tensor, k: int) -> torch.Tensor:
    """[N, k] the k tokens of largest q, q descending, ties by token id (as ``exact.paths.topk_children``)."""
    order = torch.sort(q, dim=-1, descending=True, stable=True).indices  # stable: equal q keep id order
    return order[:, :k]


def _rows(n: int, device) -> torch.Tensor:
    return torch.arange(n, device=device)


def _normalised(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = weights.sum(-1, keepdim=True)
    return torch.where(total > 0, weights / total.clamp_min(1e-300), fallback)


def _onehot(p, q, k):
    candidates = topk_tokens(q, k)
    return p.clone(), p.gather(1, candidates).sum(-1)


def _sample_compare(p, q, k, synth_rates=None):
    x = topk_tokens(q, 1)
    if synth_rates is None:
        return p.clone(), p.gather(1, x).squeeze(1)
    s = float(synth_rates[0])  # llama.cpp's synthetic acceptance: x kept with s, else the target's sample
    return ((1 - s) * p).scatter_add_(1, x, torch.full_like(p[:, :1], s)), torch.full_like(p[:, 0], s)


def _token(p, q, k):
    return p.clone(), torch.minimum(p, q).sum(-1)


def _eagle1(p, q, k):
    rng = np.random.default_rng(0)
    accept = [rrs_without_replacement_acceptance_mc(pr.numpy(), qr.numpy(), k, num_samples=64, rng=rng)[0] for pr, qr in zip(p.cpu(), q.cpu())]
    return p.clone(), torch.tensor(accept, dtype=p.dtype)


def _medusa_typical(p, q, k, epsilon=0.09, delta=0.3, fast=True):
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1, keepdim=True)
    threshold = torch.minimum(torch.full_like(entropy, float(epsilon)), float(delta) * torch.exp(-entropy))
    candidates = topk_tokens(q, k)
    pc = p.gather(1, candidates)
    typical = pc > threshold  # [N, k]
    hit = typical.any(-1)
    if fast:  # among the typical candidates the likeliest (evaluate_posterior's tie-break), the first on equal p
        pick = torch.where(typical, pc, -1.0).argmax(-1, keepdim=True)
    else:  # the first typical candidate
        pick = typical.long().argmax(-1, keepdim=True)
    chosen = candidates.gather(1, pick).squeeze(1)
    fallback = torch.nn.functional.one_hot(p.argmax(-1), p.shape[-1]).to(p) if fast else p
    r = torch.where(hit[:, None], torch.nn.functional.one_hot(chosen, p.shape[-1]).to(p), fallback)
    return r, hit.to(p.dtype)


def _medusa_nucleus(p, q, k):
    candidates = topk_tokens(q, k)
    pc = p.gather(1, candidates)  # [N, k]: each candidate compared with its own draw of p
    before = torch.cumprod(torch.cat([torch.ones_like(pc[:, :1]), 1 - pc[:, :-1]], 1), 1)  # no earlier candidate hit
    accept = pc * before  # the first candidate whose draw matched
    none = 1 - accept.sum(-1, keepdim=True)
    return (none * p).scatter_add_(1, candidates, accept), accept.sum(-1)


def _sglang(p, q, k, threshold_single=1.0, threshold_acc=1.0):
    candidates = topk_tokens(q, k)
    pc = p.gather(1, candidates)  # [N, k]
    cum = pc.cumsum(-1)
    clip = (lambda v: (v / float(threshold_acc)).clamp(max=1.0)) if threshold_acc else (lambda v: (v > 0).to(v))
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], 1)
    forced = pc >= float(threshold_single)
    reached_forced = torch.cumsum(forced.long(), -1) - forced.long() == 0  # no forced sibling before this one
    accept = torch.where(forced, 1 - clip(before), clip(cum) - clip(before)) * reached_forced
    leftover = 1 - accept.sum(-1, keepdim=True)
    residual = _normalised(p.scatter(1, candidates, 0.0), p)
    r = (leftover * residual).scatter_add_(1, candidates, accept)
    return r, accept.sum(-1)


def _hf_assisted(p, q, k, assistant="sampled", ensemble_weight=None, drafted=None):
    if drafted is not None:  # drafts sampled from another law than the q they are verified with
        a = drafted * torch.where(q > 0, p / q.clamp_min(1e-300), torch.ones_like(p)).clamp(max=1.0)
        kept = a.sum(-1, keepdim=True)
        return a + (1 - kept) * _normalised((p - q).clamp(min=0), p), kept.squeeze(1)
    if ensemble_weight is not None:  # a sampled draft x accepted with min(1, 1 - w + w p/q), residual max(p - q, 0)
        w = float(ensemble_weight)
        accept = q * torch.clamp(1 - w + w * p / q.clamp_min(1e-300), max=1.0)
        kept = accept.sum(-1, keepdim=True)
        return accept + (1 - kept) * _normalised((p - q).clamp(min=0), p), kept.squeeze(1)
    if assistant == "sampled":
        return _token(p, q, k)
    x = topk_tokens(q, 1)
    a = torch.minimum(torch.ones_like(p[:, :1]), p.gather(1, x) / q.gather(1, x))
    r = (1 - a) * _normalised((p - q).clamp(min=0), p)
    return r.scatter_add_(1, x, a), a.squeeze(1)


def llamacpp_chain(probs: torch.Tensor, *, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                   temperature: float = 1.0) -> torch.Tensor:
    """[N, V] float64: the law llama.cpp's default sampler chain draws from, given the model's law ``probs`` [N, V]:
    top-k, top-p, min-p, then temperature (the order of ``common/common.h`` l. 263-273; the samplers of
    ``src/llama-sampler.cpp``, llama-cpp-python 0.3.36's vendored copy). Top-k keeps the k likeliest (ties by token
    id); top-p, on the survivors renormalised, keeps each token the likelier ones before it leave below p (the first
    to reach p included, l. 1577-1585); min-p keeps p_i >= min_p x the likeliest (on logits, l. 1766-1769); the
    temperature divides the kept logits. ``top_k <= 0``, ``top_p >= 1``, ``min_p <= 0`` switch a sampler off."""
    p = probs.double()
    if p.dim() != 2 or not temperature > 0:
        raise ValueError(f"probs must be [N, V] and temperature > 0, got {list(p.shape)} and {temperature!r}")
    ranked, order = torch.sort(p, dim=-1, descending=True, stable=True)
    keep = ranked > 0
    if top_k > 0:
        keep &= torch.arange(p.shape[-1], device=p.device) < top_k
    if top_p < 1:
        survivors = torch.where(keep, ranked, 0.0)
        survivors = survivors / survivors.sum(-1, keepdim=True)
        keep &= survivors.cumsum(-1) - survivors < top_p
    if min_p > 0:
        keep &= ranked >= min_p * ranked[:, :1]
    logits = torch.where(keep, ranked.clamp_min(1e-300).log() / temperature, float("-inf"))
    return torch.zeros_like(p).scatter_(1, order, logits.softmax(-1))


def vllm_law(logits: torch.Tensor, prompt: Sequence[int], output: Sequence[int], *, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0, frequency_penalty: float = 0.0,
             presence_penalty: float = 0.0, bad_words: Sequence[Sequence[int]] = (),
             allowed_token_ids: Sequence[int] | None = None, min_tokens: int = 0,
             stop_token_ids: Sequence[int] = ()) -> torch.Tensor:
    """[V] float64: the law vLLM samples the next token from after ``prompt`` and ``output`` (token ids), given the
    model's ``logits`` [V], as vLLM's sampling parameters define it (``SamplingParams``, as Model Runner V2's
    ``Sampler.apply_sampling_params`` applies them; its masks commute with the penalties): only ``allowed_token_ids``
    (where given) keep their logits; the stop tokens are banned while the output is shorter than ``min_tokens``; bad
    words, a token id list each, ban their last token where the output ends with the rest (the output alone, not the
    prompt); the repetition penalty divides the positive logits and multiplies the others of every token in the prompt
    or the output; the frequency penalty subtracts f x the token's count in the output, the presence penalty p where it
    occurs there; then the temperature; top-k keeps every token at least the k-th largest logit; top-p, on the
    survivors' softmax, drops each token whose ascending cumulative probability is <= 1 - p (the likeliest always kept).
    ``top_k <= 0`` and ``top_p >= 1`` switch one off. Written from those definitions, not from vLLM's kernels: the
    reference ``benchmarks/audit_vllm_params.py`` holds vLLM's speculative decoding to."""
    x = logits.double().clone()
    if x.dim() != 1 or not temperature > 0 or repetition_penalty <= 0:
        raise ValueError(f"logits must be [V], temperature and repetition_penalty > 0; got {list(x.shape)}, "
                         f"{temperature!r}, {repetition_penalty!r}")
    vocab, output = x.shape[0], [int(t) for t in output]
    if allowed_token_ids:
        kept = torch.full_like(x, float("-inf"))
        kept[list(allowed_token_ids)] = x[list(allowed_token_ids)]
        x = kept
    if len(output) < min_tokens:
        x[list(stop_token_ids)] = float("-inf")
    for word in bad_words:
        word = [int(t) for t in word]
        if len(word) - 1 <= len(output) and output[len(output) - len(word) + 1:] == word[:-1]:
            x[word[-1]] = float("-inf")
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab).double()[:vocab]
    seen = counts > 0
    seen[[int(t) for t in prompt]] = True
    x = torch.where(seen, torch.where(x > 0, x / repetition_penalty, x * repetition_penalty), x)
    x = (x - frequency_penalty * counts - presence_penalty * (counts > 0).double()) / temperature
    if 0 < top_k < vocab:
        x = torch.where(x >= x.topk(top_k).values[-1], x, float("-inf"))
    if top_p < 1:
        ascending, order = x.softmax(-1).sort()
        drop = ascending.cumsum(-1) <= 1 - top_p
        drop[-1] = False
        x[order[drop]] = float("-inf")
    return x.softmax(-1)


def list_aligned(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[N, V] q as llama.cpp's example subtracts it from p's candidate list (``audit.engines.list_aligned``, rows
    batched): p's i-th kept token by id loses the q of q's i-th kept token by id; q itself where both rows keep the
    same tokens (full rows always)."""
    vocab = p.shape[-1]
    ids = torch.arange(vocab, device=p.device).expand_as(q)
    by_id = torch.where(q > 0, ids, ids + vocab).argsort(-1)  # q's kept tokens first, in id order
    q_by_rank = q.gather(1, by_id)  # its values in that order; 0 past the end of its list
    rank = (p > 0).long().cumsum(-1) - 1  # each of p's kept tokens' place in p's list by id
    return torch.where(p > 0, q_by_rank.gather(1, rank.clamp(min=0)), torch.zeros_like(q))


def _llamacpp_example(p, q, k, p_split=0.1, lists="full"):
    """The candidates verified in a uniformly random order: the mean over every order of the k positions, skipping
    the candidates not kept, which is the uniform order over those kept. Each rejection leaves the residual of p's
    list less q: ``lists="full"`` (the default here: full next-token rows, untruncated sampling, every token on both
    lists) token by token; ``lists="support"`` (the rows are the lists a truncating sampler chain left, as the
    example's own rows are; the exact twin's default) less :func:`list_aligned` (p, q), as the example pairs them,
    and a candidate off p's list tested with the p read for the candidate tried before it (the example's p_tgt)."""
    if lists not in ("full", "support"):
        raise ValueError(f"lists must be 'full' or 'support', got {lists!r}")
    ranked = topk_tokens(q, p.shape[-1])[:, :k]
    keep = q.gather(1, ranked) > float(p_split)
    keep[:, 0] = True  # the top candidate always
    orders = list(itertools.permutations(range(ranked.shape[1])))
    total, accepted = torch.zeros_like(p), torch.zeros_like(p[:, 0])
    shifted = list_aligned(p, q) if lists == "support" else q
    for order in orders:
        current, mass, r = p.clone(), torch.ones_like(p[:, 0]), torch.zeros_like(p)
        read = torch.zeros_like(mass)  # the example's p_tgt: kept from the path before when the token is off p's list
        for i in order:
            x, on = ranked[:, i : i + 1], keep[:, i]
            listed = p.gather(1, x).squeeze(1) > 0 if lists == "support" else torch.ones_like(on)
            value = torch.where(listed, current.gather(1, x).squeeze(1), read)
            read = torch.where(on, value, read)
            ratio = value / q.gather(1, x).squeeze(1)
            a = torch.where(on, torch.minimum(torch.ones_like(mass), ratio), 0.0)
            r.scatter_add_(1, x, (mass * a)[:, None])
            mass = mass * (1 - a)
            current = torch.where(on[:, None], _normalised((current - shifted).clamp(min=0), current), current)
        total += r + mass[:, None] * current
        accepted += 1 - mass
    return total / len(orders), accepted / len(orders)


def _trtllm(p, q, k, relaxed_topk=None, relaxed_delta=0.6):
    if relaxed_topk is None:
        return _sample_compare(p, q, k)
    x = topk_tokens(q, 1)
    in_top = (topk_tokens(p, relaxed_topk) == x).any(-1)
    close = p.gather(1, x).squeeze(1) >= p.max(-1).values - float(relaxed_delta)  # in probabilities (engines.py)
    accepted = in_top & close
    golden = torch.nn.functional.one_hot(p.argmax(-1), p.shape[-1]).to(p)  # rejected: the target's top-1
    r = torch.where(accepted[:, None], torch.nn.functional.one_hot(x.squeeze(1), p.shape[-1]).to(p), golden)
    return r, accepted.to(p.dtype)


_FORMS = {
    "eagle2": _onehot, "eagle1": _eagle1, "medusa-typical": _medusa_typical, "medusa-nucleus": _medusa_nucleus,
    "sglang": _sglang, "vllm-greedy": _onehot, "vllm-probabilistic": _token, "vllm-block": _token,
    "hf-assisted": _hf_assisted, "hf-lookup": _sample_compare, "llamacpp-server": _sample_compare,
    "llamacpp-example": _llamacpp_example, "trtllm-relaxed": _trtllm,
}


def single_step(name: str, target_probs: torch.Tensor, draft_probs: torch.Tensor, num_drafts: int = 4, **params):
    """(r ``[N, V]``, acceptance ``[N]``) of engine rule ``name`` at gamma = 1 on rows p, q ``[N, V]`` (float64).

    ``num_drafts`` is the number of candidates of the tree rules (``TREE_RULES``); chain rules draft one token.
    ``params`` are the rule's settings (as :func:`specresearch.audit.engine_rule`'s).
    """
    if name not in _FORMS:
        raise ValueError(f"unknown engine rule {name!r}; one of {sorted(_FORMS)}")
    p, q = target_probs.double(), draft_probs.double()
    if p.shape != q.shape or p.dim() != 2:
        raise ValueError(f"target_probs and draft_probs must both be [N, V], got {list(p.shape)} and {list(q.shape)}")
    k = num_drafts if name in TREE_RULES else 1
    return _FORMS[name](p, q, k, **params)


def distances(r: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TV(r, p) and KL(r || p) per row ``[N]`` (KL is infinite where r puts mass on a token p excludes)."""
    tv = 0.5 * (r - p).abs().sum(-1)
    terms = torch.where(r > 0, r * (r.clamp_min(1e-300).log() - p.clamp_min(1e-300).log()), torch.zeros_like(r))
    kl = torch.where(((r > 0) & (p == 0)).any(-1), torch.full_like(tv, float("inf")), terms.sum(-1).clamp_min(0.0))  # >= 0; rounding aside
    return tv, kl


@dataclass(frozen=True)
class StepPoint:
    """Means over the prefixes of one rule's single step: distortion and acceptance."""

    rule: str
    settings: str
    tv: float
    kl: float
    acceptance: float
    lossless: float  # mean over prefixes of the best lossless acceptance with the same candidate choice (A(0))
    frontier: float  # mean over prefixes of the frontier at the rule's own TV (same candidate choice)

    @property
    def bought(self) -> float:
        """Acceptance gained over the lossless optimum per unit of TV (the frontier's slope is 1 until it saturates);
        NaN for an exact rule."""
        return (self.acceptance - self.lossless) / self.tv if self.tv > 1e-12 else float("nan")


def summarise(name: str, p: torch.Tensor, q: torch.Tensor, num_drafts: int = 4, **params) -> StepPoint:
    """The rule's mean TV, KL and acceptance over the rows, and the frontier acceptance at its TV: for the rules
    that sample their drafts, min(1, A(0) + eps) with A(0) the i.i.d. optimum; for a deterministic candidate set
    C, min(1, p(C) + eps)."""
    r, accept = single_step(name, p, q, num_drafts, **params)
    tv, kl = distances(r, p.double())
    k = num_drafts if name in TREE_RULES else 1
    sampled = name in ("eagle1", "vllm-probabilistic", "vllm-block") or (name == "hf-assisted" and params.get("assistant", "sampled") == "sampled")
    if sampled:
        best = torch.tensor([optimal_acceptance_iid(pr.numpy(), qr.numpy(), k) for pr, qr in zip(p.double(), q.double())])
    else:
        candidates = topk_tokens(q.double(), k)
        inside = p.double().gather(1, candidates)
        if name == "llamacpp-example":  # its tree: the top token, and the others with q > p_split
            keep = q.double().gather(1, candidates) > float(params.get("p_split", 0.1))
            keep[:, 0] = True
            inside = inside * keep
        best = inside.sum(-1)
    frontier = torch.minimum(torch.ones_like(best), best + tv)
    settings = ", ".join(f"{key} = {value}" for key, value in params.items()) or "defaults"
    return StepPoint(name, settings, float(tv.mean()), float(kl.mean()), float(accept.mean()), float(best.mean()), float(frontier.mean()))


def one_hot_cost(p: torch.Tensor, q: torch.Tensor, num_drafts: int = 4) -> dict[str, float]:
    """Mean acceptance over the rows of treating q as one-hot against the ratio test with the true q.

    ``onehot, top-1``: p(argmax q) (a greedy draft, vLLM / llama.cpp); ``token, sampled``: alpha = sum min(p, q);
    ``onehot, top-K``: p(K tokens of largest q) (EAGLE-2, SGLang); ``optimum, K sampled``: the best any lossless
    rule reaches with K i.i.d. drafts (SpecTr's min-cut form).
    """
    p, q = p.double(), q.double()
    return {
        "onehot, top-1": float(p.gather(1, topk_tokens(q, 1)).mean()),
        "token, sampled": float(torch.minimum(p, q).sum(-1).mean()),
        f"onehot, top-{num_drafts}": float(p.gather(1, topk_tokens(q, num_drafts)).sum(-1).mean()),
        f"optimum, {num_drafts} sampled": sum(optimal_acceptance_iid(pr.numpy(), qr.numpy(), num_drafts) for pr, qr in zip(p, q)) / len(p),
    }


@torch.no_grad()
def next_token_rows(target_lm, draft, prompt_ids: Sequence[torch.Tensor], *, num_prefixes: int = 200, temperature: float = 1.0,
                    max_new_tokens: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft next-token rows at ``num_prefixes`` real prefixes: p, q ``[N, V]`` float64 at ``temperature``.

    A continuation of every prompt is sampled from the target (``temperature``, ``seed``); the prefixes are the
    prompt plus the first i continuation tokens, spread evenly over all continuations. The draft is a feature
    head (``draft.head``: its depth-1 rows from the target's features) or any LanguageModel-like draft whose
    ``model`` is a transformers causal LM.
    """
    from specresearch.config import SamplingConfig
    from specresearch.core.sampling import logits_to_probs
    from specresearch.training.corpus import sample_continuations
    from specresearch.training.feature_corpus import target_features

    generator = torch.Generator().manual_seed(seed)
    continuations = sample_continuations(target_lm.model, list(prompt_ids), [temperature] * len(prompt_ids), max_new_tokens, generator)
    sequences = [torch.cat([ids, c]) for ids, c in zip(prompt_ids, continuations)]
    slots = [(b, len(ids) - 1 + i) for b, (ids, c) in enumerate(zip(prompt_ids, continuations)) for i in range(len(c))]
    if len(slots) < num_prefixes:
        raise ValueError(f"only {len(slots)} prefixes from {len(prompt_ids)} prompts; give more prompts or max_new_tokens")
    picked = [slots[round(i * (len(slots) - 1) / max(num_prefixes - 1, 1))] for i in range(num_prefixes)]
    head = getattr(draft, "head", None)
    layers = head.feature_layers if head is not None else (-1,)
    features, logits = target_features(target_lm.model, sequences, layers)
    config = SamplingConfig(temperature=temperature)
    p_rows, q_rows = [], []
    for b, seq in enumerate(sequences):
        positions = torch.tensor([pos for bb, pos in picked if bb == b], dtype=torch.long)
        if len(positions) == 0:
            continue
        if head is not None:
            hidden = head.rollout(features[b][None], seq[None], torch.ones(1, len(seq), dtype=torch.long), 1)[0]
            q_logits = head.logits(hidden[0, positions])
        else:
            q_logits = draft.model(input_ids=seq[None]).logits[0, positions]
        p_rows.append(logits_to_probs(logits[b][positions].double(), config))  # float64: rows sum to 1 within 1e-15
        q_rows.append(logits_to_probs(q_logits.double(), config))
    return torch.cat(p_rows), torch.cat(q_rows)
