"""The prepared GPU check runs its timing half on a CPU too (``--device cpu --quick``), so a GPU run does not fail on
a typo; its CUDA tests are the ``cuda``-marked ones (tests/test_devices.py)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_bench_runs_on_a_cpu_and_writes_its_record(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_bench.py"), "--out", str(tmp_path), "--device", "cpu",
                    "--quick"], check=True, capture_output=True, timeout=600)
    record = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert set(record["verifiers_ms_B32"]) >= {"token", "block", "traversal K4 L4", "onehot K4 L4"}
    assert len(record["engine"]) == 4 and all(row["host_reads_per_step"] > 0 for row in record["engine"])
    assert all(row["torch_calls_per_step"] > row["host_reads_per_step"] for row in record["engine"])
    assert all(run["torch_calls_per_step"] > 0 for run in record["trees"]["runs"].values())
    trees = record["trees"]
    assert trees["r"][0] == 1.0 and len(trees["r"]) == 4 and set(trees["runs"]) == {"chain g1", "chain g3", "traversal K2 g2",
                                                                                  "dynamic K4 g4 n10"}
    assert trees["runs"]["dynamic K4 g4 n10"]["scored_per_step"] > trees["runs"]["chain g1"]["scored_per_step"] == 2
    attention = record["attention"]  # 4 layers: the packed attention issues 4 torch calls a layer fewer
    assert [row["tokens"] for row in attention] == [2, 8]
    assert all(row["sdpa_torch_calls"] - row["packed_torch_calls"] == 16 and row["packed_ms"] > 0 for row in attention)


def test_gpu_check_script_names_its_parts_and_usage():
    text = (ROOT / "scripts" / "gpu_check.sh").read_text()
    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True)
    assert out.returncode != 0 and "usage: bash scripts/gpu_check.sh RESULTS_DIR" in out.stderr
    for part in ("-m cuda tests/test_devices.py tests/test_static.py", "scripts/gpu_bench.py",
                 "benchmarks/bench_trees.py --device", "benchmarks/bench_captured.py --device", "benchmarks/gpu_cost_8b.py"):
        assert part in text


def test_gpu_check_refuses_a_part_it_does_not_have(tmp_path):
    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path), "bogus"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode != 0 and "unknown part bogus (tests, timing, real, sampled, speed)" in out.stdout


def test_the_speed_parts_scripts_run_on_a_cpu(tmp_path):
    """The speed part's two scripts on a CPU, so a GPU run does not fail on a typo: gpu_cost_8b.py on a 2-layer model
    of its family (eager steps) writes its record's keys; bench_captured.py accepts the part's cells (SPEED_CELLS, read
    from the script) and, on CPU-able modes, writes the summary's keys, leaving out (and reporting) a cell that cannot
    run."""
    import re

    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_cost_8b.py"), "--device", "cpu", "--tiny",
                    "--repeats", "2", "--context", "16", "--sizes", "1", "2", "11", "--out", str(tmp_path / "cost.json")],
                   check=True, capture_output=True, timeout=600, cwd=ROOT)
    cost = json.loads((tmp_path / "cost.json").read_text())
    assert {"ar_tokens_per_s_t0", "best_speedup_t1", "calls", "steps"} <= set(cost)
    assert cost["calls"]["r_chain"]["1"] == 1.0 and set(cost["steps"]["t0"]) >= {"autoregressive", "dynamic K8 g6 n32"}
    text = (ROOT / "scripts" / "gpu_check.sh").read_text()
    cells = re.findall(r'"([^"]+:[a-z-]+)"', text.split("SPEED_CELLS=(", 1)[1].split(")\n", 1)[0])
    assert len(cells) >= 8 and "autoregressive:cudagraph" in cells
    bench = [sys.executable, str(ROOT / "benchmarks" / "bench_captured.py")]
    subprocess.run([*bench, "--cells", *cells, "--validate-only", "--out", str(tmp_path / "x")], check=True,
                   capture_output=True, timeout=120, cwd=ROOT)
    refused = subprocess.run([*bench, "--cells", "autoregressive (int4):off", "--validate-only", "--out",
                              str(tmp_path / "x")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert refused.returncode != 0 and "unknown cells ['autoregressive (int4):off']" in refused.stderr
    refused = subprocess.run([*bench, "--cells", "chain block g1 [eagle9]:off", "--validate-only", "--out",
                              str(tmp_path / "x")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert refused.returncode != 0 and "unknown cells ['chain block g1 [eagle9]:off']" in refused.stderr
    # bfloat16 is slow here; a cudagraph cell cannot run on a CPU: left out, its error kept, the others measured
    cpu_cells = ["autoregressive:off", "chain block g1:static", "dynamic K4 g4 n10:static", "chain block g2:cudagraph",
                 "chain block g1 [ngram+fp16:eagle3-v8k]:static"]
    subprocess.run([*bench, "--draft", "fp16:eagle3-v8k", "--prompts", "2", "--max-new-tokens", "4", "--peer",
                    "--cells", *cpu_cells, "--out", str(tmp_path / "speed")], check=True, capture_output=True,
                   timeout=900, cwd=ROOT)
    record = json.loads((tmp_path / "speed.json").read_text())
    assert record["complete"] and list(record["failed_cells"]) == ["chain block g2:cudagraph"]
    assert "captures CUDA graphs" in record["failed_cells"]["chain block g2:cudagraph"]
    assert set(record["warm_up_seconds"]) == {*cpu_cells[:3], cpu_cells[4], "transformers static:transformers"}
    summary = record["summary"]
    assert {"ar_tokens_per_s", "peer_tokens_per_s", "best_speedup_t0", "best_speedup_t1", "best_config_t0"} <= set(summary)
    assert {c["label"] for c in summary["cells"]} >= {"dynamic K4 g4 n10 / static", "transformers static / transformers",
                                                      "chain block g1 [ngram+fp16:eagle3-v8k] / static"}
