"""Audit by execution of vLLM's own speculative sampling: vLLM 0.34's ``rejection_sample`` (``vllm/v1/worker/gpu/
spec_decode/rejection_sampler_utils.py``, its Triton kernels: the per-block logit statistics, the accept / reject
loop, the resampling from the residual and the bonus token) decides every step, and in the ``drafting="vllm"`` runs
its drafting sampler (``sample/gumbel.py``'s ``gumbel_sample`` as its speculators call it) draws every draft token, on
the CPU in Triton's interpreter; the measured law of the first two tokens against the target's
(``specresearch.audit.execute``, engine ``python``).

How vLLM's GPU code runs here: the wheels ``vllm==0.34.0`` and ``triton==3.9.0`` come from the package index as
published (``specresearch.paths.pypi_wheel``: unpacked under the cache, nothing installed into the project's
environment); ``TRITON_INTERPRET=1`` makes Triton execute each kernel with NumPy on the CPU, program instance by
program instance; ``VLLM_TARGET_DEVICE=cpu`` and an empty ``CUDA_VISIBLE_DEVICES`` (vLLM then keeps Triton enabled
without a GPU driver, as on a Ray worker before CUDA starts). The packages vLLM's import chain names and the kernels
never call (aiohttp, cachetools, pybase64, media libraries: :data:`NEVER_CALLED`) are empty modules where they are
missing (``specresearch.paths.empty_modules``). Two interpreter gaps stand in: libdevice's ``log1p`` is ``log(1 +
x)`` (one call, in the resampling kernel's residual: equal up to float rounding), and a load or store whose mask the
interpreter types as int32 (the draft-logits cache store) reads it as nonzero = on, as compiled code does.

Around it, ours: a tiny random Llama target and a perturbed copy of it as the draft (``models.families``; 64
tokens); each step drafts gamma tokens, runs the target on the row and its drafts, puts the target's logits through
vLLM's own temperature kernel (``apply_temperature``, skipped at T = 1 as vLLM skips it), hands vLLM the draft logits
before temperature in its ``DraftLogitsCache`` and keeps ``sampled[:num_sampled]``; a row short of two tokens takes
another step. Two ways to draft (:class:`VllmSampler`): ``torch`` draws from softmax(draft logits / T) by torch's
generator with a fresh vLLM seed each step (the claim tested is the verification's, whatever the draft); ``vllm``
runs vLLM's Gumbel-max drafting with ``is_drafting`` (its noise keyed by the request's seed mixed with the draft
column, at the source token's position plus a salt), writing the cache column by column itself, with one seed per
request for the whole generation as vLLM serves a request: the draft's noise and the verification's (the acceptance
uniforms, the residual's and the bonus's Gumbel noise, keyed by the same seed and positions) meet as they do in vLLM.

    python benchmarks/audit_vllm.py [--out benchmarks/records/audit_vllm.json] [--scale 1.0]
    python benchmarks/audit_vllm.py --controls [--out benchmarks/records/audit_vllm_controls.json]

``--controls``: runs whose law is not the target's, kept out of docs/audit.md's table: the harness handing vLLM a q
other than the law its drafts were drawn from (the measurement must reject the target's law); vLLM's ``fly``
method, which its configuration documents as lossy (the distance measured; the audit has no encoding of it); and
vLLM's drafting with its draft-noise salt set to 0 (:func:`set_draft_salt`), so that the first draft's Gumbel noise
is the noise its residual is resampled with: what the salt prevents, measured. Resumable
(``audit.execute.record_tiny_runs``): configurations already in the record are kept. Each configuration costs about
35 ms of interpreted kernels per request and step (about 0.13 s a generation with vLLM's drafting).
"""

from __future__ import annotations

import os
import sys
import types

import torch

from specresearch.audit.execute import TinyRun

VLLM, TRITON = "vllm==0.34.0", "triton==3.9.0"
NEVER_CALLED = ("aiohttp", "cachetools", "pybase64", "av", "cv2", "runai_model_streamer", "soundfile", "soxr",
                "torchaudio", "torchcodec", "uvloop", "cloudpickle", "cpuinfo", "msgspec", "flashinfer",
                "flashinfer_cubin")
