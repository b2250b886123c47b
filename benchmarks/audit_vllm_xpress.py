"""Audit by execution of vLLM's XPress drafting: vLLM 0.34's ``XPressSpeculator`` (``v1/worker/gpu/spec_decode/
xpress/speculator.py``: its ``_generate_draft`` and ``_jacobi_refine``, run on a stand-in for the speculator's state)
drafts every block with its refiner head (``model_executor/models/qwen3_xpress.py``, ``XPressRefinerHead``: the mixer
folded by its ``fold_from_raw_``, its fused weights by ``process_weights_after_loading``, ``jacobi_refine_greedy``'s
passes in its Triton kernels over the top ``xpress_topc`` = 512 candidates, its default), and its ``rejection_sample``
decides every step, all on the CPU in Triton's interpreter; the measured law of the first two tokens against the
target's (``specresearch.audit.execute``, engine ``python``).

What vLLM hands its rejection sampler depends on ``draft_sample_method``. ``greedy`` (its default): no draft logits,
each drafted token one-hot, which keeps the target's law whatever the draft. ``probabilistic`` (which vLLM's
watermarking requires, and which XPress inherits DFlash's ``supports_watermarking`` for): the speculator's
``DraftLogitsCache``, allocated by its ``_init_draft_logits`` with the fill of its ``draft_logits_spec`` (0.0), and
never written: XPress's ``_generate_draft`` writes the drafted tokens only (DFlash's writes the cache as it samples).
vLLM's model runner hands that cache to its rejection sampler (``model_runner.py``, read, not run here), which reads
it as the draft's logits: q uniform where the draft is the refiner's argmax. Each run records the steps that wrote
the cache (``draft_logits_cache``). For those runs the audit predicts the law exactly (:meth:`VllmXPressSampler.
predicted_rows`, with vLLM's drafting run on each prefix) and the verdict is "not exact".

How it runs: as ``benchmarks/audit_vllm.py`` (``vllm_kernels``, :class:`VllmSampler` with one seed per request for the
whole generation), plus the packages the speculator's import chain names and these kernels never call
(:data:`NEVER_CALLED`) as empty modules. The drafter's network is not vLLM's to run here: block position s's base
logits are the perturbed draft's logits at the anchor plus a fixed random vector of position s, its hidden state a
fixed random map of the draft's last hidden state per position; the refiner's tables are fixed random (seeded, rank
:data:`RANK`, MLP width :data:`MLP`: vLLM's kernel tiles the MLP by 64 and the rank by a power of two). The block is
1 + gamma positions, as vLLM sizes it.

    PYTHONPATH=. .venv/bin/python benchmarks/audit_vllm_xpress.py [--out benchmarks/records/audit_vllm_xpress.json]
    PYTHONPATH=. .venv/bin/python benchmarks/audit_vllm_xpress.py --parts [--out ...]

``--parts``: vLLM's head against the loader's refiner (``drafts.xpress``) on random tensors, blocks of 4 and 8: its
Jacobi draft (``jacobi_refine_greedy``, full vocabulary and top-C) after B - 1 and after its default 6 passes against
the serial greedy draft of the refiner's law with the anchor for its predecessor (as vLLM feeds it), its last pass's
logits against the refiner's at that draft; and what differs: one pass (the comparison can fail), the true
predecessor (speculators' training) instead of the anchor (record ``audit_vllm_xpress_parts.json``).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from audit_vllm import SEED, VLLM, VllmSampler, _pair, runs_main, vllm_kernels  # noqa: E402

from specresearch.audit.execute import TinyRun  # noqa: E402
from specresearch.paths import empty_modules  # noqa: E402

NEVER_CALLED = ("cbor2", "llguidance", "xgrammar", "einops")
RANK, MLP, PASSES, TOPC = 16, 64, 6, 512  # vLLM's defaults: 6 passes, top 512 candidates
PROMPT = (5, 9, 3)
STEP_NOISE = 0.3  # the std of block position s's logit offset (the draft keeps near the target, as a trained one does)


def xpress_parts():
    """vLLM's ``XPressSpeculator``, ``DraftModelSpeculator`` and ``XPressRefinerHead``, to run in Triton's interpreter."""
    vllm_kernels()
    empty_modules(NEVER_CALLED)
    from vllm.model_executor.models.qwen3_xpress import XPressRefinerHead
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator
    from vllm.v1.worker.gpu.spec_decode.xpress.speculator import XPressSpeculator

    return XPressSpeculator, DraftModelSpeculator, XPressRefinerHead


def refiner_tables(vocab: int, hidden: int, block: int, generator: torch.Generator, scale: float = 1.0) -> dict:
    """Random refiner weights in speculators' layout (``refiner_head.*`` without the prefix), MLP width :data:`MLP`."""
    shapes = {"token_embed.weight": (vocab, RANK), "down_h.weight": (RANK, hidden), "down_g.weight": (RANK, hidden),
              "in_proj.weight": (RANK, 3 * RANK), "mix_l": (RANK, block, block), "mlp_gate.weight": (MLP, RANK),
              "mlp_up.weight": (MLP, RANK), "mlp_down.weight": (RANK, MLP), "readout.weight": (vocab, RANK)}
    return {k: scale * torch.randn(s, generator=generator) / s[-1] ** 0.5 for k, s in shapes.items()}


