"""The family x kernel x step matrix: is the engine's greedy output transformers' own, for every model family?

One case builds a tiny random-weight model of a family (``models.families``) with an attention kernel, a draft close
to it (the same weights with 10% noise: drafts are often accepted, so rows roll back different counts), and runs
three left-padded prompts (2-9 tokens; the windowed families' window is 6) through the engine at temperature 0 with
every step kind the engine has (``STEPS``: block and token chains, the five sampled-tree rules, EAGLE-2's dynamic and
static trees, and the captured steps over static caches: chains, both top-k trees and sampled paths). The reference is transformers' ``generate(do_sample=False)`` of the same model
on each prompt alone; an EOS token that ends a row early is taken from that reference. ``tests/test_families.py``
asserts every case; ``benchmarks/family_matrix.py`` writes the table of docs/engine_and_models.md from the same cases.
A second matrix (``more_cases``) runs more families on every kernel but ``flex_attention`` and one step kind of each
loop, and the families the wrapper refuses.

A case's status:

* ``exact``: the engine's tokens equal ``generate``'s on the kernel asked for, up to float ties: where a row's
  tokens part, the two tokens' logits in an uncached forward of the row so far lie within :data:`TIE` of the logits'
  scale (float32's rounding between kernels decides such a tie either way: a tiny GLM-4's two best logits 1.4e-6
  apart on sdpa, which one CPU's generate broke one way and another CPU's the other), and the engine's row from there
  on is ``generate``'s from its own choice (``_within_ties``);
* ``switched``: the wrapper switched the kernel (``models.attention.exact_kernel``) and the tokens are ``generate``'s;
* ``refused``: the wrapper refused the model before the first step with one line (the case's ``detail``);
* ``not offered``: transformers itself does not build the family with that kernel;
* ``DIFFERENT`` / ``ERROR``: a wrong answer or a traceback: what the tests fail on.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from specresearch.config import SamplingConfig
from specresearch.engine.generate import speculative_generate
from specresearch.models.attention import use_packed_sdpa
from specresearch.models.causal_lm import CausalLM
from specresearch.models.families import FAMILIES, MORE_FAMILIES, REFUSED_FAMILIES, perturbed_copy, tiny_family_model

__all__ = ["KERNELS", "CUDA_KERNELS", "STEPS", "MORE_KERNELS", "MORE_STEPS", "more_cases", "PROMPTS", "CaseResult", "run_case", "reference_tokens", "family_wrapper"]

PROMPTS = [[5, 9, 3], [7, 2, 11, 4, 8, 6, 12, 13, 14], [20, 21]]
NEW_TOKENS = 12

# kernel name -> (the attn_implementation the model is built with, how CausalLM wraps it, what the row means)
KERNELS: dict[str, tuple[str, str, str]] = {
    "eager": ("eager", "default", "transformers' eager attention"),
    "sdpa": ("sdpa", "default", "built with sdpa; on the CPU the wrapper's cpu_sdpa_attention (grouped heads in the kernel)"),
    "sdpa (as loaded)": ("sdpa", "plain", "transformers' own sdpa function (skinny_linear=False, unfused: the hf adapter's path)"),
    "packed sdpa": ("sdpa", "packed", "the wrapper's packed_sdpa_attention, its default on CUDA, run on the CPU"),
    "flex_attention": ("flex_attention", "default", "torch's flex attention"),
    "flash_attention_2": ("eager", "flash", "a model whose config names flash_attention_2 (set on the CPU, where "
                                            "flash-attn cannot run): what the wrapper does with it"),
}
# kernels only a CUDA machine loads (flash-attn installed): the wrapper switches them, tests/test_families.py checks it
CUDA_KERNELS: dict[str, tuple[str, str, str]] = {
    "flash_attention_2 (loaded)": ("flash_attention_2", "default", "built with flash-attn's kernel on CUDA"),
}
# step name -> speculative_generate options (gamma 3; trees of 3 paths): every verifier and draft law of the engine
STEPS: dict[str, dict] = {
    "chain": dict(verifier="block", gamma=3),
    "token chain": dict(verifier="token", gamma=3),
    "sampled tree": dict(verifier="traversal", num_drafts=3, gamma=3),
    "rrs tree": dict(verifier="rrs", num_drafts=3, gamma=3),
    "rrs w/o replacement": dict(verifier="rrs_without_replacement", num_drafts=3, gamma=3,
                                draft_law="without_replacement"),
    "kseq": dict(verifier="kseq", num_drafts=3, gamma=1),
    "gbv tree": dict(verifier="gbv", num_drafts=3, gamma=3),
    "dynamic tree": dict(verifier="onehot", num_drafts=3, gamma=3, draft_law="dynamic"),
    "static tree": dict(verifier="onehot", num_drafts=3, gamma=3, draft_law="static"),
    # the captured steps over static caches (engine.static), run eagerly: the same models, masks and kernels
    "captured chain": dict(verifier="block", gamma=3, compile="static"),
    "captured token chain": dict(verifier="token", gamma=3, compile="static"),
    "captured dynamic tree": dict(verifier="onehot", num_drafts=3, gamma=3, draft_law="dynamic", compile="static"),
    "captured static tree": dict(verifier="onehot", num_drafts=3, gamma=3, draft_law="static", compile="static"),
    "captured sampled tree": dict(verifier="traversal", num_drafts=3, gamma=3, compile="static"),
}


@dataclass(frozen=True)
class CaseResult:
    family: str
    kernel: str
    step: str
    status: str  # exact / switched / refused / not offered / DIFFERENT / ERROR (module docstring)
    ran: str = ""  # the attention implementation the wrapper ran
    detail: str = ""
    tokens_per_call: float = 0.0  # the engine's block efficiency on the three prompts

    @property
    def ok(self) -> bool:
        return self.status in ("exact", "switched", "refused", "not offered")


def reference_tokens(model, prompts=PROMPTS, max_new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """transformers' ``generate(do_sample=False)`` of each prompt alone, ``max_new_tokens`` tokens, no EOS."""
    rows = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=model.config.pad_token_id)
        rows.append(out[0, len(prompt):].tolist())
    return rows


