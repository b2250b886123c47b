"""Audit by execution of vLLM's sampling parameters under speculative decoding: vLLM 0.34's Model Runner V2 sampler
(``v1/worker/gpu/sample/sampler.py``, ``Sampler.apply_sampling_params``: its logit-bias, penalties and bad-words
processors, the temperature, its top-k / top-p kernel) processes the target's logits at every verified position,
counting the drafted tokens before a position as output (the penalties kernel adds them to the request's output
counts, the bad-words kernel matches them), and ``RejectionSampler._verify`` hands the result to ``rejection_sample``;
vLLM's ``post_update`` kernel commits the emitted tokens to the request's state (token ids, length, output counts);
the drafts come from vLLM's drafting sampler (``gumbel_sample`` with ``is_drafting``) at the temperature alone, as
vLLM drafts whatever the request's other settings (``spec_decode/speculator.py``). The law of the first two tokens is
held against the law the settings define, computed from their definitions (``audit.real.vllm_law``), not from
vLLM's kernels (``specresearch.audit.execute``, engine ``python`` with ``target_law``). ``min_p`` and ``logit_bias``
are left out: vLLM 0.34 refuses them with speculative decoding (``SamplingParams._validate_spec_decode``).

How it runs: vLLM's kernels in Triton's interpreter as ``benchmarks/audit_vllm.py`` runs them (``vllm_kernels``),
with the interpreter's ``tl.range`` shim of ``benchmarks/audit_vllm_topk.py`` for the top-k / top-p kernel (launched
with the 256-wide tiles vLLM gives CPU tensors: one tile covers the 64-token vocabulary, as CUDA's 8,192 do). What the sampler's state needs besides: ``SamplingParams`` is a msgspec
``Struct``, so the wheel ``msgspec==0.19.0`` comes unpacked like vLLM's (compiled code: the wheel for this machine);
vLLM's request-state buffers ask for pinned host memory, which a machine without a GPU lacks, so ``UvaBuffer`` is
the one vLLM's own CPU runner puts in its place (``v1/worker/cpu/buffer_utils.py``, substituted as
``v1/worker/cpu/shm.py`` does). Each generation is one request slot of vLLM's ``RequestState`` (:data:`BATCH` at a
time), added with ``Sampler.add_request`` (its seed drawn as vLLM draws an unset one, NumPy's generator seeded from
torch's so that a run repeats); each step drafts gamma tokens from the request's last committed token, runs the
target on them, verifies with ``RejectionSampler._verify`` and commits with ``post_update``. As in ``audit_vllm.py``
the first step drafts from the prompt (vLLM samples a request's first token from the target alone).

The model: ``audit_vllm.py``'s tiny Llama and its perturbed copy, on the prompt (39, 23, 46), after which the
target repeats its first token with probability 0.84: the penalties and the bad word (20, 20) decide the second
token (TV 0.30-0.78 from the law without them). ``min_tokens`` (stop token 20, the first token 0.96 of the time
without it) is decided by each row's position: a row that banned it on the second token too would move the law by
TV 0.50.

    PYTHONPATH=. .venv/bin/python benchmarks/audit_vllm_params.py [--out benchmarks/records/audit_vllm_params.json]
    PYTHONPATH=. .venv/bin/python benchmarks/audit_vllm_params.py --controls

``--controls``: the same sampler held against laws it must not keep (the settings' law without the penalties and the
bad words; the law with the output tokens ignored, as if vLLM left the drafts out of the counts): the measurement
rejects each, at its N. Resumable (``audit.execute.record_tiny_runs``).
"""

from __future__ import annotations

import sys
import types
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from audit_vllm import SEED, VLLM, Batched, _pair, runs_main, vllm_kernels  # noqa: E402
from audit_vllm_topk import tensor_ranges  # noqa: E402

from specresearch.audit.execute import TinyRun  # noqa: E402
from specresearch.audit.real import vllm_law  # noqa: E402

MSGSPEC = "msgspec==0.19.0"
BATCH = 500  # request slots, one generation each (about 0.26 s a generation on one core)
PROMPT = (39, 23, 46)


