"""Audit by execution of vLLM's own rejection sampler: vLLM 0.34's ``rejection_sample`` (``vllm/v1/worker/gpu/
spec_decode/rejection_sampler_utils.py``, its Triton kernels: the per-block logit statistics, the accept / reject
loop, the resampling from the residual and the bonus token) decides every step, on the CPU in Triton's interpreter;
the measured law of the first two tokens against the target's (``specresearch.audit.execute``, engine ``python``).

How vLLM's GPU code runs here: the wheels ``vllm==0.34.0`` and ``triton==3.9.0`` come from the package index as
published (``specresearch.paths.pypi_wheel``: unpacked under the cache, nothing installed into the project's
environment); ``TRITON_INTERPRET=1`` makes Triton execute each kernel with NumPy on the CPU, program instance by
program instance; ``VLLM_TARGET_DEVICE=cpu`` and an empty ``CUDA_VISIBLE_DEVICES`` (vLLM then keeps Triton enabled
without a GPU driver, as on a Ray worker before CUDA starts). The packages vLLM's import chain names and the kernels
never call (aiohttp, cachetools, pybase64, media libraries: :data:`NEVER_CALLED`) are empty modules where they are
missing (``specresearch.paths.empty_modules``); libdevice's ``log1p``, which the interpreter does not implement, is ``log(1 + x)`` (one call, in the
resampling kernel's residual: equal up to float rounding).

Around it, ours: a tiny random Llama target and a perturbed copy of it as the draft (``models.families``; 64
tokens); each step drafts gamma tokens from softmax(draft logits / T), runs the target on the row and its drafts,
puts the target's logits through vLLM's own temperature kernel (``apply_temperature``, skipped at T = 1 as vLLM
skips it), hands vLLM the draft logits before temperature in its ``DraftLogitsCache`` (as its drafter caches them)
and one seed per request, and keeps ``sampled[:num_sampled]``; a row short of two tokens takes another step. vLLM's
own drafting (Gumbel sampling in its speculators) is not run: the claim tested is its verification's, that
``standard`` and ``block`` keep the target's law whatever the draft.

    python benchmarks/audit_vllm.py [--out benchmarks/records/audit_vllm.json] [--scale 1.0]
    python benchmarks/audit_vllm.py --controls [--out benchmarks/records/audit_vllm_controls.json]

``--controls``: runs whose law is not the target's, kept out of docs/audit.md's table: the harness handing vLLM a q
other than the law its drafts were drawn from (the measurement must reject the target's law), and vLLM's
``fly`` method, which its configuration documents as lossy (the distance measured; the audit has no encoding of it).
Resumable (``audit.execute.record_tiny_runs``): configurations already in the record are kept. Each configuration
costs about 35 ms of interpreted kernels per request and step.
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
    from vllm.v1.worker.gpu.sample.gumbel import apply_temperature
    from vllm.v1.worker.gpu.spec_decode.draft_logits import DraftLogitsCache

    utils.tldevice = types.SimpleNamespace(log1p=lambda x: tl.log(1.0 + x))  # the interpreter has no libdevice
    return utils.rejection_sample, DraftLogitsCache, apply_temperature


class VllmSampler:
    """``sample(prompt, n_tokens)`` for the ``python`` engine, drawing :data:`BATCH` generations at a time through
    vLLM's kernels (module docstring). ``method``: ``"standard"``, ``"block"`` or ``"fly"`` (``fly_window``);
    ``handed``: ``"draft"`` (the truth) or ``"uniform"`` (the control: vLLM is handed uniform draft logits)."""

    def __init__(self, target, draft, temperature: float, gamma: int, method: str = "standard", fly_window: int = 1,
                 handed: str = "draft") -> None:
        self.target, self.draft, self.temperature, self.gamma = target, draft, temperature, gamma
        self.method, self.fly_window, self.handed = method, fly_window, handed
        self.kernels, self._ready = vllm_kernels(), []

    def __call__(self, prompt, n_tokens: int) -> list[int]:
        if not self._ready:
            self._ready = self._generate(list(prompt), n_tokens)
        return self._ready.pop()

    @torch.no_grad()
    def _generate(self, prompt: list[int], n_tokens: int) -> list[list[int]]:
        rows = [list(prompt) for _ in range(BATCH)]
        while True:
            short = [i for i, row in enumerate(rows) if len(row) - len(prompt) < n_tokens]
            if not short:
                return [row[len(prompt):] for row in rows]
            for length in sorted({len(rows[i]) for i in short}):
                group = [i for i in short if len(rows[i]) == length]
                for i, emitted in zip(group, self._step(torch.tensor([rows[i] for i in group]))):
                    rows[i] += emitted

    def _step(self, ids: torch.Tensor) -> list[list[int]]:
        """One speculative step of every row of ``ids [R, L]`` (one length): the tokens vLLM emits for each."""
        rejection_sample, DraftLogitsCache, apply_temperature = self.kernels
        (R, L), g, T = ids.shape, self.gamma, self.temperature
        seqs, draft_logits = ids, []
        for _ in range(g):
            logits = self.draft(seqs).logits[:, -1].float()
            draft_logits.append(logits)
            token = torch.multinomial((logits / T).softmax(-1), 1)
            seqs = torch.cat([seqs, token], 1)
        target_logits = self.target(seqs).logits[:, L - 1:].float().reshape(R * (g + 1), -1).contiguous()
        V = target_logits.shape[-1]
        local = torch.arange(g + 1, dtype=torch.int32).repeat(R)
        expanded = torch.arange(R, dtype=torch.int32).repeat_interleave(g + 1)
        temperature = torch.full((R,), T, dtype=torch.float32)
        if T != 1.0:
            apply_temperature(target_logits, expanded, temperature)
        cache = DraftLogitsCache(R, g, V, dtype=torch.float32, fill=0.0, device="cpu")
        cache.values.copy_(torch.stack(draft_logits, 1) if self.handed == "draft" else torch.zeros(R, g, V))
        draft_sampled = seqs[:, L - 1:].reshape(-1).contiguous()  # each logit's input token: the last, then the drafts
        seeds = torch.randint(0, 2**31 - 1, (R,), dtype=torch.int64)
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
         fly_window: int = 1) -> TinyRun:
    expected = ("the target's law rejected: the harness's control" if handed != "draft" else
                "not the target's law: vLLM documents fly as lossy (the audit has no encoding of it)" if method == "fly"
                else "the target's law (vLLM's claim)")

    def build():
        target, draft = _pair()
        sample = VllmSampler(target, draft, temperature, gamma, method, fly_window, handed)
        return target, draft, {"gamma": gamma, "vllm_method": method, "handed": handed, "expected": expected}, {
            "sample": sample}

    what = f"vLLM 0.34 rejection_sample, method {method!r}" + (f", window {fly_window}" if method == "fly" else "")
    control = "" if handed == "draft" else ", handed uniform draft logits (control)"
    return TinyRun(f"tiny two-layer Llama (seed {SEED}) and its perturbed copy (noise {NOISE}), gamma {gamma}{control}",
                   build, "python", 2, n, temperature, {"name": what + control, "version": VLLM})


# each row records the TV its N detects (cells of expected count >= 20)
RUNS = [_run(8000), _run(6000, 0.7), _run(6000, method="block"), _run(4000, gamma=3, method="block"),
        _run(20000, gamma=3)]  # the power run: detects TV 0.027
CONTROLS = [_run(2000, handed="uniform"), _run(4000, method="fly")]


def main(argv=None) -> int:
    import argparse

    from specresearch.audit.execute import record_tiny_runs

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--controls", action="store_true", help="the control runs (module docstring)")
    parser.add_argument("--out", help="default benchmarks/records/audit_vllm.json (audit_vllm_controls.json)")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = args.out or f"benchmarks/records/audit_vllm{'_controls' if args.controls else ''}.json"
    record_tiny_runs(out, "benchmarks/audit_vllm.py", argv, CONTROLS if args.controls else RUNS, scale=args.scale)
    return 0


if __name__ == "__main__":
    sys.exit(main())