BATCH = 500  # requests per call of vLLM's kernels
SEED, NOISE = 0, 0.1  # the target's weights; the draft is the target with its weights perturbed by NOISE
SALT = 1 << 30  # vLLM's _DRAFT_NOISE_SALT


def vllm_kernels():
    """vLLM's ``rejection_sample``, ``DraftLogitsCache`` and ``apply_temperature``, imported to run in Triton's
    interpreter (module docstring); once a process."""
    if "vllm" not in sys.modules:
        from specresearch.paths import empty_modules, pypi_wheel

        os.environ.update(TRITON_INTERPRET="1", VLLM_TARGET_DEVICE="cpu", CUDA_VISIBLE_DEVICES="")
        sys.path[:0] = [str(pypi_wheel(VLLM)), str(pypi_wheel(TRITON))]
        empty_modules(NEVER_CALLED)
    import triton.language as tl
    import vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils as utils
    from vllm.v1.worker.gpu.sample.gumbel import apply_temperature, gumbel_sample
    from vllm.v1.worker.gpu.spec_decode.draft_logits import DraftLogitsCache

    utils.tldevice = types.SimpleNamespace(log1p=lambda x: tl.log(1.0 + x))  # the interpreter has no libdevice
    _boolean_masks()
    return utils.rejection_sample, DraftLogitsCache, apply_temperature, gumbel_sample


def _boolean_masks() -> None:
    """Triton's interpreter types some masks as int32 (``mask & (row >= 0)``, the draft-logits cache store in
    ``gumbel_block_argmax``; the DFlash2 walk's ``mask & valid`` loads), which its loads and stores refuse; a mask is
    read as nonzero = on, as the compiled kernel reads it."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_masked_store, "boolean_masks", False):
        return
    store, load = builder.create_masked_store, builder.create_masked_load

    def boolean(mask):
        return mask if mask.data.dtype == np.bool_ else interpreter.TensorHandle(mask.data != 0, tl.int1)

    def boolean_store(self, ptrs, value, mask, cache_policy):
        return store(self, ptrs, value, boolean(mask), cache_policy)

    def boolean_load(self, ptrs, mask, other, cache_policy, is_volatile):
        return load(self, ptrs, boolean(mask), other, cache_policy, is_volatile)

    boolean_store.boolean_masks = True
    builder.create_masked_store, builder.create_masked_load = boolean_store, boolean_load


def set_draft_salt(salt: int) -> None:
    """vLLM's ``_DRAFT_NOISE_SALT`` (``sample/gumbel.py``: added to the position of a drafted token's Gumbel noise,
    keeping it apart from the noise the verification resamples with); the controls set 0, every other run keeps 2**30.
    Read at each call in Triton's interpreter."""
    import triton.language as tl
    import vllm.v1.worker.gpu.sample.gumbel as gumbel

    gumbel._DRAFT_NOISE_SALT = tl.constexpr(salt)


class Batched:
    """A ``sample(prompt, n_tokens)`` that draws a batch of generations at a time (its ``_generate``) and hands them
    out one by one."""

    _ready: list

    def __call__(self, prompt, n_tokens: int) -> list[int]:
        if not self._ready:
            self._ready = self._generate(list(prompt), n_tokens)
        return self._ready.pop()