def vllm_head(tables: dict, hidden: int, block: int, requests: int, topc: int = TOPC):
    """vLLM's ``XPressRefinerHead`` holding ``tables`` (speculators' names placed by meaning: ``token_embed`` is its
    ``w1``, ``readout`` its ``w2``, the raw mixer folded by its own ``fold_from_raw_``), ready to serve."""
    head_class = xpress_parts()[2]
    vocab = tables["token_embed.weight"].shape[0]
    head = head_class(vocab_size=vocab, hidden_size=hidden, block_size=block, rank=RANK, mlp_hidden=MLP,
                      max_num_reqs=requests, topc=topc)
    names = {"w1.weight": "token_embed.weight", "w2.weight": "readout.weight", "mlp_gate.weight": "mlp_gate.weight",
             "mlp_up.weight": "mlp_up.weight", "mlp_down.weight": "mlp_down.weight", "down_h.weight": "down_h.weight",
             "down_g.weight": "down_g.weight", "in_proj.weight": "in_proj.weight"}
    with torch.no_grad():
        for theirs, ours in names.items():
            head.get_parameter(theirs).copy_(tables[ours])
    head.fold_from_raw_(tables["mix_l"])
    head.process_weights_after_loading()
    return head


def our_refiner(tables: dict, hidden: int, block: int):
    from specresearch.drafts.xpress import XPressRefiner

    vocab = tables["token_embed.weight"].shape[0]
    refiner = XPressRefiner(vocab, vocab, hidden, block, RANK, MLP // RANK)
    refiner.load_state_dict(tables)
    return refiner.eval()


def stand_in(requests: int, gamma: int, vocab: int, head, base: torch.Tensor, hidden: torch.Tensor,
             anchors: torch.Tensor, probabilistic: bool):
    """An object carrying the state ``XPressSpeculator``'s drafting methods read, with vLLM's own ``_generate_draft``,
    ``_jacobi_refine``, ``_init_draft_logits`` and ``draft_logits_spec`` as its methods; the draft-logits cache
    allocated by the last where ``probabilistic``."""
    speculator, draft_model_speculator, _ = xpress_parts()
    block = gamma + 1
    methods = {name: getattr(speculator, name) for name in ("_generate_draft", "_jacobi_refine", "draft_logits_spec")}
    methods["_init_draft_logits"] = draft_model_speculator._init_draft_logits
    state = type("XPressStandIn", (), methods)()
    config = types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(enable_batch_sharded_sampling=False, prefill_context_parallel_size=1),
        model_config=types.SimpleNamespace(head_dtype=torch.float32))
    input_ids = torch.zeros(requests * block, dtype=torch.int64)
    input_ids[::block] = anchors
    state.__dict__.update(
        vllm_config=config, max_num_reqs=requests, num_speculative_steps=gamma, vocab_size=vocab,
        device=torch.device("cpu"), draft_watermarker=None, draft_logits=None, num_query_per_req=block,
        num_jacobi_passes=PASSES, acceptance_estimator=None, _anchor_idx=torch.arange(requests) * block,
        input_buffers=types.SimpleNamespace(input_ids=input_ids),
        draft_tokens=torch.zeros(requests, gamma, dtype=torch.int64),
        model=types.SimpleNamespace(compute_draft_logits=lambda h: base, model=types.SimpleNamespace(xpress_head=head)),
        _run_model=lambda *args, **kwargs: hidden.reshape(requests * block, -1))
    if probabilistic:
        state._init_draft_logits(None)
    return state


