"""Provenance of the records written before records carried a header (``records.record_header``): the last commit
that wrote each, the machine its rows, its commit or the docs of that commit name, and the sha256
(``store.draft_digest``) of the weights each draft name in it stood for, read from the commit that shipped them. A
head that was never shipped has no weights in the repository: its manifest (beside the records) names its training.

Which weights a name stood for is stated per record below (from the run's description in the docs of its commit,
``git show COMMIT:docs/...``): a run may time a head before the commit that ships it. Before commit 1a50456 every
run was on the first 2-core CPU, whose model no record kept. Writes
``benchmarks/records/provenance.json``; ``benchmarks/index_records.py`` shows it beside each record. Needs the
repository's history (a full clone).

    PYTHONPATH=. .venv/bin/python benchmarks/record_provenance.py
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from specresearch.drafts.store import draft_digest
from specresearch.paths import repo_root

SHIPPED_AT = {  # a head's name -> the commit whose data/drafts/<directory> holds its weights (git log -- data/drafts)
    "v8k-4l": ("v8k-4l", "0bdc0fb"),
    "640-step head": ("eagle3-v8k", "0c4ade8"),
    "1,280-step head": ("eagle3-v8k", "879b973"),
    "34-chunk head": ("eagle3-v8k", "a31acf6"),
    "68-chunk head": ("eagle3-v8k", "d328cd7"),
    "136-chunk head": ("eagle3-v8k", "bdb5569"),
    "continued head": ("eagle3-v8k", "3b7b2c2"),
    "shipped head (544 chunks)": ("eagle3-v8k", "2d6d7f3"),
}

NOT_SHIPPED = {  # a head never shipped -> its manifest beside the records
    "1,280-step head under bfloat16 autocast": "eagle3-v8k_17chunks_1280steps_bf16_manifest.json",
    "17-chunk 2,560-step head": "eagle3-v8k_17chunks_2560steps_manifest.json",
    "head continued on chunks 273-359": "eagle3-v8k_cont87chunks_2944steps_manifest.json",
}

FIRST_CPU = "the first 2-core CPU, 1 thread (its model was not recorded)"
XEON_DAY = "not recorded; that day's other records name an Intel Xeon (2 cores, 1 thread)"
AMD = "AMD EPYC (2 cores, 1 thread)"

RECORDS = {  # record (under benchmarks/records/ unless a path) -> (machine where its rows name none, {draft name: head})
    "heldout70_fp16_eagle3-v8k-544c-40960s_2026-11-27.json": (
        "AMD EPYC (2 cores, 1 thread)", {"fp16:results/eagle3-v8k-544c-40960s": "shipped head (544 chunks)"}),
    "wallclock_epyc_2026-11-27.jsonl": (None, {"eagle3-v8k": "shipped head (544 chunks)",
                                               "ngram+eagle3-v8k": "shipped head (544 chunks)",
                                               "results/eagle3-v8k-cont136-4608s": "continued head"}),
    "bench_wallclock_2026-11-24d.jsonl": ("the first 2-core CPU, 1 thread (its model was not recorded)", {"eagle3-v8k": "34-chunk head", "fp16:eagle3-v8k": "34-chunk head",
                                                 "ngram+fp16:eagle3-v8k": "34-chunk head", "v8k-4l": "v8k-4l"}),
    "head68_wallclock_2026-11-25.jsonl": (None, {"eagle3-v8k": "34-chunk head", "ngram+fp16:eagle3-v8k": "34-chunk head",
                                                 "results/eagle3-v8k-68c-5120s": "68-chunk head",
                                                 "ngram+fp16:results/eagle3-v8k-68c-5120s": "68-chunk head"}),
    "head136_wallclock_2026-11-25.jsonl": (None, {"eagle3-v8k": "136-chunk head", "ngram+fp16:eagle3-v8k": "136-chunk head",
                                                  "results/eagle3-v8k-68c-5120s": "68-chunk head"}),
    "lossless_fp16-eagle3-v8k_2026-11-27.jsonl": ("AMD EPYC (2 cores, 1 thread)", {"fp16:eagle3-v8k": "shipped head (544 chunks)"}),
    "lossless_ngram+fp16-eagle3-v8k_2026-11-27.jsonl": ("AMD EPYC (2 cores, 1 thread)",
                                                        {"ngram+fp16:eagle3-v8k": "shipped head (544 chunks)"}),
    "lossless_power_fp16-eagle3-v8k.jsonl": ("AMD EPYC (2 cores, 1 thread)", {"fp16:eagle3-v8k": "shipped head (544 chunks)"}),
    "auto_wallclock_2026-11-24.jsonl": (None, {"eagle3-v8k": "34-chunk head", "ngram+fp16:eagle3-v8k": "34-chunk head",
                                               "ngram+fp16:eagle3-v8k@draft-gamma=2": "34-chunk head"}),
    "bench_generate_2026-11-24.jsonl": (FIRST_CPU, {"v8k-4l": "v8k-4l"}),
    "bench_score_cost_2026-11-24b.jsonl": (FIRST_CPU, {}),
    "bench_score_cost_2026-11-24c.jsonl": ("Intel(R) Xeon(R) Processor (2 cores, torch 2.13.0+cpu; in every row)", {}),
    "bench_wallclock_2026-11-24c.jsonl": (FIRST_CPU, {"eagle3-v8k": "640-step head", "ngram+eagle3-v8k": "640-step head",
                                                      "v8k-4l": "v8k-4l"}),
    "claims_t0_amd.md": (AMD, {"fp16:eagle3-v8k": "shipped head (544 chunks)"}),
    "claims_t1_amd.md": (AMD, {"fp16:eagle3-v8k": "shipped head (544 chunks)"}),
    "combined_plan_rules_2026-11-24b.jsonl": (FIRST_CPU, {"ngram+eagle3-v8k": "640-step head"}),
    "combined_rules_fp16_eagle3-v8k-136c_2026-11-25.json": ("Intel Xeon (2 cores, 1 thread; its commit)",
                                                            {"fp16:eagle3-v8k": "136-chunk head"}),
    "combined_rules_fp16_eagle3-v8k_2026-11-25.json": (XEON_DAY, {"fp16:eagle3-v8k": "68-chunk head"}),
    "heldout70_fp16_eagle3-v8k-1280steps_2026-11-24.json": (FIRST_CPU, {"fp16:eagle3-v8k": "1,280-step head"}),
    "heldout70_fp16_eagle3-v8k-1280steps-bf16_2026-11-25.json": (
        "Intel Xeon (2 cores, 1 thread; its commit)",
        {"fp16:results/eagle3-v8k-17c-1280s-bf16": "1,280-step head under bfloat16 autocast"}),
    "heldout70_fp16_eagle3-v8k-136c-10240s_2026-11-25.json": (
        XEON_DAY, {"fp16:results/eagle3-v8k-136c-10240s": "136-chunk head"}),
    "heldout70_fp16_eagle3-v8k-17c-2560s_2026-11-24.json": (
        FIRST_CPU, {"fp16:results/eagle3-v8k-17c-2560s": "17-chunk 2,560-step head"}),
    "heldout70_fp16_eagle3-v8k-34c-2560s_2026-11-24.json": (
        FIRST_CPU, {"fp16:results/eagle3-v8k-34c-2560s": "34-chunk head"}),
    "heldout70_fp16_eagle3-v8k-68c-5120s_2026-11-25.json": (
        "Intel Xeon (2 cores, 1 thread; its commit)", {"fp16:results/eagle3-v8k-68c-5120s": "68-chunk head"}),
    "heldout70_fp16_eagle3-v8k-cont136-4608s_2026-11-26.json": (
        AMD, {"fp16:results/eagle3-v8k-cont136-4608s": "continued head"}),
    "heldout70_fp16_eagle3-v8k-cont87-2944s_2026-11-26.json": (
        AMD, {"fp16:results/eagle3-v8k-cont87-2944s": "head continued on chunks 273-359"}),
    "loop_acceptance_fp16_eagle3-v8k_2026-11-24.json": (FIRST_CPU, {"fp16:eagle3-v8k": "34-chunk head"}),
    "multidraft_headroom_2026-11-24.json": (FIRST_CPU, {"eagle3-v8k": "640-step head"}),
    "prompt_breadth_2026-11-24.json": (FIRST_CPU, {"results/eagle3-v8k-640s": "640-step head"}),
    **{f"data/sweeps/dial/{run}.json": ("2-core CPU, 1 thread (docs/block_gain.md)", {draft: "v8k-4l"})
       for run, draft in (("v8k-4l", "v8k-4l"), ("dial-mix_0.25", "dial-mix:0.25"), ("dial-mix_0.5", "dial-mix:0.5"),
                          ("dial-mix_0.75", "dial-mix:0.75"))},
}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=repo_root()).stdout.strip()


def _digest_at(directory: str, commit: str) -> str:
    """``draft_digest`` of ``data/drafts/<directory>`` as committed in ``commit``."""
    archive = subprocess.run(["git", "archive", commit, f"data/drafts/{directory}"], capture_output=True, check=True,
                             cwd=repo_root()).stdout
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        return draft_digest(Path(tmp) / "data" / "drafts" / directory)


def _machine(path: Path) -> str | None:
    """The machine a record's first row names (``bench_wallclock.py`` records), else None."""
    first = json.loads(path.read_text().splitlines()[0])
    if first.get("method") == "machine":
        return f"{first['cpu']} ({first['cpu_count']} cores, {first['torch_threads']} thread(s), torch {first['torch']})"
    return None


def _weights(head: str, digests: dict) -> dict:
    """What a draft name stood for: a shipped head's commit and digest, or a never-shipped head's manifest."""
    if head in NOT_SHIPPED:
        return {"weights": head, "manifest": NOT_SHIPPED[head], "sha256": None}
    return {"weights": head, "shipped_in_commit": SHIPPED_AT[head][1], "sha256": digests[head]}


def provenance() -> dict:
    records = repo_root() / "benchmarks" / "records"
    digests = {head: _digest_at(directory, commit) for head, (directory, commit) in SHIPPED_AT.items()}
    out = {}
    for name, (machine, drafts) in RECORDS.items():
        path = repo_root() / name if "/" in name else records / name
        # seven digits whatever the clone: git's own abbreviation lengthens with the object count of a clone
        written = _git("log", "-1", "--format=%H", "--", str(path.relative_to(repo_root())))[:7]
        out[name] = {"last_written_in_commit": written, "machine": (_machine(path) if path.suffix == ".jsonl" else None) or machine,
                     "drafts": {draft: _weights(head, digests) for draft, head in drafts.items()}}
    return out


def main() -> int:
    path = repo_root() / "benchmarks" / "records" / "provenance.json"
    path.write_text(json.dumps(provenance(), indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