class VllmSampler(Batched):
    """``sample(prompt, n_tokens)`` for the ``python`` engine, drawing :data:`BATCH` generations at a time through
    vLLM's kernels (module docstring). ``method``: ``"standard"``, ``"block"`` or ``"fly"`` (``fly_window``);
    ``handed``: ``"draft"`` (the truth) or ``"uniform"`` (the control: vLLM is handed uniform draft logits);
    ``drafting``: ``"torch"`` (drafts from softmax(draft logits / T) by torch's generator, a fresh vLLM seed per step)
    or ``"vllm"`` (vLLM's own drafting sampler, ``gumbel_sample`` as its speculators call it: Gumbel-max on the draft
    logits over T with ``is_drafting``, caching the logits before temperature into ``DraftLogitsCache`` column by
    column; one seed per request for the whole generation, drawn as vLLM draws an unset seed, so that the draft's
    noise and the verification's meet across steps as they do when vLLM serves a request); ``draft_salt``: vLLM's
    draft-noise salt (:func:`set_draft_salt`; 0 in a control)."""

    cache_fill = 0.0  # the draft-logits cache's value before the drafts write it (DraftLogitsCache's fill)

    def __init__(self, target, draft, temperature: float, gamma: int, method: str = "standard", fly_window: int = 1,
                 handed: str = "draft", drafting: str = "torch", draft_salt: int = SALT) -> None:
        self.target, self.draft, self.temperature, self.gamma = target, draft, temperature, gamma
        self.method, self.fly_window, self.handed, self.drafting = method, fly_window, handed, drafting
        self.kernels, self._ready = vllm_kernels(), []
        set_draft_salt(draft_salt)

    def _verified_cache(self, cache):
        """The draft-logits cache ``rejection_sample`` reads (None: one-hot drafts), given the one drafting wrote."""
        return cache

    @torch.no_grad()
    def _generate(self, prompt: list[int], n_tokens: int) -> list[list[int]]:
        rows = [list(prompt) for _ in range(BATCH)]
        seeds = (torch.randint(-2**63, 2**63 - 1, (BATCH,), dtype=torch.int64)  # as vLLM draws an unset seed
                 if self.drafting == "vllm" else torch.zeros(BATCH, dtype=torch.int64))  # torch: drawn each step
        while True:
            short = [i for i, row in enumerate(rows) if len(row) - len(prompt) < n_tokens]
            if not short:
                return [row[len(prompt):] for row in rows]
            for length in sorted({len(rows[i]) for i in short}):
                group = [i for i in short if len(rows[i]) == length]
                for i, emitted in zip(group, self._step(torch.tensor([rows[i] for i in group]), seeds[group])):
                    rows[i] += emitted

    def _drafts(self, ids: torch.Tensor, seeds: torch.Tensor, cache) -> torch.Tensor:
        """``ids [R, L]`` and gamma drafted tokens, their draft logits (before temperature) in ``cache``."""
        gumbel_sample = self.kernels[3]
        (R, L), T = ids.shape, self.temperature
        temperature, requests = torch.full((R,), T, dtype=torch.float32), torch.arange(R, dtype=torch.int32)
        seqs = ids
        for col in range(self.gamma):
            logits = self.draft(seqs).logits[:, -1].float().contiguous()
            if self.drafting == "vllm":  # as vLLM's standalone speculator: the source token's position, the column
                positions = torch.full((R,), L - 1 + col, dtype=torch.int64)
                token = gumbel_sample(logits, requests, temperature, seeds, positions, apply_temperature=True,
                                      is_drafting=True, logits_cache=cache.values,
                                      logits_cache_col=torch.tensor(col, dtype=torch.int64))[:, None]
            else:
                cache.values[:, col] = logits
                token = torch.multinomial((logits / T).softmax(-1), 1)
            seqs = torch.cat([seqs, token], 1)
        return seqs

    def _step(self, ids: torch.Tensor, seeds: torch.Tensor) -> list[list[int]]:
        """One speculative step of every row of ``ids [R, L]`` (one length; ``seeds [R]``, the requests' seeds): the
        tokens vLLM emits for each."""
        rejection_sample, DraftLogitsCache, apply_temperature, _ = self.kernels
        (R, L), g, T = ids.shape, self.gamma, self.temperature
        V = self.target.config.vocab_size
        cache = DraftLogitsCache(R, g, V, dtype=torch.float32, fill=self.cache_fill, device="cpu")
        seqs = self._drafts(ids, seeds, cache)
        cache = self._verified_cache(cache)
        if self.handed == "uniform":
            cache.values.zero_()
        if self.drafting == "torch":
            seeds = torch.randint(0, 2**31 - 1, (R,), dtype=torch.int64)
        target_logits = self.target(seqs).logits[:, L - 1:].float().reshape(R * (g + 1), -1).contiguous()
        local = torch.arange(g + 1, dtype=torch.int32).repeat(R)
        expanded = torch.arange(R, dtype=torch.int32).repeat_interleave(g + 1)
        temperature = torch.full((R,), T, dtype=torch.float32)
        if T != 1.0:
            apply_temperature(target_logits, expanded, temperature)
        draft_sampled = seqs[:, L - 1:].reshape(-1).contiguous()  # each logit's input token: the last, then the drafts
        sampled, num_sampled = rejection_sample(
            target_logits, cache, draft_sampled, torch.arange(0, R * (g + 1) + 1, g + 1, dtype=torch.int32),
            (L - 1 + local).to(torch.int64), torch.arange(R, dtype=torch.int32), expanded, local, temperature, seeds, g,
            use_block_verification=self.method == "block", fly_window_size=self.fly_window if self.method == "fly" else 0)
        return [row[:n].tolist() for row, n in zip(sampled, num_sampled.tolist())]


