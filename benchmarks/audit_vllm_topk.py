"""Audit by execution of vLLM's own top-k / top-p masks: vLLM 0.34's Triton kernels (``v1/sample/ops/
topk_topp_triton.py``, Qrita's pivot-based truncation: the one-program-per-row kernel its GPU sampler runs, and the
split-row top-p pipeline it runs on CUDA for batches of at most 64 rows without an active top-k) against vLLM's own
PyTorch masks (``apply_top_k_top_p_pytorch``, its CPU sampler's: top-k keeps every token tied with the k-th; top-p
keeps a token unless the ascending cumulative probability up to it is <= 1 - p), on the same logits, row by row. The
mask decides the law vLLM samples from (and, under speculative decoding, the target law its rejection sampler keeps):
a row whose kept sets differ is sampled from another law; the record gives the rows that differ and the total
variation distance between the two masked softmaxes.

How it runs: the kernels in Triton's interpreter, as ``benchmarks/audit_vllm.py`` runs vLLM's rejection sampler
(``vllm_kernels``: the wheels unpacked under the cache, ``TRITON_INTERPRET=1``, the interpreter shims listed there),
plus one more shim this kernel needs: the interpreter hands ``tl.range``'s loop variable to the kernel as a Python
int, on which the kernel calls ``.to``; here it is an int32 scalar tensor (:func:`tensor_ranges`, installed in this
script only). vLLM launches the kernel on CPU tensors with 256-wide tiles; :func:`gpu_tiles` gives it CUDA's
(8,192 / 4,096: the first tile is also where its statistics come from), and each batch has 80 rows, more than the 64
below which CUDA leaves p-only rows to the split pipeline, so the monolithic kernel decides every row as on a busy
GPU; the split pipeline runs on the p-only rows as a batch of their own, as on CUDA with at most 64 rows. Each row that
differs records the kernel's softmax shift and float32 sum (:func:`softmax_shift`).

The rows (:data:`FAMILIES`): logits drawn from a normal of scale 0.5 (flat), 2 and 5 (peaked), the scale-2 rows
rounded to bfloat16 (ties, as a bfloat16 model's logits have), 20 % of the logits at -inf (a grammar or min-p mask),
one logit or 2 % of them at -100 (a logit bias's ban: OpenAI's minimum), for vocabularies of 64, 2,048 and 49,152
(SmolLM2's) tokens; each batch mixes the rows' settings as vLLM batches requests: k in {1, 5, 50, off}
and p in {0.5, 0.9, 0.99, off}, every pair.

    PYTHONPATH=. .venv/bin/python benchmarks/audit_vllm_topk.py [--out benchmarks/records/audit_vllm_topk.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from audit_vllm import VLLM, vllm_kernels  # noqa: E402

KS, PS = (1, 5, 50, None), (0.5, 0.9, 0.99, None)
FAMILIES = ("normal 0.5", "normal 2", "normal 5", "bfloat16 normal 2", "normal 2, 20 % at -inf",
            "normal 2, one at -100", "normal 2, 2 % at -100")
VOCABS = (64, 2048, 49152)
REPEAT = 5  # rows per (k, p) setting


def tensor_ranges() -> None:
    """``tl.range`` in Triton's interpreter yielding int32 scalar tensors (the compiled kernel's loop variable)."""
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    if getattr(interpreter._patch_lang_core, "tensor_ranges", False):
        return
    patch = interpreter._patch_lang_core

    def as_int(value) -> int:
        if isinstance(value, tl.tensor):
            return int(np.asarray(value.handle.data).reshape(-1)[0])
        return int(value.value if isinstance(value, tl.constexpr) else value)

    def ranges(arg1, arg2=None, step=None, **_):
        start, end = (0, arg1) if arg2 is None else (arg1, arg2)
        for i in range(as_int(start), as_int(end), 1 if step is None else as_int(step)):
            yield tl.tensor(interpreter.TensorHandle(np.array(i, dtype=np.int32), tl.int32), tl.int32)

    def patched(lang, scope):
        patch(lang, scope)
        scope.set_attr(lang, "range", ranges)

    patched.tensor_ranges = True
    interpreter._patch_lang_core = patched


def gpu_tiles() -> None:
    """vLLM's launch of the kernel as on a CUDA GPU: its dispatch picks 256-wide tiles for CPU tensors (the
    interpreter's), 8,192 / 4,096 on CUDA, where the first tile is also the sample its statistics come from; and on
    CUDA a batch of at most 64 rows leaves its p-only rows to the split pipeline. Only the tile sizes and that flag
    change; the kernel is vLLM's."""
    import vllm.v1.sample.ops.topk_topp_triton as ops

    owner = ops._topk_topp
    if getattr(owner._dispatch_fn, "gpu_tiles", False):
        return
    dispatch = owner._dispatch_fn

    def on_gpu(*args, **kwargs):
        grid, launch = dispatch(*args, **kwargs)
        batch = args[0].shape[0]
        return grid, dict(launch, BLOCK_SIZE=8192, BLOCK_SIZE_TRUNC=4096, num_warps=8,
                          SPLIT_COVERS_PONLY=bool(launch["TOPP_ENABLED"]) and batch <= ops._SPLIT_MAX_BATCH)

    on_gpu.gpu_tiles = True
    owner._dispatch_fn = on_gpu


