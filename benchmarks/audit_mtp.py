"""Audit by execution of transformers' MTP drafting, the committed record: ``generate(use_mtp=True, do_sample=True)``
(transformers' own ``MTPCandidateGenerator`` and ``_speculative_sampling``) on tiny random-weight checkpoints with one
MTP layer in the published layouts (``models.families.tiny_mtp_checkpoint``: Mellum's ``mtp.*`` with a windowed
layer, DeepSeek-V3's ``model.layers.61.*``), the measured law of the first two tokens against the target's
(``specresearch.audit.execute``, engine ``transformers-mtp``). The embedded SmolLM2 has no MTP layers, hence the tiny
checkpoints: each row names its layout, seed and the checkpoint's digest.

    python benchmarks/audit_mtp.py [--out benchmarks/records/audit_mtp.json] [--scale 1.0]

Resumable (``audit.execute.record_tiny_runs``): configurations already in the record are kept, the rest run and are
written one by one. The rows join docs/audit.md's table of engines run (``benchmarks/audit_executed.py --docs``).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from specresearch.audit.execute import TinyRun, tiny_runs_main
from specresearch.models.families import tiny_mtp_checkpoint

PROMPT = (5, 9, 3)
SEED = 0  # the checkpoints' weights
_CHECKPOINTS = Path(tempfile.mkdtemp(prefix="audit_mtp_"))  # kept to the end: transformers re-reads the MTP tensors
atexit.register(shutil.rmtree, _CHECKPOINTS, ignore_errors=True)  # at every generate


def build(layout: str):
    """(the target loaded from a tiny checkpoint of ``layout``, no draft, the checkpoint's digest)."""
    from transformers import AutoModelForCausalLM

    directory = _CHECKPOINTS / layout
    tiny_mtp_checkpoint(directory, layout, seed=SEED)
    digest = hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest()[:16]
    target = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    return target, None, {"checkpoint_sha256": digest}


def _run(layout: str, n: int, temperature: float = 1.0, options: dict | None = None) -> TinyRun:
    return TinyRun(f"tiny {layout} with one MTP layer (seed {SEED})", functools.partial(build, layout),
                   "transformers-mtp", 2, n, temperature, options or {}, PROMPT)


# each row records the TV its N detects (cells of expected count >= 20)
RUNS = [_run("mellum", 20000), _run("mellum", 12000, 0.7, {"top_p": 0.9}),
        _run("deepseek-v3", 4000)]  # 61 layers: ~0.15 s a generation here


def main(argv=None) -> int:
    return tiny_runs_main(__doc__, "audit_mtp", RUNS, argv)


if __name__ == "__main__":
    sys.exit(main())
