"""Audit by execution of transformers' MTP drafting, the committed record: ``generate(use_mtp=True, do_sample=True)``
(transformers' own ``MTPCandidateGenerator`` and ``_speculative_sampling``) on tiny random-weight checkpoints with one
MTP layer in the published layouts (``models.families.tiny_mtp_checkpoint``: Mellum's ``mtp.*`` with a windowed
layer, DeepSeek-V3's ``model.layers.61.*``), the measured law of the first two tokens against the target's
(``specresearch.audit.execute``, engine ``transformers-mtp``). The embedded SmolLM2 has no MTP layers, hence the tiny
checkpoints: each row names its layout, seed and the checkpoint's digest.

    python benchmarks/audit_mtp.py [--out benchmarks/records/audit_mtp.json] [--scale 1.0]

Resumable: configurations already in the record are kept, the rest run and are written one by one. The rows join
docs/audit.md's table of engines run (``benchmarks/audit_executed.py --docs``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch

from specresearch.audit.execute import execute
from specresearch.audit.report import config_key
from specresearch.experiments.records import git_commit, record_header, write_json_record
from specresearch.models.families import tiny_mtp_checkpoint

PROMPT = [5, 9, 3]
SEED = 0  # the checkpoints' weights
# (layout, n_tokens, N, temperature, options); each row records the TV its N detects (cells of expected count >= 20)
CONFIGS = [
    ("mellum", 2, 20000, 1.0, {}),
    ("mellum", 2, 12000, 0.7, {"top_p": 0.9}),
    ("deepseek-v3", 2, 4000, 1.0, {}),  # 61 layers: ~0.15 s a generation here
]
MIN_EXPECTED = 20.0


def _model_name(layout: str) -> str:
    return f"tiny {layout} with one MTP layer (seed {SEED})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/records/audit_mtp.json")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM

    out = Path(args.out)
    record = json.loads(out.read_text()) if out.exists() else record_header(
        "benchmarks/audit_mtp.py", sys.argv[1:] if argv is None else argv, rows=[])
    done = {config_key(r["engine"], r["n_tokens"], r["temperature"], r["options"], [r["model"], r["prompt"]])
            for r in record["rows"]}
    torch.set_num_threads(args.threads)
    for layout, n_tokens, n, temperature, options in CONFIGS:
        name = _model_name(layout)
        if config_key("transformers-mtp", n_tokens, temperature, options, [name, PROMPT]) in done:
            continue
        with tempfile.TemporaryDirectory() as directory:
            tiny_mtp_checkpoint(Path(directory), layout, seed=SEED)
            digest = hashlib.sha256((Path(directory) / "model.safetensors").read_bytes()).hexdigest()[:16]
            target = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
            result = execute("transformers-mtp", prompt=PROMPT, n_tokens=n_tokens, temperature=temperature,
                             num_samples=max(20, round(n * args.scale)), target=target, min_expected=MIN_EXPECTED,
                             **options)
        print(result, flush=True)
        row = {"model": name, "checkpoint_sha256": digest, "prompt": PROMPT, "commit": git_commit()} | result.as_record()
        record["rows"].append(row)
        write_json_record(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