def vllm_sampler_parts():
    """vLLM's ``SamplingParams``, ``RequestState``, ``Sampler``, ``RejectionSampler``, ``post_update`` and
    ``DraftLogitsCache``, to run on the CPU (module docstring); once a process."""
    if "vllm" not in sys.modules:
        from specresearch.paths import pypi_wheel

        sys.path.insert(0, str(pypi_wheel(MSGSPEC)))  # before vllm_kernels, which makes missing packages empty
    import msgspec

    if not hasattr(msgspec, "Struct"):
        raise RuntimeError("msgspec is an empty module in this process (vLLM was imported without it first)")
    kernels = vllm_kernels()
    tensor_ranges()
    import vllm.v1.worker.cpu.buffer_utils as cpu_buffers
    import vllm.v1.worker.gpu.buffer_utils as gpu_buffers
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu.input_batch import post_update
    from vllm.v1.worker.gpu.sample.sampler import Sampler
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler
    from vllm.v1.worker.gpu.states import RequestState

    gpu_buffers.UvaBuffer = cpu_buffers.UvaBuffer
    return SamplingParams, RequestState, Sampler, RejectionSampler, post_update, kernels[1], kernels[3]


def sampling_params(temperature: float, settings: dict):
    """vLLM's ``SamplingParams`` of a request with ``settings`` (those of ``audit.real.vllm_law``); bad words as token
    id lists, where vLLM keeps them once its tokenizer has read the words."""
    SamplingParams = vllm_sampler_parts()[0]
    settings = dict(settings)
    bad_words = settings.pop("bad_words", None)
    params = SamplingParams(temperature=temperature, **settings)
    if bad_words:
        params._bad_words_token_ids = [list(word) for word in bad_words]
    return params


class VllmParamsSampler(Batched):
    """``sample(prompt, n_tokens)`` for the ``python`` engine: :data:`BATCH` generations at a time, each a vLLM
    request with ``settings`` at ``temperature``, verified by vLLM's ``RejectionSampler`` (``method``: ``"standard"``
    or ``"block"``) with drafts of ``gamma`` tokens from vLLM's drafting sampler (module docstring)."""

    def __init__(self, target, draft, temperature: float, gamma: int, settings: dict, method: str = "standard"):
        self.target, self.draft, self.temperature, self.gamma = target, draft, temperature, gamma
        self.settings, self.method, self._ready = dict(settings), method, []
        self.parts = vllm_sampler_parts()

    @torch.no_grad()
    def _generate(self, prompt: list[int], n_tokens: int) -> list[list[int]]:
        _, RequestState, Sampler, RejectionSampler, _, DraftLogitsCache, _ = self.parts
        g, V, cpu = self.gamma, self.target.config.vocab_size, torch.device("cpu")
        state = RequestState(BATCH, len(prompt) + n_tokens + g + 1, BATCH * (g + 1), g, V, cpu)
        sampler = Sampler(types.SimpleNamespace(reasoning_config=None), BATCH, V, cpu, state, num_speculative_tokens=g)
        spec = types.SimpleNamespace(num_speculative_tokens=g, enable_adaptive_verification=False,
                                     rejection_sample_method=self.method, fly_entropy_threshold=None,
                                     fly_entropy_top_k=None, synthetic_acceptance_rates=None, fly_window_size=None)
        verifier = RejectionSampler(sampler, spec, cpu)
        params = sampling_params(self.temperature, self.settings)
        for slot in range(BATCH):
            state.all_token_ids.stage_write(slot, 0, prompt)
            state.total_len.stage_write(slot, 0, [len(prompt)])
        state.prompt_len.np[:] = state.prefill_len.np[:] = len(prompt)
        state.all_token_ids.apply_write()
        state.total_len.apply_write()
        state.prompt_len.copy_to_uva()
        state.prefill_len.copy_to_uva()
        np.random.seed(int(torch.randint(0, 2**31 - 1, ())))  # vLLM draws an unset seed from NumPy's generator
        for slot in range(BATCH):
            sampler.add_request(slot, params)
        sampler.apply_staged_writes()
        cache = DraftLogitsCache(BATCH, g, V, dtype=torch.float32, fill=0.0, device="cpu")
        end = len(prompt) + n_tokens
        while True:
            lengths = state.total_len.gpu[:BATCH].clone()
            if bool((lengths >= end).all()):
                return state.all_token_ids.gpu[:, len(prompt):end].tolist()
            for length in sorted(set(lengths[lengths < end].tolist())):
                slots = torch.nonzero(lengths == length).flatten().to(torch.int32)
                self._step(state, sampler, verifier, cache, slots, int(length))

    def _step(self, state, sampler, verifier, cache, slots: torch.Tensor, L: int) -> None:
        """One speculative step of the request ``slots`` (all of committed length ``L``), as vLLM's model runner
        takes one: draft, score, verify, commit."""
        post_update, gumbel_sample = self.parts[4], self.parts[6]
        n, g = len(slots), self.gamma
        seqs = state.all_token_ids.gpu[slots.long(), :L].long()
        states = sampler.sampling_states
        for col in range(g):  # as vLLM's standalone speculator: the source token's position, the column
            logits = self.draft(seqs).logits[:, -1].float().contiguous()
            token = gumbel_sample(logits, slots, states.temperature.gpu, states.seeds.gpu,
                                  torch.full((n,), L - 1 + col, dtype=torch.int64), apply_temperature=True,
                                  is_drafting=True, logits_cache=cache.values,
                                  logits_cache_col=torch.tensor(col, dtype=torch.int64))
            seqs = torch.cat([seqs, token[:, None]], 1)
        target_logits = self.target(seqs).logits[:, L - 1:].float().reshape(n * (g + 1), -1).contiguous()
        local = torch.arange(g + 1, dtype=torch.int32).repeat(n)
        _, sampled, num_sampled = verifier._verify(
            target_logits, cache, seqs[:, L - 1:].reshape(-1).contiguous(), (L - 1 + local).to(torch.int64),
            torch.arange(0, n * (g + 1) + 1, g + 1, dtype=torch.int32), slots, slots.numpy(),
            slots.repeat_interleave(g + 1), local, np.full(n, L + g + 1))
        post_update(slots, state.num_computed_tokens.gpu, state.last_sampled_tokens,
                    sampler.penalties_state.output_bin_counts, sampled, num_sampled, (g + 1) - num_sampled, None,
                    state.all_token_ids.gpu, state.total_len.gpu)