def family_wrapper(model, how: str, device: str = "cpu", fuse_projections: bool | None = None) -> CausalLM:
    """``model`` behind ``CausalLM`` on ``device`` as the kernel entry ``how`` says (``KERNELS``); ``fuse_projections``
    as ``CausalLM``'s (``None`` with ``how="plain"``: unfused, as ``engine.hf`` wraps a caller's model)."""
    if how == "plain" and fuse_projections is None:
        fuse_projections = False
    if how == "flash":
        model.config._attn_implementation = "flash_attention_2"
        return CausalLM(model, device=device, fuse_projections=fuse_projections)
    wrapped = CausalLM(model, device=device, skinny_linear=False if how in ("plain", "packed") else None,
                       fuse_projections=fuse_projections)
    if how == "packed":
        assert use_packed_sdpa(wrapped.model)
    return wrapped


def _eos(reference: list[list[int]]) -> int:
    """A token that ends the middle row early: its 5th token (each row then ends at its first occurrence)."""
    return reference[1][4]


_REFERENCES: dict[tuple[str, str, str], list[list[int]]] = {}  # generate's tokens per family, kernel and device


def run_case(family: str, kernel: str, step: str, device: str = "cpu",
             fuse_projections: bool | None = None) -> CaseResult:
    """One case of the matrix (module docstring), its models on ``device``; ``fuse_projections`` as ``CausalLM``'s
    (None: fused, but unfused on ``"sdpa (as loaded)"``, the hf adapter's path), for the target and the draft."""
    implementation, how, _ = {**KERNELS, **CUDA_KERNELS}[kernel]
    try:
        model = tiny_family_model(family, implementation).to(device)
    except (ValueError, ImportError) as error:  # transformers: this family (or machine) has no such kernel
        return CaseResult(family, kernel, step, "not offered", detail=str(error).split(". ")[0])
    # flex_attention's compiled kernel takes a minute a shape on the CPU, flash-attn takes no float32, and the wrapper
    # runs another kernel for both anyway: their reference is the same weights under eager attention
    switched = implementation in ("flex_attention", "flash_attention_2")
    key = (family, "eager" if switched else implementation, device)
    if key not in _REFERENCES:  # the same weights (tiny_family_model is seeded) for every step kind of the kernel
        _REFERENCES[key] = reference_tokens((tiny_family_model(family, "eager") if switched else model).to(device))
    reference = [list(row) for row in _REFERENCES[key]]
    eos = _eos(reference)
    draft_model = perturbed_copy(model)
    expected = [row[: row.index(eos) + 1] if eos in row else row for row in reference]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            target = family_wrapper(model, how, device, fuse_projections)
        except ValueError as error:
            return CaseResult(family, kernel, step, "refused", detail=str(error))
        draft = CausalLM(draft_model, device=device, fuse_projections=target.fuses and fuse_projections)
    switched = [str(w.message) for w in caught if "switched to" in str(w.message)]
    try:
        result = speculative_generate(target, draft, PROMPTS, max_new_tokens=NEW_TOKENS, eos_token_id=eos,
                                      sampling=SamplingConfig(temperature=0.0), **STEPS[step])
    except Exception as error:  # noqa: BLE001 -- a traceback is a finding the matrix reports
        return CaseResult(family, kernel, step, "ERROR", target.model.config._attn_implementation,
                          f"{type(error).__name__}: {error}")
    got = [list(row) for row in result.tokens]
    ran = target.model.config._attn_implementation
    if got != expected and not _ties_only(tiny_family_model(family, key[1]).to(device), got, expected, eos):
        return CaseResult(family, kernel, step, "DIFFERENT", ran, f"engine {got} != generate {expected}",
                          result.block_efficiency)
    return CaseResult(family, kernel, step, "switched" if switched else "exact", ran,
                      switched[0] if switched else "", result.block_efficiency)


