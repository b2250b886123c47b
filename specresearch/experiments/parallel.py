"""Targets split over devices with transformers' own mechanisms: is the engine's greedy output still ``generate``'s?

Two splits, each the way transformers loads a model too large for one device:

* ``"device_map"``: ``from_pretrained(..., device_map=...)`` places the first half of the decoder layers (and the
  input embeddings) on the first device and the rest on the second; accelerate's hooks move each layer's inputs to
  its device, and ``CausalLM`` keeps each layer's KV cache where the layer writes it (rollback, row selection and
  cache packing index every layer on its own device). On a machine without a second accelerator the second "device"
  is ``"disk"``: the layers' weights live in an offload folder and are loaded for every forward (accelerate's
  ``AlignDevicesHook``), all computing on the CPU. That exercises the hooks and the offloaded cache, not transfers
  between two devices; ``split_map(model, ("cuda:0", "cuda:1"))`` is the same map over two GPUs.
* ``"tensor_parallel"``: ``from_pretrained(..., tp_plan="auto")`` under ``torchrun``: every process holds a shard of
  each layer's heads and MLP columns (transformers' plan for the family, DTensor), layers all-reduce their outputs and
  the LM head gathers the logits, so every process sees the same logits. The engine runs the same loop in every
  process with the same seed (SPMD): the same verifier decisions, the same rollbacks of each process's shard of the
  cache. On the CPU the processes talk over ``gloo`` (``torchrun --nproc-per-node 2 -m
  specresearch.experiments.parallel``; ``tests/test_parallel.py`` runs it).

A case: a family's tiny random-weight model (``models.families``), saved and loaded back split, wrapped in
``CausalLM`` (which leaves a split model's layers and attention kernel as transformers placed them), a draft of one
kind (``DRAFTS``: a whole perturbed copy, a feature head and Medusa heads reading the split target's hidden states,
prompt lookup),
one step kind of ``experiments.families.STEPS``, greedy, three left-padded prompts with a row that ends at an EOS;
the reference is ``generate(do_sample=False)`` of the unsplit model. Statuses as in ``experiments.families``.

Where the verifier runs: where the logits land, which is the target's input device (``CausalLM.device``): accelerate's
hook on the whole model returns its outputs on its inputs' device, and the tensor-parallel LM head gathers them on
each process's device (docs/parallel.md gives the copy's cost).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from specresearch.config import SamplingConfig
from specresearch.engine.generate import speculative_generate
from specresearch.experiments.families import NEW_TOKENS, PROMPTS, STEPS, CaseResult, reference_tokens
from specresearch.models.causal_lm import CausalLM
from specresearch.models.families import FAMILIES, perturbed_copy, tiny_family_model

__all__ = ["SPLITS", "DRAFTS", "split_map", "load_split", "run_split_case", "split_cases", "tensor_parallel_rank"]

SPLITS = ("device_map", "tensor_parallel")
DRAFTS = ("model", "feature head", "medusa", "n-gram")
KERNELS = ("eager", "sdpa")


def _layer_list(model) -> str:
    """The dotted name of the model's decoder-layer ``ModuleList`` (the one as long as the config's layer count)."""
    count = model.config.get_text_config().num_hidden_layers
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count and name:
            return name
    raise ValueError(f"{type(model).__name__} has no ModuleList of its {count} decoder layers to split")


def split_map(model, devices=("cpu", "disk")) -> dict[str, str]:
    """A ``device_map`` for ``from_pretrained``: the input embeddings and the first half of the decoder layers on
    ``devices[0]``, the other layers and every other module (final norm, LM head) on ``devices[1]``; an LM head tied
    to the embeddings stays with them."""
    layers = _layer_list(model)
    count = len(model.get_submodule(layers))
    embeddings = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight  # one tensor: one device
    placed = {f"{layers}.{i}": devices[0] if i < max(1, count // 2) else devices[1] for i in range(count)}

    def place(prefix: str, module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if path == layers:
                continue
            if layers.startswith(path + ".") or embeddings.startswith(path + "."):
                place(path + ".", child)
            elif path == embeddings or (tied and child is head):
                placed[path] = devices[0]
            elif any(True for _ in child.parameters()) or any(True for _ in child.buffers()):
                placed[path] = devices[1]

    place("", model)
    return placed


_SPLIT_MODELS: dict = {}  # (directory, split, kernel, devices) -> the loaded model, reused by that folder's cases


def load_split(directory: str | os.PathLike, split: str, kernel: str, devices=("cpu", "disk"), *, reuse=False):
    """The saved model in ``directory`` loaded back split (module docstring); ``tensor_parallel`` needs the
    process group ``torchrun`` sets up (transformers initialises it from the environment). ``reuse``: the model
    loaded by an earlier call with the same arguments (every tensor-parallel load builds a device mesh whose gloo
    threads stay alive until the process ends: thousands over a matrix)."""
    key = (str(directory), split, kernel, tuple(devices))
    if reuse and key in _SPLIT_MODELS:
        return _SPLIT_MODELS[key]
    _SPLIT_MODELS[key] = model = _load_split(directory, split, kernel, devices)
    return model


def _load_split(directory, split: str, kernel: str, devices):
    from transformers import AutoModelForCausalLM

    if split == "tensor_parallel":
        return AutoModelForCausalLM.from_pretrained(directory, tp_plan="auto", dtype=torch.float32,
                                                    attn_implementation=kernel)
    if split != "device_map":
        raise ValueError(f"unknown split {split!r}: one of {', '.join(SPLITS)}")
    whole = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation=kernel)
    return AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation=kernel, device_map=split_map(whole, devices),
        offload_folder=str(Path(directory) / "offload"))


def _save(family: str, kernel: str, directory) -> None:
    """The family's tiny model saved in ``directory`` (nothing where transformers does not build it)."""
    try:
        tiny_family_model(family, kernel).save_pretrained(directory)
    except (ValueError, ImportError):  # not offered: run_split_case says so
        pass