def rows(family: str, vocab: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` rows of logits of ``family`` (module docstring)."""
    scale = float(family.split(",")[0].split()[-1])
    logits = torch.randn(count, vocab, generator=generator) * scale
    if family.startswith("bfloat16"):
        logits = logits.to(torch.bfloat16).float()
    if "inf" in family:
        masked = torch.rand(count, vocab, generator=generator) < 0.2
        masked[:, 0] = False  # a row keeps a finite logit
        logits[masked] = -float("inf")
    if "one at" in family:  # one token banned by a logit bias of -100 (OpenAI's minimum)
        logits[:, -1] = -100.0
    if "2 % at" in family:  # 2 % of the tokens banned so
        logits[:, torch.randperm(vocab, generator=generator)[: max(1, vocab // 50)]] = -100.0
    return logits


def masked_law(logits: torch.Tensor) -> torch.Tensor:
    return logits.double().softmax(-1)


def softmax_shift(row: torch.Tensor) -> tuple[float, float]:
    """What the kernel's standalone top-p computes first (our reading of its zeroth and first passes): the shift
    ``mean + 10 std`` of the finite logits of the first tile (8,192 on a GPU) in place of the row's maximum, and
    ``sum(exp(logit - shift))`` in float32. A sum of 0 makes every probability 0 / 0: no pivot is found and nothing
    is masked."""
    first = row[:8192]
    finite = first[first > -float("inf")].float()
    mean = finite.mean()
    shift = mean + 10 * (finite.square().mean() - mean * mean).clamp(min=0).sqrt()
    return float(shift), float(torch.exp(row.float() - shift).sum())


def compare(family: str, vocab: int, seed: int) -> dict:
    """One batch: every (k, p) pair of the module docstring on rows of ``family`` over ``vocab`` tokens."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch
    from vllm.v1.sample.ops.topk_topp_triton import _apply_topp_split, apply_top_k_top_p_triton

    pairs = [(k, p) for k in KS for p in PS] * REPEAT  # more than 64 rows: on a GPU the monolithic kernel then takes every row
    logits = rows(family, vocab, len(pairs), torch.Generator().manual_seed(seed))
    k = torch.tensor([vocab if kk is None else kk for kk, _ in pairs], dtype=torch.int32)
    p = torch.tensor([1.0 if pp is None else pp for _, pp in pairs], dtype=torch.float32)
    has_p_only = bool(((k >= vocab) & (p < 1)).any())
    reference = apply_top_k_top_p_pytorch(logits.clone(), k, p)
    kernels = {"monolithic": apply_top_k_top_p_triton(logits.clone(), k, p, has_topp_only_rows=has_p_only)}
    only = (k >= vocab) & (p < 1)  # the split pipeline's rows, run as a batch of their own (vLLM on CUDA)
    split = logits[only].clone()
    _apply_topp_split(split, None, p[only].contiguous(), -float("inf"), 1)
    kernels["split top-p"] = split
    result = {"family": family, "vocab": vocab, "seed": seed, "rows": len(pairs)}
    for name, masked in kernels.items():
        want, source = (reference, logits) if name == "monolithic" else (reference[only], logits[only])
        settings_of = pairs if name == "monolithic" else [pair for pair, o in zip(pairs, only.tolist()) if o]
        kept, kept_want = masked > -float("inf"), want > -float("inf")
        tv = 0.5 * (masked_law(masked) - masked_law(want)).abs().sum(-1)
        differ = (kept != kept_want).any(-1) & (tv > 1e-12)  # tokens of probability 0 either way do not count
        result[name] = {"rows": len(masked), "rows_differing": int(differ.sum()), "max_tv": float(tv.max()),
                        "differing": [{"k": settings_of[i][0], "p": settings_of[i][1], "kept": int(kept[i].sum()),
                                       "kept_by_pytorch": int(kept_want[i].sum()), "tv": float(tv[i]),
                                       "kernel_shift_and_float32_sum": softmax_shift(source[i])}
                                      for i in differ.nonzero().flatten().tolist()]}
    return result


def main(argv=None) -> int:
    from specresearch.experiments.records import record_header, write_json_record

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/records/audit_vllm_topk.json")
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args(argv)
    vllm_kernels()
    tensor_ranges()
    gpu_tiles()
    header = record_header("benchmarks/audit_vllm_topk.py", sys.argv[1:] if argv is None else argv, target=None,
                           library=VLLM, families=list(FAMILIES), vocabularies=list(VOCABS),
                           top_k=list(KS), top_p=list(PS))
    record = {**header, "rows": []}
    for vocab in VOCABS:
        for family in FAMILIES:
            for seed in range(args.seeds):
                row = compare(family, vocab, seed)
                record["rows"].append(row)
                print(f"{vocab:6d} {family:24s} seed {seed}: " + "; ".join(
                    f"{name} {row[name]['rows_differing']} of {row[name]['rows']} rows differ (max TV "
                    f"{row[name]['max_tv']:.2g})" for name in ("monolithic", "split top-p")), flush=True)
                write_json_record(args.out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