class VllmXPressSampler(VllmSampler):
    """:class:`VllmSampler` drafting with vLLM's XPress speculator (module docstring); ``sample_method``: vLLM's
    ``draft_sample_method``, ``"greedy"`` or ``"probabilistic"``."""

    def __init__(self, target, draft, temperature: float, gamma: int, method: str = "standard",
                 sample_method: str = "greedy") -> None:
        super().__init__(target, draft, temperature, gamma, method, drafting="vllm")
        self.sample_method = sample_method
        self.cache_report = {"allocated": sample_method == "probabilistic", "steps": 0, "steps_that_wrote_it": 0}
        g = torch.Generator().manual_seed(SEED + 3)
        V, H = target.config.vocab_size, draft.config.hidden_size
        self.step_bias = STEP_NOISE * torch.randn(gamma + 1, V, generator=g)
        self.projection = torch.randn(gamma + 1, H, H, generator=g) / H**0.5
        self.tables = refiner_tables(V, H, gamma + 1, g)
        self.heads = {}

    def _verified_cache(self, cache):
        return self._state.draft_logits  # the speculator's own: None with greedy drafts

    def _drafts(self, ids: torch.Tensor, seeds: torch.Tensor, cache) -> torch.Tensor:
        R, g = len(ids), self.gamma
        if R not in self.heads:
            self.heads[R] = vllm_head(self.tables, self.draft.config.hidden_size, g + 1, R)
        out = self.draft(ids, output_hidden_states=True)
        base = (out.logits[:, -1, None].float() + self.step_bias).contiguous()  # [R, B, V]
        hidden = torch.einsum("rh,shk->rsk", out.hidden_states[-1][:, -1].float(), self.projection).contiguous()
        state = stand_in(R, g, base.shape[-1], self.heads[R], base, hidden, ids[:, -1],
                         self.sample_method == "probabilistic")
        allocated = None if state.draft_logits is None else state.draft_logits.values.clone()
        state._generate_draft(R, R * (g + 1), None, None, None)
        if allocated is not None and cache is not None:  # a step's drafting (None: the prediction's)
            self.cache_report["steps"] += 1
            self.cache_report["steps_that_wrote_it"] += not torch.equal(allocated, state.draft_logits.values)
        self._state = state
        return torch.cat([ids, state.draft_tokens], 1)

    @torch.no_grad()
    def predicted_rows(self, law) -> dict:
        """The law vLLM's rejection sampler gives with the cache at its fill (``probabilistic``): each drafted token
        x (the refiner's deterministic argmax, vLLM's drafting run here on the prefix) accepted with probability
        min(1, p(x) / q(x)), q = softmax(fill / T) = uniform, else a token from (p - q)+ normalised; x is accepted
        exactly when it is emitted, so after the first token the second is the step's second drafted token's verdict
        (first token the draft's) or the next step's first (another) -> next-token rows at every prefix of ``law``."""
        rows, V = dict(law.rows), len(next(iter(law.rows.values())))
        uniform = torch.full((V,), 1.0 / V, dtype=torch.float64)

        def verdict(p, token):
            accept = min(1.0, float(p[token] / uniform[token]))
            residual = (p - uniform).clamp(min=0)
            row = (1 - accept) * residual / residual.sum().clamp(min=1e-300)
            row[token] += accept
            return row

        def drafts(prefixes):
            ids = torch.tensor([list(PROMPT) + list(x) for x in prefixes])
            return self._drafts(ids, torch.zeros(len(ids), dtype=torch.int64), None)[:, ids.shape[1]:]

        first = drafts([()])[0].tolist()
        rows[()] = verdict(law.rows[()], first[0])
        later = [x for x in law.rows if len(x) == 1 and x[0] != first[0] and x[0] != self.target.config.eos_token_id]
        if (first[0],) in law.rows:
            rows[(first[0],)] = verdict(law.rows[(first[0],)], first[1])
        for x, drafted in zip(later, drafts(later).tolist() if later else []):
            rows[x] = verdict(law.rows[x], drafted[0])
        return rows


def _run(n: int, temperature: float = 1.0, gamma: int = 2, method: str = "standard",
         sample_method: str = "greedy") -> TinyRun:
    expected = ("the target's law (vLLM's claim)" if sample_method == "greedy" else
                "not the target's law: the cache XPress never writes is read as the draft's logits")

    def build():
        target, draft = _pair()
        sample = VllmXPressSampler(target, draft, temperature, gamma, method, sample_method)
        keywords = {"sample": sample} | ({"predicted_law": sample.predicted_rows} if sample_method != "greedy" else {})
        return target, draft, {"gamma": gamma, "vllm_method": method, "draft_sample_method": sample_method,
                               "passes": PASSES, "top_c": TOPC, "rank": RANK, "expected": expected,
                               "draft_logits_cache": sample.cache_report}, keywords

    what = (f"vLLM 0.34 XPressSpeculator drafting, refiner kernels and rejection_sample, method {method!r}, "
            f"draft_sample_method {sample_method!r}")
    return TinyRun(f"tiny two-layer Llama (seed {SEED}) and its perturbed copy, an XPress refiner of rank {RANK} on "
                   f"blocks of {gamma + 1}, gamma {gamma}", build, "python", 2, n, temperature,
                   {"name": what, "version": VLLM}, PROMPT)