def _pair():
    from specresearch.models.families import perturbed_copy, tiny_family_model

    target = tiny_family_model("llama", "sdpa", seed=SEED, init_std=0.5)
    return target, perturbed_copy(target, noise=NOISE, seed=1)


def _run(n: int, temperature: float = 1.0, gamma: int = 2, method: str = "standard", handed: str = "draft",
         fly_window: int = 1, drafting: str = "torch", draft_salt: int = SALT) -> TinyRun:
    expected = ("the target's law rejected: the harness's control" if handed != "draft" else
                "not the target's law: the draft's noise is the verification's (control)" if draft_salt != SALT else
                "not the target's law: vLLM documents fly as lossy (the audit has no encoding of it)" if method == "fly"
                else "the target's law (vLLM's claim)")

    def build():
        target, draft = _pair()
        sample = VllmSampler(target, draft, temperature, gamma, method, fly_window, handed, drafting, draft_salt)
        return target, draft, {"gamma": gamma, "vllm_method": method, "handed": handed, "drafting": drafting,
                               "expected": expected}, {"sample": sample}

    what = ("vLLM 0.34 gumbel_sample drafting and rejection_sample" if drafting == "vllm" else
            "vLLM 0.34 rejection_sample") + f", method {method!r}" + (f", window {fly_window}" if method == "fly" else "")
    suffix = "" if handed == "draft" else ", handed uniform draft logits (control)"
    what += suffix + (f", draft noise salt {draft_salt} (control)" if draft_salt != SALT else "")
    return TinyRun(f"tiny two-layer Llama (seed {SEED}) and its perturbed copy (noise {NOISE}), gamma {gamma}{suffix}",
                   build, "python", 2, n, temperature, {"name": what, "version": VLLM})


# each row records the TV its N detects (cells of expected count >= 20)
RUNS = [_run(8000), _run(6000, 0.7), _run(6000, method="block"), _run(4000, gamma=3, method="block"),
        _run(20000, gamma=3),  # the power run: detects TV 0.027
        _run(8000, drafting="vllm"), _run(4000, 0.7, gamma=3, drafting="vllm"),
        _run(6000, gamma=3, method="block", drafting="vllm")]
CONTROLS = [_run(2000, handed="uniform"), _run(4000, method="fly"), _run(4000, drafting="vllm", draft_salt=0)]


def runs_main(doc: str, name: str, runs, controls, argv=None) -> int:
    """The command line of ``benchmarks/<name>.py`` (docstring ``doc``): its ``runs``, or with ``--controls`` its
    ``controls``, into ``benchmarks/records/<name>.json`` (``<name>_controls.json``) or ``--out``, every N times
    ``--scale``, on ``--threads`` (``audit.execute.record_tiny_runs``: resumable)."""
    import argparse

    from specresearch.audit.execute import record_tiny_runs

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--controls", action="store_true", help="the control runs (module docstring)")
    parser.add_argument("--out", help=f"default benchmarks/records/{name}.json ({name}_controls.json)")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = args.out or f"benchmarks/records/{name}{'_controls' if args.controls else ''}.json"
    record_tiny_runs(out, f"benchmarks/{name}.py", argv, controls if args.controls else runs, scale=args.scale)
    return 0


def main(argv=None) -> int:
    return runs_main(__doc__, "audit_vllm", RUNS, CONTROLS, argv)


if __name__ == "__main__":
    sys.exit(main())
