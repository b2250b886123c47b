"""Provenance of the records the README's figures rest on that were written before records carried a header
(``records.record_header``): the last commit that wrote each, the machine its rows or the docs name, and the sha256
(``store.draft_digest``) of the weights each draft name in it stood for, read from the commit that shipped them.

Which weights a name stood for is stated per record below (from the run's description in the docs of its commit,
``git show COMMIT:docs/...``): a run may time a head before the commit that ships it. Writes
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
    "34-chunk head": ("eagle3-v8k", "a31acf6"),
    "68-chunk head": ("eagle3-v8k", "d328cd7"),
    "136-chunk head": ("eagle3-v8k", "bdb5569"),
    "continued head": ("eagle3-v8k", "3b7b2c2"),
    "shipped head (544 chunks)": ("eagle3-v8k", "2d6d7f3"),
}

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


def provenance() -> dict:
    records = repo_root() / "benchmarks" / "records"
    digests = {head: _digest_at(directory, commit) for head, (directory, commit) in SHIPPED_AT.items()}
    out = {}
    for name, (machine, drafts) in RECORDS.items():
        path = repo_root() / name if "/" in name else records / name
        written = _git("log", "-1", "--format=%h", "--", str(path.relative_to(repo_root())))
        out[name] = {"last_written_in_commit": written, "machine": (_machine(path) if path.suffix == ".jsonl" else None) or machine,
                     "drafts": {draft: {"weights": head, "shipped_in_commit": SHIPPED_AT[head][1], "sha256": digests[head]}
                                for draft, head in drafts.items()}}
    return out


def main() -> int:
    path = repo_root() / "benchmarks" / "records" / "provenance.json"
    path.write_text(json.dumps(provenance(), indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