def settings_law(prompt, temperature: float, settings: dict, ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """``audit.real.vllm_law`` after ``ids`` (``prompt`` and the tokens after it): the python engine's
    ``target_law``."""
    return vllm_law(logits, prompt, ids[len(prompt):], temperature=temperature, **settings)


def ignoring_output(prompt, temperature: float, settings: dict, ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """The law with the output tokens left out of the penalties and the bad words (a control's)."""
    return vllm_law(logits, prompt, [], temperature=temperature, **settings)


def _run(n: int, settings: dict, temperature: float = 1.0, gamma: int = 2, method: str = "standard",
         control: str = "") -> TinyRun:
    law_settings = {k: v for k, v in settings.items() if k in ("top_k", "top_p")} if control == "plain" else settings
    law = partial(ignoring_output if control == "output" else settings_law, PROMPT, temperature, law_settings)
    expected = {"": "the law the settings define (vLLM's claim)",
                "plain": "rejected: the law without the penalties and bad words (control)",
                "output": "rejected: the law with the output left out of the penalties and bad words (control)"}[control]

    def build():
        target, draft = _pair()
        sample = VllmParamsSampler(target, draft, temperature, gamma, settings, method)
        return target, draft, {"gamma": gamma, "vllm_method": method, "expected": expected}, {"sample": sample, "target_law": law}

    what = f"vLLM 0.34 Sampler.apply_sampling_params and rejection_sample, method {method!r}"
    held = {"": "", "plain": ", held to the law without the penalties (control)",
            "output": ", held to the law ignoring the output (control)"}[control]
    return TinyRun(f"tiny two-layer Llama (seed {SEED}) and its perturbed copy, gamma {gamma}{held}", build, "python", 2,
                   n, temperature, {"name": what, "version": VLLM, **settings}, PROMPT)


PENALTIES = {"repetition_penalty": 1.5, "frequency_penalty": 1.0, "presence_penalty": 0.5}
FILTERED = {"top_k": 20, "top_p": 0.95, "repetition_penalty": 1.3, "bad_words": [[20, 20], [49]]}
MASKED = {"allowed_token_ids": [7, 17, 18, 20, 24, 31, 42, 49], "min_tokens": 1, "stop_token_ids": [20],
          "presence_penalty": 0.5}  # the first token may not be 20 (0.96 without), the second may (0.50)
RUNS = [_run(4000, PENALTIES), _run(3000, FILTERED, 0.8), _run(1000, PENALTIES, gamma=3, method="block"),
        _run(3000, MASKED)]
CONTROLS = [_run(1000, PENALTIES, control="plain"), _run(1000, PENALTIES, control="output"),
            _run(1000, FILTERED, 0.8, control="output")]


def main(argv=None) -> int:
    return runs_main(__doc__, "audit_vllm_params", RUNS, CONTROLS, argv)


if __name__ == "__main__":
    sys.exit(main())
