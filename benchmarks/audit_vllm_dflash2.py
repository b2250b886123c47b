"""Audit by execution of vLLM's DFlash2 drafting: vLLM 0.34's candidate walk (``v1/worker/gpu/spec_decode/dflash2/
speculator.py``, ``CandidateSampler.sample``: its ``_selector_walk_kernel`` draws each drafted token from the
candidates' scores given the token drawn before, Gumbel-max at the request's temperature with its drafting noise,
and its ``_cache_draft_logits_kernel`` writes the realized scores, ``-inf`` elsewhere, to the draft-logits cache),
the candidates' scores from vLLM's own edge kernel (``model_executor/models/qwen3_dflash2.py``,
``dflash2_score_edges_impl``: unary logit plus the bilinear edge of the previous candidate, the anchor first) and its
``rejection_sample`` deciding every step, all on the CPU in Triton's interpreter; the measured law of the first two
tokens against the target's (``specresearch.audit.execute``, engine ``python``). The draft is DFlash2's law
(``drafts.dflash2``) with vLLM computing every part of it that its serving code computes.

How it runs: as ``benchmarks/audit_vllm.py`` (``vllm_kernels``, its harness :class:`VllmSampler` with one seed per
request for the whole generation), plus the packages the DFlash2 modules' import chain names and these kernels
never call (cbor2, llguidance, xgrammar, einops: :data:`NEVER_CALLED`) as empty modules. The drafter's network is
not vLLM's to run here: the unary logits of drafted position s are the perturbed draft's logits at the anchor plus a
fixed random vector of position s (a block drafter's positions differ from each other), their top
:data:`TOP_K` the candidates (vLLM takes the top K of its head's logits); the selector's hidden projection is a fixed
random map of the draft's last hidden state per position, its codebooks fixed random tables (seeded, rank
:data:`RANK`, std 0.5 or :data:`STRONG`: on the prompt the first drafted token's law moves by TV 0.06 with the
selector at 0.5, by 0.68 at 1.0, where a walk that misread the token before would show). The law the draft draws
from is a function of the row and the drafted tokens before, whatever those tables are; the claim tested is vLLM's:
its walk, its cache and its verification keep the target's law.

    PYTHONPATH=. .venv/bin/python benchmarks/audit_vllm_dflash2.py [--out benchmarks/records/audit_vllm_dflash2.json]
    PYTHONPATH=. .venv/bin/python benchmarks/audit_vllm_dflash2.py --controls
    PYTHONPATH=. .venv/bin/python benchmarks/audit_vllm_dflash2.py --parts [--out ...]

``--parts``: vLLM's DFlash2 arithmetic against the loader's (``drafts.dflash2``) on random tensors: its grouped
convolution (the Triton kernel of its CUDA path and its CPU path) and its candidate-score kernel (and CPU reference)
give :class:`~specresearch.drafts.dflash2.GroupedConv`'s and :class:`~specresearch.drafts.dflash2.CandidateSelector`'s
numbers (record ``audit_vllm_dflash2_parts.json``, seconds); the controls hand vLLM the other side's base kernel and
another anchor.

``--controls``: the cache handed the candidates' unary logits instead of the walk's scores (the selector's edges
left out of q, as a drafter caching its head's logits would; the first token's law then moves by TV 0.34 at
:data:`STRONG`): the measurement must reject the target's law. Resumable (``audit.execute.record_tiny_runs``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from audit_vllm import SALT, SEED, VLLM, VllmSampler, _pair, runs_main, vllm_kernels  # noqa: E402

from specresearch.audit.execute import TinyRun  # noqa: E402
from specresearch.paths import empty_modules  # noqa: E402

NEVER_CALLED = ("cbor2", "llguidance", "xgrammar", "einops")
TOP_K, RANK, MAX_STEPS = 8, 8, 4


def dflash2_parts():
    """vLLM's ``CandidateSampler`` and ``dflash2_score_edges_impl``, to run in Triton's interpreter; once a process."""
    vllm_kernels()
    empty_modules(NEVER_CALLED)
    from vllm.model_executor.models.qwen3_dflash2 import dflash2_score_edges_impl
    from vllm.v1.worker.gpu.spec_decode.dflash2.speculator import CandidateSampler

    return CandidateSampler, dflash2_score_edges_impl


class VllmDFlash2Sampler(VllmSampler):
    """:class:`VllmSampler` drafting with vLLM's DFlash2 walk (module docstring). ``handed``: ``"draft"`` (the cache
    as vLLM's walk writes it) or ``"unary"`` (the control: the candidates' unary logits)."""

    cache_fill = float("-inf")  # DFlash2Speculator.draft_logits_spec

    def __init__(self, target, draft, temperature: float, gamma: int, method: str = "standard", handed: str = "draft",
                 draft_salt: int = SALT, codebook_std: float = 0.5) -> None:
        super().__init__(target, draft, temperature, gamma, method, handed=handed, drafting="vllm",
                         draft_salt=draft_salt)
        self.parts = dflash2_parts()
        g = torch.Generator().manual_seed(SEED + 2)
        V, H = target.config.vocab_size, draft.config.hidden_size
        self.step_bias = torch.randn(MAX_STEPS, V, generator=g)
        self.projection = torch.randn(MAX_STEPS, H, RANK, generator=g) / H**0.5
        self.predecessor = codebook_std * torch.randn(V, RANK, generator=g)
        self.successor = codebook_std * torch.randn(V, RANK, generator=g)

    def _drafts(self, ids: torch.Tensor, seeds: torch.Tensor, cache) -> torch.Tensor:
        CandidateSampler, score_edges = self.parts
        (R, L), g = ids.shape, self.gamma
        out = self.draft(ids, output_hidden_states=True)
        unary = out.logits[:, -1, None].float() + self.step_bias[:g]  # [R, g, V]
        values, candidates = unary.topk(TOP_K, -1)
        hidden = torch.einsum("rh,shk->rsk", out.hidden_states[-1][:, -1].float(), self.projection[:g])
        scores = score_edges(self.predecessor, self.successor, candidates.contiguous(), values.contiguous(),
                             hidden.contiguous(), ids[:, -1].contiguous())  # [R, g, K, K]
        tokens = torch.zeros(R * g, dtype=torch.int64)
        positions = (L + torch.arange(g, dtype=torch.int64)).repeat(R)  # the predicted tokens' positions
        requests = torch.arange(R, dtype=torch.int32).repeat_interleave(g)
        walk = CandidateSampler(R, g, TOP_K, torch.device("cpu"))
        walk.sample(candidates, scores, R, positions, requests, torch.full((R,), self.temperature), seeds, tokens,
                    cache, use_fp64=False)
        if self.handed == "unary":
            cache.values.fill_(float("-inf")).scatter_(-1, candidates, values)
        return torch.cat([ids, tokens.view(R, g)], 1)


def _run(n: int, temperature: float = 1.0, gamma: int = 2, method: str = "standard", handed: str = "draft",
         draft_salt: int = SALT, codebook_std: float = 0.5) -> TinyRun:
    if gamma > MAX_STEPS:
        raise ValueError(f"gamma {gamma}: at most {MAX_STEPS} drafted positions")
    expected = ("the target's law rejected: the harness's control" if handed != "draft" else
                "not the target's law: the draft's noise is the verification's (control)" if draft_salt != SALT
                else "the target's law (vLLM's claim)")

    def build():
        target, draft = _pair()
        sample = VllmDFlash2Sampler(target, draft, temperature, gamma, method, handed, draft_salt, codebook_std)
        return target, draft, {"gamma": gamma, "vllm_method": method, "handed": handed, "top_k": TOP_K, "rank": RANK,
                               "expected": expected}, {"sample": sample}

    what = f"vLLM 0.34 DFlash2 candidate walk, edge kernel and rejection_sample, method {method!r}"
    suffix = "" if handed == "draft" else ", handed the unary logits (control)"
    what += suffix + (f", draft noise salt {draft_salt} (control)" if draft_salt != SALT else "")
    strength = "" if codebook_std == 0.5 else f", codebooks of std {codebook_std}"
    return TinyRun(f"tiny two-layer Llama (seed {SEED}) and its perturbed copy, DFlash2 scores over {TOP_K} candidates"
                   f"{strength}, gamma {gamma}{suffix}", build, "python", 2, n, temperature,
                   {"name": what, "version": VLLM})


# about 0.33 s a generation at gamma 2, 0.47 s at gamma 3 (one core): 70 minutes for the runs, 6 the control
STRONG = 1.0  # codebooks' std where the selector moves the draft's law (TV 0.68 on the first token; 0.06 at 0.5)
RUNS = [_run(4000), _run(3000, 0.7, gamma=3), _run(2000, codebook_std=STRONG),
        _run(1500, gamma=3, method="block", codebook_std=STRONG)]
CONTROLS = [_run(1000, handed="unary", codebook_std=STRONG)]


def parts(seed: int = 0) -> list[dict]:
    """vLLM's DFlash2 arithmetic against ``drafts.dflash2``'s on the same random tensors: its convolution (the Triton
    kernel its CUDA path launches, ``dflash2_grouped_conv_impl``, and its CPU path ``_grouped_conv``) against
    :class:`GroupedConv`, its edge kernel (``dflash2_score_edges_impl``) and its CPU reference against
    :class:`CandidateSelector`'s scores of the same candidates (the top K of logits that put them first), for every
    predecessor candidate of the step before (the anchor at step 0). Largest absolute differences."""
    dflash2_parts()
    from vllm.model_executor.models import qwen3_dflash2 as theirs

    from specresearch.drafts.dflash2 import CandidateSelector, GroupedConv

    g = torch.Generator().manual_seed(seed)
    rows = []
    for hidden, taps, group, block in ((64, 2, 16, 4), (48, 3, 8, 5), (32, 4, 4, 8)):
        conv = GroupedConv(hidden, taps, group)
        with torch.no_grad():
            conv.base_kernel.copy_(torch.randn(conv.base_kernel.shape, generator=g))
            conv.kernel_projection.weight.copy_(torch.randn(conv.kernel_projection.weight.shape, generator=g) / 8)
        x = torch.randn(6, block, hidden, generator=g)
        offsets = conv.kernel_projection(x).view(6, block, 2, taps, -1).detach()
        flat = x.reshape(-1, hidden)
        for side in (0, 1):
            ours = conv._convolve(x, offsets[:, :, side], side).detach().reshape(-1, hidden)
            delta, base = offsets[:, :, side].reshape(-1, taps, hidden // group), conv.base_kernel[side].detach()
            kernel = theirs.dflash2_grouped_conv_impl(flat, delta.contiguous(), base.contiguous(), block, group)
            cpu = theirs._grouped_conv(flat, delta, base, block, hidden // group, group, taps)
            other = theirs.dflash2_grouped_conv_impl(flat, delta.contiguous(), conv.base_kernel[1 - side].detach(),
                                                     block, group)  # the control: the other side's base kernel
            rows.append({"part": "grouped convolution", "hidden": hidden, "taps": taps, "group": group, "block": block,
                         "side": side, "triton_kernel": float((kernel - ours).abs().max()),
                         "cpu_path": float((cpu - ours).abs().max()),
                         "control_other_base_kernel": float((other - ours).abs().max())})
    vocab, rank, steps, top_k, requests = 64, 16, 3, 8, 5
    selector = CandidateSelector(vocab, rank, rank, top_k)
    with torch.no_grad():
        for parameter in (selector.predecessor_codebook, selector.successor_codebook):
            parameter.copy_(torch.randn(parameter.shape, generator=g))
        selector.hidden_projection.weight.copy_(torch.eye(rank))  # vLLM's kernel takes the projected hidden state
    candidates = torch.stack([torch.randperm(vocab, generator=g)[:top_k] for _ in range(requests * steps)])
    candidates = candidates.view(requests, steps, top_k)
    unary = torch.randn(requests, steps, top_k, generator=g)
    hidden = torch.randn(requests, steps, rank, generator=g)
    anchors = torch.randint(vocab, (requests,), generator=g)
    tables = selector.predecessor_codebook.detach(), selector.successor_codebook.detach()
    kernel = theirs.dflash2_score_edges_impl(*tables, candidates, unary, hidden, anchors)
    cpu = theirs._score_edges_reference(*tables, candidates, unary, hidden, anchors, top_k)
    logits = torch.full((requests, steps, vocab), -100.0).scatter(-1, candidates, unary + 50)  # the candidates first
    ours = torch.empty(requests, steps, top_k, top_k)
    for s in range(steps):
        for p in range(top_k):
            previous = anchors if s == 0 else candidates[:, s - 1, p]
            with torch.no_grad():
                scored = selector(logits[:, s], previous, hidden[:, s])
            ours[:, s, p] = scored.gather(-1, candidates[:, s]) - 50
    shifted = theirs.dflash2_score_edges_impl(*tables, candidates, unary, hidden, (anchors + 1) % vocab)  # control
    rows.append({"part": "candidate scores", "vocabulary": vocab, "rank": rank, "top_k": top_k, "steps": steps,
                 "requests": requests, "triton_kernel": float((kernel - ours).abs().max()),
                 "cpu_path": float((cpu - ours).abs().max()),
                 "control_other_anchor": float((shifted - ours)[:, 0].abs().max())})
    return rows


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--parts"]:  # vLLM's DFlash2 arithmetic against the loader's (parts)
        import json

        from specresearch.experiments.records import record_header

        out = argv[2] if argv[1:2] == ["--out"] else "benchmarks/records/audit_vllm_dflash2_parts.json"
        rows = parts()
        worst = max(max(r["triton_kernel"], r["cpu_path"]) for r in rows)
        record = {**record_header("benchmarks/audit_vllm_dflash2.py", argv, target=None, vllm=VLLM), "rows": rows,
                  "largest_difference": worst}
        Path(out).write_text(json.dumps(record, indent=1) + "\n")
        print(f"{len(rows)} comparisons, largest difference {worst:.2e}; record {out}")
        return 0 if worst < 1e-4 else 1
    return runs_main(__doc__, "audit_vllm_dflash2", RUNS, CONTROLS, argv)


if __name__ == "__main__":
    sys.exit(main())