TIE = 1e-5  # two logits this close (over the logits' scale, 1 + max |logit|) are a tie float32's rounding may break


def _ties_only(model, got: list[list[int]], expected: list[list[int]], eos: int) -> bool:
    """Whether every row of the engine's tokens is ``generate``'s up to float ties (:func:`_within_ties`); ``model``:
    the reference's own, a fresh one (the wrapper has changed the one it wraps)."""
    return all(_within_ties(model, prompt, mine, theirs, eos) for prompt, mine, theirs in zip(PROMPTS, got, expected))


def _within_ties(model, prompt: list[int], got: list[int], expected: list[int], eos: int) -> bool:
    """Whether the engine's row ``got`` is ``generate``'s ``expected`` but where the two part at a float tie (the two
    tokens' logits within :data:`TIE` of the scale in an uncached forward of the row so far), after which ``got`` must
    be ``generate``'s continuation of its own choice, to the end of the row (or its EOS)."""
    while got != expected:
        at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
        if at is None:  # one row is a prefix of the other: not a tie
            return False
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + expected[:at]], device=model.device)).logits[0, -1].float()
        if abs(logits[got[at]] - logits[expected[at]]).item() > TIE * (1.0 + logits.abs().max().item()):
            return False
        branch = prompt + got[:at + 1]
        rest = reference_tokens(model, [branch], NEW_TOKENS - at - 1)[0] if at + 1 < NEW_TOKENS else []
        expected = got[:at + 1] + rest
        expected = expected[: expected.index(eos) + 1] if eos in expected else expected
    return True


def all_cases(families=tuple(FAMILIES), kernels=tuple(KERNELS), steps=tuple(STEPS)) -> list[tuple[str, str, str]]:
    """Every (family, kernel, step) of the matrix."""
    return [(f, k, s) for f in families for k in kernels for s in steps]


# The second matrix: more families on every kernel but flex_attention (whose compiled kernel takes a minute a shape on
# the CPU, and which the wrapper switches to sdpa anyway) and one step kind of each loop
MORE_KERNELS = ("eager", "sdpa", "sdpa (as loaded)", "packed sdpa", "flash_attention_2")
MORE_STEPS = ("chain", "sampled tree", "dynamic tree", "captured chain", "captured sampled tree")


def more_cases() -> list[tuple[str, str, str]]:
    """The cases of ``MORE_FAMILIES`` and ``REFUSED_FAMILIES`` (``models.families``): ``MORE_KERNELS`` x
    ``MORE_STEPS``."""
    return all_cases((*MORE_FAMILIES, *REFUSED_FAMILIES), MORE_KERNELS, MORE_STEPS)


def _cell(rows: list[dict]) -> str:
    """One table cell from a family's and kernel's rows (one per step)."""
    statuses = {row["status"] for row in rows}
    if statuses == {"exact"}:
        return "exact"
    if statuses == {"switched"}:
        return f"switched to {rows[0]['ran'].replace('specresearch_cpu_sdpa', 'sdpa')}, exact"
    if statuses == {"refused"}:
        return "refused"
    if statuses == {"not offered"}:
        return "not in transformers"
    return "; ".join(f"{row['step']}: {row['status']}" for row in rows)


def matrix_table(rows: list[dict]) -> str:
    """The markdown table of a matrix record's ``rows`` (``CaseResult`` fields): a row per family, a column per
    kernel; a cell says what every step kind gave, or each step's where they differ."""
    families = list(dict.fromkeys(row["family"] for row in rows))
    kernels = list(dict.fromkeys(row["kernel"] for row in rows))
    lines = ["| family | " + " | ".join(f"`{k}`" for k in kernels) + " |", "|---" * (len(kernels) + 1) + "|"]
    for family in families:
        what = {**FAMILIES, **MORE_FAMILIES, **REFUSED_FAMILIES}.get(family, ("", ""))[1]
        cells = [_cell([r for r in rows if r["family"] == family and r["kernel"] == k]) for k in kernels]
        lines.append(f"| {family} ({what}) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
