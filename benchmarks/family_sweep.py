"""Every causal-LM type transformers builds, tiny and random, through ``CausalLM``: does its cache score a draft tree
(and chains, for a model with recurrent layers: ``models.recurrent``) as uncached forwards do, and does the wrapper
take it or refuse it?

For each ``model_type`` of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: a model built from the config's
defaults made tiny (the sizes below, where the config or a config nested in it has them: a multimodal wrapper's text,
vision and audio configs too; and a few types' own: ``TYPE_SIZES``; eager attention, float32, seeded; where that does
not build or run an uncached forward, again with as many key-value heads as query heads (latent attention as in Kimi
Linear, DeepSeek-V3.2 and GLM-5 takes no grouped heads), with 8 layers (a hybrid whose pattern puts its first
attention layer past two, which transformers' own forward refuses), and with both: the row's ``options``), or "not
built" where none does (a tiny size it rejects, a library it needs). Then

* ``unprobed``: the model behind ``CausalLM(..., probe=False)``, two left-padded rows, 4 draft trees of 6 nodes
  (contexts past the window of 6 where the config has one; dead slots packed on the way) and a token after them,
  each node's logits against an uncached forward of its path (a recurrent model first: 4 calls of 4 tokens and 3 of
  one, with rollbacks of different counts per row, each token's logits against an uncached forward of its history):
  "exact" (max |difference| below 1e-3 of the logits' scale, ``1 + max |logit|``, as the probe measures: a random
  model's logits can reach the hundreds, where float32's rounding between the wrapper's kernels and the reference's
  passes 1e-3), "different"
  (the worst difference) or "fails" (the error);
* ``wrapper``: what ``CausalLM(model)`` does with its defaults, the probe included (``models.probe``): "taken" or
  "refused" (the message);
* ``static`` (a type taken): its static form (``CausalLM.static_form``, the cache of the captured steps that a GPU
  run takes by default) scoring a chain, a tree, the tree's kept path and a token after against uncached forwards
  (a model with recurrent layers, whose static form scores chains: ``models.probe.static_chain_calls``):
  "exact", "different", "fails" as above, or "refused" (``static_refusal``: the growing cache runs it);
* ``captured`` (a static form that is exact): a captured tree step (a chain of 3, greedy, for a model with
  recurrent layers; the model as its own draft) traced as
  ``torch.compile(fullgraph=True)`` traces it: "one graph" (what a CUDA graph captures on a GPU, no host read
  inside), "breaks" or "fails".

Then the same columns under ``sdpa`` (the kernel ``from_pretrained`` picks by default), in the row's ``sdpa``, where
the type has it. A type whose unprobed status is not "exact" must be refused, a taken type's static form exact or
refused, and its captured step one graph unless ``models.static_lm``'s tables refuse the captured modes for its family,
on either kernel: ``tests/test_probe.py`` checks the record for that. Each type runs in a process of its own
(8 GB at most, 1,200 s for both kernels; Kimi Linear's 8 layers of reference kernels take 4 minutes a kernel), two at
a time, with the cores shared between them (one thread each on two cores):

    PYTHONPATH=. .venv/bin/python benchmarks/family_sweep.py --out benchmarks/records/family_sweep.json
    PYTHONPATH=. .venv/bin/python benchmarks/family_sweep.py --types inkling_text --update   # one type again, in place
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from tqdm import tqdm

SIZES = dict(hidden_size=32, n_embd=32, d_model=32, n_embed=32, num_hidden_layers=2, n_layer=2, num_layers=2,
             n_layers=2, num_attention_heads=4, n_head=4, n_heads=4, num_heads=4, attention_heads=4,
             num_key_value_heads=2, head_dim=8, intermediate_size=64, ffn_dim=64, n_inner=64, vocab_size=128,
             max_position_embeddings=256, n_positions=256, moe_intermediate_size=16, shared_expert_intermediate_size=16,
             num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, initializer_range=0.5,
             sliding_window=6, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             decoder_start_token_id=1, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, kv_lora_rank=16,
             q_lora_rank=16, rotary_dim=4, n_group=1, topk_group=1, n_input_layers=1, n_output_layers=1,
             decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64, encoder_layers=2,
             encoder_attention_heads=4, encoder_ffn_dim=64)
# Types whose defaults leave a size unset, nested or inconsistent with the sizes above: their own settings
MAMBA = dict(mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2)
MROPE = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1])  # sums to head_dim / 2
TYPE_SIZES = {
    # hybrids whose default pattern (none, or one of 32-54 layers) has no attention layer among 2: a Mamba layer, then
    # attention, as their checkpoints interleave them
    "bamba": dict(**MAMBA, attn_layer_indices=[1]),
    "granitemoehybrid": dict(**MAMBA, layer_types=["linear_attention", "full_attention"]),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"], hybrid_layer_ids=[1], attention_hidden_size=64,
                   attention_head_dim=16, mamba_headdim=8, mamba_d_state=8, adapter_rank=8, kv_channels=8,
                   chunk_size=8),
    "qwen4_exp_text": dict(layer_types=["linear_attention", "indexed_attention"], indexer_n_heads=2,
                           indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4, indexer_compress_ratio=1,
                           linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                           linear_num_value_heads=4),
    # rotary settings per layer type, which its defaults leave empty (North's checkpoints window 3 layers in 4)
    "cohere_compass_text": dict(layer_types=["sliding_attention", "full_attention"],
                                rope_parameters={"sliding_attention": MROPE, "full_attention": MROPE}),
    "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2)),
    "dots1": dict(n_shared_experts=1),
    "gemma3n_text": dict(num_hidden_layers=4, num_kv_shared_layers=2, laurel_rank=8, hidden_size_per_layer_input=8,
                         vocab_size_per_layer_input=128, activation_sparsity_pattern=[0.0] * 4),  # 15 of 2 layers shared
    "gemma4": dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=128),  # per-layer inputs, 262k rows
    "gemma4_text": dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=128),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    # Inkling 2: its output's width (unpadded_vocab_size, 200,058 by default) past the tiny embedding's rows would let a
    # decoded token index past the embedding
    "inkling2_text": dict(unpadded_vocab_size=128),
    "inkling2_loop_text": dict(unpadded_vocab_size=128),
    "mamba2": dict(num_heads=8, head_dim=8, state_size=8, n_groups=1, expand=2, conv_kernel=4),
    "reformer": dict(axial_pos_embds_dim=[16, 16], axial_pos_shape=[16, 16], attention_head_size=8,
                     feed_forward_size=64),
}
MEMORY = 8 * 2**30
SECONDS = 1200


UNGROUPED = dict(num_key_value_heads=4)  # no grouped-query heads (latent attention takes none)
DEEPER = dict(num_hidden_layers=8, num_layers=8)  # a hybrid whose pattern puts its first attention layer past two
TRIES = ({}, UNGROUPED, DEEPER, {**UNGROUPED, **DEEPER})


def _has(config, key: str) -> bool:
    """``hasattr`` that a per-layer attribute's refusal (Gemma 4's ``head_dim``) answers "no" to."""
    try:
        return hasattr(config, key)
    except Exception:  # noqa: BLE001 -- AmbiguousGlobalPerLayerAttributeError and kin
        return False


def _sized(config_class, defaults, sizes: dict, **extra):
    """``config_class`` built with the ``sizes`` its ``defaults`` have, or ``defaults`` with those it lets be set."""
    sizes = {key: value for key, value in sizes.items() if _has(defaults, key)}
    try:
        return config_class(**sizes, **extra)
    except Exception:  # noqa: BLE001 -- a config that takes its sizes otherwise: set what it allows
        for key, value in sizes.items():
            try:
                setattr(defaults, key, value)
            except Exception:  # noqa: BLE001
                pass
        return defaults


def tiny_config(kind: str, options: dict | None = None):
    """``kind``'s config made tiny: the sizes on it and on each config nested in it (a multimodal wrapper's text,
    vision and audio configs, whose defaults are full-sized: Gemma 3's 262k-token vocabulary), a nested config's
    type's own ``TYPE_SIZES`` under the wrapper's."""
    from transformers import AutoConfig

    sizes = {**SIZES, **TYPE_SIZES.get(kind, {}), **(options or {})}
    defaults = AutoConfig.for_model(kind)
    config = _sized(partial(AutoConfig.for_model, kind), defaults, sizes, is_decoder=True)
    for name, nested in list(vars(config).items()):
        if name.endswith("_config") and name not in sizes and hasattr(nested, "to_dict"):  # not set above
            own = TYPE_SIZES.get(getattr(nested, "model_type", None), {})  # a text config's pattern (Qwen4-exp)
            setattr(config, name, _sized(type(nested), nested, {**own, **sizes}))
    return config


def tiny_model(kind: str, options: dict | None = None, kernel: str = "eager"):
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(kind, options)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, attn_implementation=kernel, dtype=torch.float32).eval()


def _uncached(model, ids):
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def _gap(cached, want) -> float:
    from specresearch.models.probe import logit_gap  # the probe's own measure

    return logit_gap(cached, want)


def unprobed(kind: str, options: dict | None = None, kernel: str = "eager") -> tuple[str, str]:
    """The cached-tree comparison of the module docstring, on the wrapper with ``probe=False``."""
    import torch

    from specresearch.models.causal_lm import CausalLM
    from specresearch.models.probe import error_line, tree_path, tree_visibility

    model, reference = tiny_model(kind, options, kernel), tiny_model(kind, options, kernel)
    try:
        lm = CausalLM(model, device="cpu", probe=False)
    except ValueError as error:
        return "refused", " ".join(str(error).split())[:300]
    if lm.recurrent:  # its trees are scored path by path (models.recurrent): chains first, then the trees below
        status, detail = _chains(lm, reference)
        if status != "exact":
            return status, detail
    parents = [-1, 0, 1, 0, 3, 2]
    visible = tree_visibility(parents)[0]
    try:
        lm.prefill(torch.tensor([[5, 9, 2, 33], [0, 0, 4, 8]]), torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]))
        histories, pending, worst = [[5, 9, 2, 33], [4, 8]], [7, 11], 0.0
        for step in range(4):
            rows = [[pending[b], 10 + step, 20, 30 - step, 40, 12] for b in range(2)]
            lm.begin_tree()
            logits = lm.score_tree(torch.tensor(rows), torch.tensor([[0, 1, 2, 1, 2, 3]] * 2), visible.expand(2, -1, -1))
            for b in range(2):
                for i in range(6):
                    want = _uncached(reference, histories[b] + tree_path(rows[b], i, parents))
                    worst = max(worst, _gap(logits[b, i, :want.shape[-1]], want))
            lm.end_tree(torch.tensor([[True, True, True, False, False, True], [True, False, False, True, True, False]]))
            histories[0] += [pending[0], 10 + step, 20, 12]
            histories[1] += [pending[1], 30 - step, 40]
            pending = [7, 9]
        out = lm.score(torch.tensor([[pending[0]], [pending[1]]]))
        for b in range(2):
            worst = max(worst, _gap(out[b, -1], _uncached(reference, histories[b] + [pending[b]])))
    except Exception as error:  # noqa: BLE001 -- a family's failure is what the record reports
        return "fails", error_line(error)
    return ("exact", f"{worst:.2e}") if worst < 1e-3 else ("different", f"{worst:.3g}")


def static(kind: str, options: dict | None = None, kernel: str = "eager") -> tuple[str, str]:
    """The wrapper's static form (``CausalLM.static_form``: the captured steps' cache, on a GPU the default) against
    uncached forwards: two left-padded rows of 9 and 4 tokens (past a window of 6), a chain of two whose second token
    is dropped, a tree of five nodes in two branches, its path kept to 3 and 2 nodes, a token after."""
    from specresearch.models.causal_lm import CausalLM
    from specresearch.models.probe import error_line, static_chain_calls, static_form_calls

    model, reference = tiny_model(kind, options, kernel), tiny_model(kind, options, kernel)
    lm = CausalLM(model, device="cpu", probe=False)
    if lm.static_refusal:
        return "refused", lm.static_refusal
    worst = 0.0
    calls = static_chain_calls if lm.recurrent else static_form_calls  # recurrent layers: chains only
    try:
        for logits, sequence in calls(lm.static_form()):
            want = _uncached(reference, sequence)
            worst = max(worst, _gap(logits[: want.shape[-1]], want))
    except Exception as error:  # noqa: BLE001 -- a family's failure is what the record reports
        return "fails", error_line(error)
    return ("exact", f"{worst:.2e}") if worst < 1e-3 else ("different", f"{worst:.3g}")


def captured(kind: str, options: dict | None = None, kernel: str = "eager") -> tuple[str, str]:
    """A captured step of a taken type whose static form scores exactly: a static tree (K = 2, gamma 4, 6 nodes,
    T = 0) with the model as its own draft, traced as ``torch.compile(fullgraph=True)`` traces it
    (``torch._dynamo.explain``): "one graph" (what a CUDA graph captures, no host read inside), "breaks" (the count
    and the first reasons) or "fails" (the error)."""
    import torch

    from specresearch.config import SamplingConfig
    from specresearch.engine.prompts import encode_prompts
    from specresearch.engine.static import StaticPlan, start_run
    from specresearch.models.causal_lm import CausalLM
    from specresearch.models.probe import error_line

    lm = CausalLM(tiny_model(kind, options, kernel), device="cpu", probe=False)
    try:
        run = start_run(lm, lm, *encode_prompts([[5, 9, 3, 7, 2], [12, 13, 14]]), max_new_tokens=10, eos={2},
                        plan=StaticPlan("chain", "greedy", 3) if lm.recurrent else StaticPlan("tree", "onehot", 4, 2, 6,
                                                                                           law="static"),
                        sampling=SamplingConfig(temperature=0.0))
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):  # as compile(dynamic=False) traces it
            explained = torch._dynamo.explain(run.step)()
    except Exception as error:  # noqa: BLE001 -- a family's failure is what the record reports
        return "fails", error_line(error)
    finally:
        torch._dynamo.reset()
    if (explained.graph_count, explained.graph_break_count) == (1, 0):
        return "one graph", ""
    reasons = "; ".join(str(reason.reason)[:120] for reason in explained.break_reasons[:3])
    return "breaks", f"{explained.graph_count} graphs, {explained.graph_break_count} breaks: {reasons}"


def _chains(lm, reference) -> tuple[str, str]:
    """A model with recurrent layers (which runs chains only): the two rows score 4 calls of 4 tokens, each followed by
    rollbacks of different counts per row, then three one-token calls rolled back across them, and a token after."""
    import torch

    from specresearch.models.probe import error_line

    try:
        lm.prefill(torch.tensor([[5, 9, 2, 33], [0, 0, 4, 8]]), torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]))
        histories, worst = [[5, 9, 2, 33], [4, 8]], 0.0
        for step, counts in enumerate(((1, 3), (4, 2), (0, 1), (2, 0))):
            tokens = [10 + step, 20, 30 - step, 40]
            logits = lm.score(torch.tensor([tokens, tokens]))
            for b in range(2):
                for i in range(4):
                    want = _uncached(reference, histories[b] + tokens[: i + 1])
                    worst = max(worst, _gap(logits[b, i, :want.shape[-1]], want))
            lm.rollback(list(counts))
            histories = [h + tokens[: 4 - n] for h, n in zip(histories, counts)]
        for i, token in enumerate((7, 11, 13)):
            out = lm.score(torch.tensor([[token], [token]]))
            for b in range(2):
                want = _uncached(reference, histories[b] + [7, 11, 13][: i + 1])
                worst = max(worst, _gap(out[b, -1, :want.shape[-1]], want))
        lm.rollback([3, 1])
        histories = [histories[0], histories[1] + [7, 11]]
        out = lm.score(torch.tensor([[12], [12]]))
        for b in range(2):
            worst = max(worst, _gap(out[b, -1], _uncached(reference, histories[b] + [12])))
    except Exception as error:  # noqa: BLE001 -- a family's failure is what the record reports
        return "fails", error_line(error)
    return ("exact", f"{worst:.2e}") if worst < 1e-3 else ("different", f"{worst:.3g}")


def one(kind: str) -> dict:
    """One type's row of the record: eager attention, and under ``sdpa`` the same columns again where the model
    has that kernel."""
    from specresearch.models.probe import error_line

    warnings.simplefilter("ignore")
    row, first = dict(model_type=kind), None
    for options in TRIES:
        try:
            _uncached(tiny_model(kind, options), [5, 9, 2, 33])
            break
        except Exception as error:  # noqa: BLE001 -- a tiny config it rejects, or a library it needs
            first = first or error_line(error, 200)
    else:
        return {**row, "built": False, "detail": first}
    if options:
        row["options"] = options
    row.update(built=True, **_columns(kind, options, "eager"))
    try:
        _uncached(tiny_model(kind, options, "sdpa"), [5, 9, 2, 33])
    except Exception as error:  # noqa: BLE001 -- no sdpa kernel for this class
        row["sdpa"] = dict(built=False, detail=error_line(error, 200))
    else:
        row["sdpa"] = dict(built=True, **_columns(kind, options, "sdpa"))
    return row


def _columns(kind: str, options: dict | None, kernel: str) -> dict:
    """``unprobed``, ``wrapper`` and, for a type taken, ``static`` and ``captured`` (module docstring) on ``kernel``."""
    from specresearch.models.causal_lm import CausalLM

    columns = dict(zip(("unprobed", "unprobed_detail"), unprobed(kind, options, kernel)))
    try:
        CausalLM(tiny_model(kind, options, kernel), device="cpu")
    except ValueError as error:
        return {**columns, "wrapper": "refused", "wrapper_detail": " ".join(str(error).split())[:400]}
    columns.update(wrapper="taken", wrapper_detail="", **dict(zip(("static", "static_detail"),
                                                                   static(kind, options, kernel))))
    if columns["static"] == "exact":
        columns.update(zip(("captured", "captured_detail"), captured(kind, options, kernel)))
    return columns


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def _run(kind: str, threads: int, seconds: int = SECONDS) -> dict:
    command = [sys.executable, __file__, "--one", kind]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=seconds, preexec_fn=_limits,
                              env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if lines:
            return json.loads(lines[-1])
        reason = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
    except subprocess.TimeoutExpired:
        reason = f"over {seconds} s"
    return dict(model_type=kind, built=False, detail=f"its process ended without a row ({reason})")


def _summary(columns: list[dict]) -> dict:
    """Counts of one kernel's columns: built, each status, taken, and the two that must be zero."""
    built = [column for column in columns if column.get("built")]
    counts = {"built": len(built), **{f"unprobed {status}": sum(column["unprobed"] == status for column in built)
                                      for status in ("exact", "different", "fails", "refused")},
              "taken": sum(column["wrapper"] == "taken" for column in built),
              **{f"static {status}": sum(column.get("static") == status for column in built)
                 for status in ("exact", "different", "fails", "refused")},
              **{f"captured {status}": sum(column.get("captured") == status for column in built)
                 for status in ("one graph", "breaks", "fails")}}
    counts["taken but not exact"] = sum(column["wrapper"] == "taken" and column["unprobed"] != "exact"
                                        for column in built)
    counts["static taken but not exact"] = counts["static different"] + counts["static fails"]
    return counts


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="the record (default benchmarks/records/family_sweep.json)")
    parser.add_argument("--jobs", type=int, default=2, help="types run at once (default 2)")
    parser.add_argument("--types", nargs="*", help="these model types only (default: every one)")
    parser.add_argument("--update", action="store_true",
                        help="with --types: rerun those types in the record and keep its other rows, each row naming "
                             "the commit it was made at")
    parser.add_argument("--seconds", type=int, default=SECONDS,
                        help=f"each type's process may run this long (default {SECONDS}; Kimi Linear's reference kernels "
                             "take longer)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one)), flush=True)
        return 0
    out = Path(args.out or Path(__file__).resolve().parent / "records" / "family_sweep.json")
    if args.update and (not args.types or not out.exists()):  # before hours of types, not after
        parser.error(f"--update reruns the --types given in an existing record ({out}): name the types")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from specresearch.experiments.records import record_header, write_json_record

    kinds = args.types or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    with ThreadPoolExecutor(args.jobs) as pool:
        threads = max(1, (os.cpu_count() or 1) // args.jobs)  # two processes of two threads on two cores thrash
        rows = list(tqdm(pool.map(partial(_run, threads=threads, seconds=args.seconds), kinds), total=len(kinds),
                         desc="model types"))
    if args.update:
        from specresearch.experiments.records import git_commit

        old = json.loads(out.read_text())
        commit = git_commit()
        fresh = {row["model_type"]: {**row, "commit": commit} for row in rows}
        rows = [fresh.pop(row["model_type"], None) or {"commit": old["commit"], **row} for row in old["rows"]]
        rows = sorted(rows + list(fresh.values()), key=lambda row: row["model_type"])
    summary = {"types": len(rows), **_summary(rows), "sdpa": _summary([row.get("sdpa", {}) for row in rows])}
    import transformers

    write_json_record(out, {**record_header("benchmarks/family_sweep.py", argv, target=None,
                                            transformers=transformers.__version__),
                            "sizes": SIZES, "summary": summary, "rows": rows})
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
