"""Records: the rows a sweep writes and the machine it ran on, read back without the engine (no torch at import).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

__all__ = ["AUTOREGRESSIVE", "RECORD_COLUMNS", "replace_generated", "git_commit", "machine_info", "read_records", "record_files", "record_header",
           "write_json_record", "write_run_info"]


AUTOREGRESSIVE = "autoregressive"  # the ``verifier`` value of baseline rows (gamma 0, no draft)


RECORD_COLUMNS = (
    "run_id",
    "prompt_id",
    "category",
    "verifier",  # token | block | greedy | autoregressive
    "temperature",
    "gamma",  # 0 for autoregressive rows
    "seed",
    "new_tokens",  # tokens emitted (after truncation at EOS / max_new_tokens)
    "target_calls",  # verification steps (autoregressive: one per token); the prefill is not counted
    "draft_calls",
    "accepted_tokens",  # sum over steps of accepted drafts, before truncation
    "examined_drafts",  # accepted + steps with a rejection: alpha estimate = accepted / examined
    "seconds",  # wall time of the whole run, prefill included
    "target_seconds",  # inside the target's forward passes (steps)
    "draft_seconds",  # inside the draft's forward passes (steps)
    "prefill_seconds",
    "ar_seconds",  # the autoregressive baseline of the same prompt, temperature and seed
    "ar_tokens",
    "shared_steps",  # steps with the same drafts and uniforms as the other verifier(s) (module docstring)
    "common_prefix_tokens",  # length of the output prefix shared with the other verifier(s)
    "output_hash",  # sha1 of the output tokens (first 12 hex digits)
    "order",  # position of the run within its unit (timing order)
    "load_avg",  # 1-minute load average when the run finished
    # Per step, E[accepted | the drafted block] of each verifier on the SAME block (verify.expected_num_accepted),
    # summed over the run's steps: the realised count's expectation for the verifier that ran, the
    # counterfactual for the other (module docstring, "Expected counts").
    "expected_token",
    "expected_block",
    "overlap_sum",  # sum over steps of the block's mean sum_x min(p_i, q_i): / target_calls = measured alpha
    "batch",  # prompts in the generate call (run_bench: 1, timed; run_batched: the batch, seconds are NaN)
)


def machine_info() -> dict:
    """What a timing depends on besides the code: the CPU's model name and the vector extensions torch's CPU
    kernels use (AVX2, AVX-512, AMX; from ``/proc/cpuinfo`` where there is one), the CPU count, torch's
    version and thread count, transformers' version and, where torch sees one, the CUDA device's name. Speed-ups and
    the cost of scoring k tokens differ between machines."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from specresearch.paths import cpu_fields, cpu_name

    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")
    flags = sorted(f for f in cpu_fields().get("flags", "").split() if f in wanted)
    try:
        transformers = version("transformers")
    except PackageNotFoundError:
        transformers = None
    info = {"cpu": cpu_name(), "cpu_flags": flags, "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "transformers": transformers}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# Tracked paths whose changes leave what a run computes as the commit has it: the records runs write, and prose.
_NOT_CODE = (":(exclude)benchmarks/records", ":(exclude)*.md")


def git_commit() -> str:
    """The checkout's commit (short hash): what every record names as its code, with ``+dirty`` appended where a tracked
    file other than the records (``benchmarks/records/``) and the pages (``*.md``) differs from it: a record made by
    uncommitted code does not name a commit that could not have made it. ``SPECRESEARCH_COMMIT``, where set, says it
    instead: a copy of the working tree sent to a GPU machine may carry no ``.git``, or an older one; '' where neither
    says."""
    import subprocess

    from specresearch.paths import repo_root

    if os.environ.get("SPECRESEARCH_COMMIT"):
        return os.environ["SPECRESEARCH_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=repo_root()).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = head and git("status", "--porcelain", "--untracked-files=no", "--", ".", *_NOT_CODE)
    except OSError:
        return ""
    return f"{head}+dirty" if changed else head


def record_header(script: str, argv: list[str], draft: str | None = None, *,
                  target: str | None = "smollm2-135m-instruct", **extra) -> dict:
    """What a record says about the run that made it: the command (``script`` and its ``argv``, shell-quoted), the
    commit (short hash, '' outside a git checkout), the date, the machine (:func:`machine_info`), the ``target``
    (an embedded model's name, with its weights' sha256, ``models.embedded.weights_digest``; None: no target) and,
    for a ``draft`` name, the sha256 of every shipped weight file it uses (``drafts.registry.weights_digests``);
    ``extra`` is added."""
    import shlex

    header = {"command": shlex.join([script, *argv]), "commit": git_commit(), "date": time.strftime("%Y-%m-%d"),
              "machine": machine_info()}
    if target is not None:
        from specresearch.models.embedded import weights_digest

        header.update(target=target, target_sha256=weights_digest(target))
    if draft is not None:
        from specresearch.drafts.registry import weights_digests

        header.update(draft=draft, draft_sha256=weights_digests(draft))
    return {**header, **extra}


def record_files(stem: str | os.PathLike) -> tuple[Path, Path]:
    """The record pair ``(<stem>.csv, <stem>.json)`` of a benchmark's ``--out`` stem. The stem may hold dots
    (``trees_dial-mix0.5_amd``: nothing after the dot is lost); a ``.csv`` or ``.json`` ending is dropped first."""
    stem = Path(stem)
    if stem.suffix in (".csv", ".json"):
        stem = stem.with_suffix("")
    return stem.parent / f"{stem.name}.csv", stem.parent / f"{stem.name}.json"


def write_run_info(path: str | os.PathLike, **info) -> Path:
    """Append one run's description (``info`` + torch version, threads, CPU count, load average, time) to the JSON
    file next to the records (``<run>.json``): what produced the rows, for the report."""

    path = Path(path).with_suffix(".json")
    runs = json.loads(path.read_text()) if path.exists() else []
    runs.append({**info, **machine_info(),
                 "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
                 "started": time.strftime("%Y-%m-%dT%H:%M:%S")})
    return write_json_record(path, runs, indent=2)


def write_json_record(path: str | os.PathLike, record: dict | list, *, indent: int | None = 1) -> Path:
    """Write a benchmark's record, one JSON value (``record_header`` and its rows; :func:`write_run_info`'s list of
    runs), at ``path``, making its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=indent) + "\n")
    return path


def read_records(path: str | os.PathLike):
    """The records of a sweep CSV as a pandas DataFrame (empty, with ``RECORD_COLUMNS``, if no file)."""
    import pandas as pd

    if not Path(path).exists():
        return pd.DataFrame(columns=list(RECORD_COLUMNS))
    return pd.read_csv(path, dtype={"prompt_id": str, "category": str, "verifier": str, "output_hash": str})


def replace_generated(path: str | os.PathLike, start: str, end: str, block: str) -> None:
    """Rewrite the generated block of a docs file: what lies between the markers ``start`` and ``end`` becomes
    ``block`` (a benchmark's ``--docs``)."""
    text = Path(path).read_text()
    head, rest = text.split(start, 1)
    Path(path).write_text(f"{head}{start}\n{block}{end}{rest.split(end, 1)[1]}")