# about 0.6 s a generation at gamma 2, 0.7 s at gamma 3 (one core, vLLM's six passes interpreted): 55 minutes
RUNS = [_run(2000), _run(1000, 0.7, gamma=3), _run(1000, sample_method="probabilistic"),
        _run(500, 0.7, gamma=3, sample_method="probabilistic")]


@torch.no_grad()
def _serial_greedy(refiner, base, hidden, anchors, before) -> tuple[torch.Tensor, torch.Tensor]:
    """The refiner's law drafted greedily token by token: ``[N, B - 1]`` tokens and their logits ``[N, B - 1, V]``;
    ``before``: the token each block's first position reads (vLLM passes the anchor)."""
    N, B, _ = base.shape
    previous = torch.zeros(N, B, dtype=torch.int64)
    previous[:, 0], previous[:, 1] = before, anchors
    tokens, logits = [], []
    for k in range(1, B):
        row = base[:, k] + refiner(hidden, previous, torch.full((N,), k))
        tokens.append(row.argmax(-1))
        logits.append(row)
        if k + 1 < B:
            previous[:, k + 1] = tokens[-1]
    return torch.stack(tokens, 1), torch.stack(logits, 1)


@torch.no_grad()
def parts(seed: int = 0) -> list[dict]:
    """vLLM's XPress head against ``drafts.xpress`` (module docstring's ``--parts``)."""
    xpress_parts()
    g = torch.Generator().manual_seed(seed)
    rows = []
    vocab, hidden, requests = 64, 32, 6
    for block in (4, 8):
        tables = refiner_tables(vocab, hidden, block, g, scale=3.0)
        refiner = our_refiner(tables, hidden, block)
        base = torch.randn(requests, block, vocab, generator=g)
        states = torch.randn(requests, block, hidden, generator=g)
        anchors = torch.randint(vocab, (requests,), generator=g)
        truly_before = torch.randint(vocab, (requests,), generator=g)
        serial, logits = _serial_greedy(refiner, base, states, anchors, anchors)
        true_predecessor, _ = _serial_greedy(refiner, base, states, anchors, truly_before)
        for topc in (0, TOPC):
            head = vllm_head(tables, hidden, block, requests, topc)
            row = {"block": block, "top_c": topc, "requests": requests, "vocabulary": vocab}
            for passes in sorted({block - 1, PASSES, 1}):
                draft, last = head.jacobi_refine_greedy(base, states, anchors, anchors, passes, return_logits=True)
                key = f"passes_{passes}"
                row[key + "_blocks_unlike_serial_greedy"] = int((draft != serial).any(-1).sum())
                if passes >= block - 1:  # top-C: its logits over the candidates, here every token (sorted)
                    last = last.view_as(logits)
                    got, want = (last.sort(-1).values, logits.sort(-1).values) if topc else (last, logits)
                    row[key + "_relative_logits_difference"] = float((got - want).abs().max() / want.abs().max())
            row["true_predecessor_blocks_unlike_vllms"] = int((true_predecessor != serial).any(-1).sum())
            rows.append(row)
    return rows


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--parts"]:
        import json

        from specresearch.experiments.records import record_header

        out = argv[2] if argv[1:2] == ["--out"] else "benchmarks/records/audit_vllm_xpress_parts.json"
        rows = parts()
        settled = [r[f"passes_{p}_blocks_unlike_serial_greedy"] for r in rows for p in (r["block"] - 1, PASSES)
                   if p >= r["block"] - 1 and r[f"passes_{p}_blocks_unlike_serial_greedy"]]  # B - 1 passes settle it
        worst = max(v for r in rows for k, v in r.items() if k.endswith("logits_difference"))
        record = {**record_header("benchmarks/audit_vllm_xpress.py", argv, target=None, vllm=VLLM), "rows": rows,
                  "largest_relative_logits_difference": worst, "settled_drafts_agree": not settled}
        Path(out).write_text(json.dumps(record, indent=1) + "\n")
        print(json.dumps(rows, indent=1))
        print(f"largest relative logits difference {worst:.2e}, settled drafts agree: {not settled}; record {out}")
        return 0 if worst < 1e-5 and not settled else 1
    return runs_main(__doc__, "audit_vllm_xpress", RUNS, [], argv)


if __name__ == "__main__":
    sys.exit(main())
