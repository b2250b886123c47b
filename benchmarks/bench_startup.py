"""Start-up of ``specresearch generate`` against the floor that torch and transformers set, side by side in one run.

Three fresh processes, in turn, ``--rounds`` times (the model converted and the skinny-rows choice cached first):

* ``import``: ``import torch`` and transformers' Llama model and tokenizer classes, nothing else;
* ``load``: that, plus loading the converted SmolLM2-135M-Instruct and its tokenizer with plain transformers;
* ``generate``: ``specresearch generate "Hi" --max-new-tokens 1`` with its default draft, minus the generation seconds
  it prints (start-up = everything before the first step: imports, flag checks, target, draft, prefill excluded).

Writes ``benchmarks/records/startup_<cpu>.csv`` and ``.json`` (command, commit, machine). A benchmark: nothing is
asserted.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_startup.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

import pandas as pd

from specresearch.experiments.records import machine_info, record_header
from specresearch.models.embedded import cache_dir
from specresearch.paths import repo_root

IMPORT = "import torch; from transformers import AutoModelForCausalLM, AutoTokenizer; from transformers.models.llama import modeling_llama"
LOAD = IMPORT + f"; d = {str(cache_dir() / 'smollm2-135m-instruct')!r}; AutoTokenizer.from_pretrained(d); AutoModelForCausalLM.from_pretrained(d)"


def _wall(command: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=repo_root(),
                         env={**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_OFFLINE": "1"})
    return time.perf_counter() - start, out.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    python = sys.executable
    generate = [python, "-m", "specresearch", "generate", "Hi", "--max-new-tokens", "1"]
    _wall(generate)  # converts the model and caches the skinny-rows choice if this machine has not yet
    rows = []
    for round_ in range(args.rounds):
        rows.append({"round": round_, "what": "import", "seconds": _wall([python, "-c", IMPORT])[0]})
        rows.append({"round": round_, "what": "load", "seconds": _wall([python, "-c", LOAD])[0]})
        wall, out = _wall(generate)
        generating = float(re.search(r"tokens in ([0-9.]+) s", out).group(1))
        rows.append({"round": round_, "what": "generate", "seconds": wall - generating, "generation_seconds": generating})
    frame = pd.DataFrame(rows)
    medians = {what: statistics.median(frame[frame.what == what].seconds) for what in ("import", "load", "generate")}
    machine = machine_info()
    stem = repo_root() / "benchmarks" / "records" / f"startup_{machine.get('cpu', 'cpu').split()[0].lower()}"
    frame.to_csv(stem.with_suffix(".csv"), index=False)
    header = record_header("benchmarks/bench_startup.py", sys.argv[1:], median_seconds=medians)
    stem.with_suffix(".json").write_text(json.dumps(header, indent=2) + "\n")
    for what, seconds in medians.items():
        print(f"{what:>9}: {seconds:.2f} s (median of {args.rounds})")
    print(f"records in {stem}.csv / .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
