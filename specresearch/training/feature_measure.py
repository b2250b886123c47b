"""Measuring a feature head: acceptance by depth, the loop's expectations, lookup rules, cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from specresearch.checks import check_field, check_int
from specresearch.engine.timing import TimedCall, interleaved_medians
from specresearch.training.feature_corpus import target_features

__all__ = ["FeatureMeasurement", "loop_expectations", "planned_loop_expectations", "measure_lookup_rules", "measure_feature_draft", "measure_feature_cost"]


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
    before i, as ``models.protocols.PlansLength`` chooses it: the step is then an ordinary step of that length);
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
    from specresearch.config import SamplingConfig
    from specresearch.core.sampling import logits_to_probs
    from specresearch.training.corpus import sample_continuations

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
    """How the combined draft (``drafts.combined.LookupOrDraft``) could use the head where prompt lookup matches, untimed.

    One continuation of one prompt sampled from the target at ``temperature`` (> 0) with generator seed
    ``seed``; at each position i the target's p, the head's q at depths 1..``depths`` (its own features for
    the previous d - 1 tokens, as :func:`measure_feature_draft`) and prompt lookup's q (``drafts.ngram.ngram_probs``
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
    from specresearch.config import SamplingConfig
    from specresearch.core.sampling import logits_to_probs
    from specresearch.drafts.ngram import ngram_match_length, ngram_probs
    from specresearch.training.corpus import sample_continuations

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
    def pending():  # the pending token, on a true feature (untimed)
        draft.observe(features[:, -2:-1])
        draft.score(ids[:, -1:])

    target_s, draft_s = interleaved_medians([
        TimedCall(lambda: target_lm.score(ids[:, -1:]), reset=lambda: target_lm.rollback(1)),
        TimedCall(lambda: draft.score(ids[:, -1:]), setup=pending, reset=lambda: draft.rollback(2)),  # a drafting step: on its own feature
    ], repeats=repeats, warmup=warmup)
    return {"c": draft_s / target_s, "draft_ms": 1e3 * draft_s, "target_ms": 1e3 * target_s, "context_length": context_length,
            "torch_threads": torch.get_num_threads()}