def _draft(kind: str, model, device):
    """A draft of ``kind`` (``DRAFTS``) for the unsplit ``model``: None where the family has no such draft."""
    if kind == "model":
        return CausalLM(perturbed_copy(model), device=device)
    if kind == "n-gram":
        from specresearch.drafts.ngram import NGramDraft

        return NGramDraft(model.config.get_text_config().vocab_size, device=device)
    if kind == "medusa":  # three heads on the last hidden state, each the target's own head (drafts get accepted)
        from specresearch.drafts.medusa import MedusaDraft, MedusaHeads

        text, head = model.config.get_text_config(), model.get_output_embeddings()
        heads = MedusaHeads(text.hidden_size, head.weight.shape[0], 3, 1)
        with torch.no_grad():
            for block, out in zip(heads.blocks, heads.outputs):
                block.weight.zero_(), block.bias.zero_()
                out.weight.copy_(head.weight)
        return MedusaDraft(heads, text.num_hidden_layers, device=device)
    if kind == "feature head":
        from specresearch.drafts.feature import FeatureHead, FeatureHeadConfig
        from specresearch.drafts.feature_draft import FeatureDraft

        try:
            head = FeatureHead(model, FeatureHeadConfig("split", feature_layers=(1, -1), init_layer=None), seed=1)
        except (AttributeError, KeyError, TypeError, ValueError):  # no rotary config, no rms_norm_eps: no such head
            return None
        return FeatureDraft(head, device=device, skinny_linear=False)
    raise ValueError(f"unknown draft kind {kind!r}: one of {', '.join(DRAFTS)}")


