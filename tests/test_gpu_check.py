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
    for part in ("-m cuda tests/test_devices.py", "scripts/gpu_bench.py", "benchmarks/bench_trees.py --device"):
        assert part in text


def test_gpu_check_refuses_a_part_it_does_not_have(tmp_path):
    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path), "bogus"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode != 0 and "unknown part bogus (tests, timing, real, sampled)" in out.stdout
