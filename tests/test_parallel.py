"""Targets split over devices with transformers' own mechanisms (``experiments.parallel``): the engine's greedy output
equals ``generate``'s of the unsplit model, chains and trees, every draft kind.

* ``device_map``: half the layers on the CPU, half offloaded to disk (accelerate's hooks load them for each forward;
  this machine has no second accelerator, so both halves compute on the CPU).
* ``tensor_parallel``: ``tp_plan="auto"`` under ``torchrun`` with two processes over ``gloo``: each holds half of
  every layer's heads (checked: the shard's shape); both processes must agree on every case.
* ``engine.hf.speculative`` takes a split target; ``CausalLM`` refuses what would undo a split.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from specresearch.experiments.families import reference_tokens
from specresearch.experiments.parallel import load_split, run_split_case, split_cases, split_map
from specresearch.models.causal_lm import CausalLM, placement
from specresearch.models.families import perturbed_copy, tiny_family_model

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("llama", "qwen2", "mistral", "gemma2", "phi3", "gpt2")


@pytest.fixture(scope="module")
def folders():
    made = {}

    def folder(family, kernel):
        return made.setdefault((family, kernel), tempfile.mkdtemp(prefix=f"split-{family}-"))

    return folder


@pytest.mark.parametrize("family", FAMILIES)
def test_a_device_map_split_target_gives_generates_tokens(family, folders):
    cases = split_cases(families=(family,))
    results = [run_split_case(*case, "device_map", folders(*case[:2])) for case in cases]
    bad = [r for r in results if r.status not in ("exact", "not offered")]
    assert not bad, bad[:3]
    exact = [r for r in results if r.status == "exact"]
    assert len(exact) >= len(results) // 2, "most cases must run (gemma2 has no sdpa; gpt2 no feature head)"
    assert all(r.detail == "devices cpu, disk" for r in exact)
    assert {r.kernel.split(" / ")[1] for r in exact} >= {"model", "n-gram"}


def test_the_device_map_really_offloads_half_the_layers(tmp_path):
    """The split the cases run: the second half's weights are not in memory (meta) until a forward loads them."""
    model = tiny_family_model("llama", "eager")
    model.save_pretrained(tmp_path)
    mapping = split_map(model)
    assert mapping["model.layers.0"] == "cpu" and mapping["model.layers.1"] == "disk"
    assert mapping["model.embed_tokens"] == "cpu" and mapping["lm_head"] == "disk"
    split = load_split(tmp_path, "device_map", "eager")
    assert placement(split) == "device_map" and placement(model) is None
    assert split.model.layers[1].self_attn.q_proj.weight.device.type == "meta"
    assert split.model.layers[0].self_attn.q_proj.weight.device.type == "cpu"
    gpt2 = split_map(tiny_family_model("gpt2", "eager"))
    assert gpt2["lm_head"] == gpt2["transformer.wte"] == "cpu"  # tied to the embeddings: one tensor, one device


def test_a_split_target_keeps_its_layers_and_dtype(tmp_path):
    model = tiny_family_model("llama", "eager")
    model.save_pretrained(tmp_path)
    split = load_split(tmp_path, "device_map", "eager")
    with pytest.raises(ValueError, match="skinny_linear"):
        CausalLM(split, skinny_linear=True)
    with pytest.raises(ValueError, match="keeps its dtype"):
        CausalLM(split, dtype=torch.bfloat16)
    wrapped = CausalLM(split)  # on the CPU an unsplit model gets the wrapper's linear layers; a split one does not
    assert type(wrapped.model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert wrapped.placement == "device_map" and not wrapped.chooses_kernel_rows


def test_hf_speculative_takes_a_split_target(tmp_path):
    from specresearch.engine.hf import speculative

    model = tiny_family_model("mistral", "eager")
    model.save_pretrained(tmp_path)
    split = load_split(tmp_path, "device_map", "eager")
    draft = perturbed_copy(model)
    prompts = [[5, 9, 3], [7, 2, 11, 4, 8, 6, 12, 13, 14]]
    expected = reference_tokens(model, prompts, 10)
    for prompt, row in zip(prompts, expected):
        ids = torch.tensor([prompt])
        for options in (dict(verifier="block", gamma=3), dict(verifier="traversal", gamma=3, num_drafts=2)):
            out = split.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
                                 eos_token_id=None, pad_token_id=1, custom_generate=speculative(draft, **options))
            assert out[0, len(prompt):].tolist() == row, options


def test_tensor_parallel_over_two_processes_gives_generates_tokens(tmp_path):
    """torchrun, 2 processes, gloo: chains, a sampled and a dynamic tree; a windowed and a soft-capped family; the
    four draft kinds. Every case exact, the ranks agree, and the weights really are sharded (half the rows)."""
    out = tmp_path / "tp.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
               "specresearch.experiments.parallel", "--families", "llama", "mistral", "gemma2", "--kernels", "eager",
               "--steps", "chain", "sampled tree", "dynamic tree", "--out", str(out)]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    # each rank prints its summary line as its last act: which printed says whether a failure came at the end
    assert run.returncode == 0, f"{run.stdout[-500:]}\n{run.stderr[-3000:]}"
    finished = sorted(re.findall(r"rank (\d): (\d+) of (\d+) cases", run.stdout))
    assert finished == [("0", "36", "36"), ("1", "36", "36")]
    rows = json.loads(out.read_text())
    assert len(rows) == 36 and all(row["ranks_agree"] for row in rows)
    assert {row["status"] for row in rows} == {"exact"}, [r for r in rows if r["status"] != "exact"][:2]
    assert all(row["detail"].startswith("tp 2: ") for row in rows)
    shard, whole = rows[0]["detail"].split(": ", 1)[1].split(" of ")
    assert shard.split(" ", 1)[1] != whole  # this process's part is smaller than the parameter


def _script(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_quote_the_split_records():
    """docs/parallel.md's tables are the records' (rerun the scripts with --docs); every recorded case passed."""
    docs = (ROOT / "docs" / "parallel.md").read_text()
    matrix = _script("parallel_matrix")
    rows = json.loads((ROOT / "benchmarks" / "records" / "parallel_matrix.json").read_text())["rows"]
    assert f"{matrix.START}\n{matrix.table(rows)}{matrix.END}" in docs
    assert all(r["status"] in ("exact", "not offered") and r.get("ranks_agree", True) for r in rows)
    assert {r["split"] for r in rows if r["status"] == "exact"} == {"device_map", "tensor_parallel"}
    cost = _script("parallel_cost")
    assert f"{cost.START}\n{cost.table(cost.ASSUMED['allreduce_latency_s'])[1]}{cost.END}" in docs
    ray_scaling = _script("ray_scaling")
    record = json.loads((ROOT / "benchmarks" / "records" / "ray_scaling_amd.json").read_text())
    assert f"{ray_scaling.START}\n{ray_scaling.docs_table(record)}{ray_scaling.END}" in docs
    assert record["lossless"]["identical_counts"] and record["sweep"]["identical_results"]