def run_split_case(family: str, kernel: str, step: str, draft: str, split: str, directory: str | os.PathLike,
                   devices=("cpu", "disk")) -> CaseResult:
    """One case (module docstring): the family's tiny model saved in ``directory``, loaded split, against
    ``generate`` of the unsplit model. ``CaseResult.kernel`` carries ``"<kernel> / <draft>"``."""
    try:
        model = tiny_family_model(family, kernel)
    except (ValueError, ImportError) as error:
        return CaseResult(family, f"{kernel} / {draft}", step, "not offered", detail=str(error).split(". ")[0])
    if not (Path(directory) / "config.json").exists():
        _save(family, kernel, directory)
    reference = reference_tokens(model)
    eos = reference[1][4]  # experiments.families._eos: the middle row ends early
    expected = [row[: row.index(eos) + 1] if eos in row else row for row in reference]
    drafter = _draft(draft, model, "cpu")
    if drafter is None:
        return CaseResult(family, f"{kernel} / {draft}", step, "not offered", detail=f"no {draft} for {family}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # accelerate: "some parameters are on the meta device (offloaded)"
            try:
                split_model = load_split(directory, split, kernel, devices, reuse=True)
            except ValueError as error:  # transformers has no tensor-parallel plan for this family
                if "tp_plan" not in str(error):
                    raise
                return CaseResult(family, f"{kernel} / {draft}", step, "not offered", detail=str(error).split(". ")[0])
            target = CausalLM(split_model, device="cpu")
        if target.placement != split:
            raise AssertionError(f"the target was not split: placement {target.placement!r}")
        result = speculative_generate(target, drafter, PROMPTS, max_new_tokens=NEW_TOKENS, eos_token_id=eos,
                                      sampling=SamplingConfig(temperature=0.0), **STEPS[step])
    except Exception as error:  # noqa: BLE001 -- a traceback is a finding the matrix reports
        return CaseResult(family, f"{kernel} / {draft}", step, "ERROR", kernel, f"{type(error).__name__}: {error}")
    got = [list(row) for row in result.tokens]
    if got != expected:
        return CaseResult(family, f"{kernel} / {draft}", step, "DIFFERENT", kernel, f"engine {got} != {expected}",
                          result.block_efficiency)
    return CaseResult(family, f"{kernel} / {draft}", step, "exact", kernel, _where(target), result.block_efficiency)


def _where(target: CausalLM) -> str:
    """Where the split put the weights: the device map's places, or this process's shard of the first layer."""
    if target.placement == "device_map":
        return "devices " + ", ".join(sorted(set(map(str, target.model.hf_device_map.values()))))
    sharded = [(n, p) for n, p in target.model.named_parameters() if hasattr(p, "to_local")]  # DTensor shards
    if not sharded:
        return f"tp {target.model.tp_size}: no DTensor parameter"
    name, weight = sharded[0]
    return f"tp {target.model.tp_size}: {name} {tuple(weight.to_local().shape)} of {tuple(weight.shape)}"


# the growing loop's step kinds: a captured step's static cache needs the model on one device (engine.static)
SPLIT_STEPS = tuple(name for name, options in STEPS.items() if "compile" not in options)


def split_cases(families=("llama", "qwen2", "mistral", "gemma2", "phi3"), kernels=KERNELS, steps=SPLIT_STEPS,
                drafts=DRAFTS) -> list[tuple[str, str, str, str]]:
    """(family, kernel, step, draft): every step with the whole-model draft, every draft with a chain and a tree."""
    cases = [(f, k, s, "model") for f in families for k in kernels for s in steps]
    cases += [(f, k, s, d) for f in families for k in kernels for s in ("chain", "sampled tree", "dynamic tree")
              for d in drafts if d != "model" and s in steps]
    return cases


def tensor_parallel_rank(cases, out: str | None) -> list[dict]:
    """Run ``cases`` in this ``torchrun`` process (every rank runs them all, in the same order); rank 0 writes the
    rows (``CaseResult`` fields) as JSON to ``out``."""
    import dataclasses

    import torch.distributed as dist

    folders = {}
    for family, kernel, _, _ in cases:  # saved before the first split load: save_pretrained is collective after it
        if (family, kernel) not in folders:
            folders[family, kernel] = tempfile.mkdtemp(prefix=f"tp-{family}-")
            _save(family, kernel, folders[family, kernel])
    rows = [dataclasses.asdict(run_split_case(family, kernel, step, draft, "tensor_parallel", folders[family, kernel]))
            for family, kernel, step, draft in cases]
    if dist.is_initialized():
        rows = [dict(row, ranks_agree=True) for row in rows]
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, [(r["status"], r["detail"]) for r in rows])
        for i, row in enumerate(rows):
            row["ranks_agree"] = len({tuple(g[i][:1]) for g in gathered}) == 1
    if out and int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps(rows, indent=1) + "\n")
    if dist.is_initialized():  # (left alive, gloo aborts the process at exit)
        dist.barrier()
        dist.destroy_process_group()
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="The split-target cases under tensor parallelism: run with "
                                                 "torchrun --nproc-per-node N -m specresearch.experiments.parallel")
    parser.add_argument("--families", nargs="+", default=["llama", "qwen2", "mistral", "gemma2", "phi3"])
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS))
    parser.add_argument("--steps", nargs="+", default=list(SPLIT_STEPS))
    parser.add_argument("--drafts", nargs="+", default=list(DRAFTS))
    parser.add_argument("--out", help="JSON file for rank 0's rows")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.families) - set(FAMILIES)) + sorted(set(args.steps) - set(SPLIT_STEPS))
    if unknown:
        parser.error(f"unknown families / steps: {unknown}")
    rows = tensor_parallel_rank(split_cases(args.families, args.kernels, args.steps, args.drafts), args.out)
    bad = [r for r in rows if r["status"] not in ("exact", "not offered")]
    print(f"rank {os.environ.get('RANK', '0')}: {len(rows) - len(bad)} of {len(rows)} cases exact or not offered",
          flush=True)
    if "RANK" in os.environ:
        # under torchrun the rows are written and the group destroyed: leave without the interpreter's teardown, where
        # gloo's C++ threads can still abort a rank (SIGABRT, "terminate called without an active exception"; seen
        # once in CI). The summary line above, printed first, says the rank finished its cases.
        sys.stderr.flush()
        os._exit(1 if bad else 0)
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
