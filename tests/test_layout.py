"""The package's layout: rooms whose imports point down, no import circles, modules of one idea and modest size.

The rooms and the direction of their arrows are those of ``docs/README.md`` ("Layout"). Every import counts,
including those inside functions: a lazy import that points up is still an upward dependency.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "specresearch"
ROOT = PACKAGE.parent

# room -> the rooms it may import from (besides itself). "base": the pure-Python leaf modules every room may use.
ALLOWED = {
    "base": set(),
    "core": {"base"},
    "exact": {"base"},
    "models": {"base", "core"},
    "drafts": {"base", "core", "models"},
    "engine": {"base", "core", "models"},
    "training": {"base", "core", "models", "drafts", "engine"},
    "experiments": {"base", "core", "exact", "models", "drafts", "engine", "training"},
    "audit": {"base", "core", "exact", "models", "drafts", "engine", "training", "experiments"},
    "front": {"base", "core", "exact", "models", "drafts", "engine", "training", "experiments", "audit"},
}
BASE = {"checks", "paths", "config"}
FRONT = {"__init__", "__main__", "cli", "cli_checks", "cli_audit", "cli_train"}
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _room(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "front"
    if len(parts) == 2 and parts[1] in BASE:
        return "base"
    if len(parts) == 2 and parts[1] in FRONT:
        return "front"
    return parts[1]


def _imports(module: str) -> set[str]:
    """The specresearch modules ``module`` imports (anywhere in its body), resolved to module names."""
    tree = ast.parse(MODULES[module].read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("specresearch")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specresearch"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return {m for m in found if m != module and m != "specresearch"}


GRAPH = {m: _imports(m) for m in MODULES}


def test_every_module_belongs_to_a_known_room():
    assert {_room(m) for m in MODULES} <= set(ALLOWED)


def test_the_layout_picture_names_every_module():
    """docs/README.md's picture lists, room by room, every module a newcomer will find there."""
    picture = (ROOT / "docs" / "README.md").read_text().split("## Layout", 1)[1].split("| room |", 1)[0]
    blocks = re.split(r"\n   (?=\w+/ )", picture)  # one block per room line and its continuation lines
    for room in ("core", "exact", "models", "drafts", "engine", "training", "experiments", "audit"):
        block = next(b for b in blocks if b.startswith(f"{room}/"))
        named = set(re.findall(r"[a-z_][a-z0-9_]*", block))
        missing = sorted(m.split(".")[-1] for m in MODULES if _room(m) == room and m.count(".") == 2
                         and m.split(".")[-1] not in named)
        assert not missing, f"docs/README.md's layout does not name {room}/{missing}"


def test_imports_point_down_the_rooms():
    """An import from a room not listed under ALLOWED (upward or sideways) fails, naming the edge."""
    wrong = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() for d in deps
                   if _room(d) != _room(m) and _room(d) not in ALLOWED[_room(m)])
    assert wrong == []


def test_no_private_names_across_rooms():
    """A room uses another room's public names only (``from x import _name`` across rooms fails)."""
    wrong = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specresearch"):
                target = node.module if node.module in MODULES else node.module.rpartition(".")[0]
                private = [a.name for a in node.names if a.name.startswith("_") and a.name != "__all__"]
                if private and _room(target) != _room(module):
                    wrong.append(f"{module} -> {node.module}: {private}")
    assert wrong == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    """Module-level circles only, packages' own __init__ re-exports excluded (they import their room's modules
    by design and are imported by nobody inside the room)."""
    graph = {m: {d for d in deps if MODULES[d].name != "__init__.py"} for m, deps in GRAPH.items()}
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_modules_stay_small():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


@pytest.mark.parametrize("room", ["exact", "base"])
def test_exact_and_base_import_no_torch(room):
    """The exact twins and the leaf modules are pure Python: importing all of them loads no torch."""
    names = [m for m in MODULES if _room(m) == room]
    code = "import sys\n" + "".join(f"import {m}\n" for m in names) + "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_public_name_exists():
    """Each module's ``__all__`` names only what it defines or imports (a name left behind by a move breaks ``import *``)."""
    import importlib

    missing = {m: [n for n in getattr(importlib.import_module(m), "__all__", ()) if not hasattr(importlib.import_module(m), n)]
               for m in MODULES if not m.endswith("__main__")}  # __main__ runs the command line when imported
    assert {m: names for m, names in missing.items() if names} == {}


def test_tracked_files_fit_what_a_gpu_machine_receives():
    """A device call carries at most 64 MiB: the tracked files and the untracked ones git does not ignore (what a call
    sends with no carried paths) stay under 60 MiB, 4 MiB left for the paths a call carries (shipped weights
    xz-packed; scripts/gpu_payload.sh stashes the records, figures and weights when the model travels too)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], capture_output=True,
                            cwd=ROOT, check=True).stdout.split(b"\0")
    sizes = {name.decode(): (ROOT / name.decode()).stat().st_size for name in listed if name and (ROOT / name.decode()).is_file()}
    largest = sorted(sizes, key=sizes.get)[-3:]
    assert sum(sizes.values()) < 60 * 2**20, f"{sum(sizes.values()) / 2**20:.1f} MiB sent; largest: {largest}"


def _index_records():
    import importlib.util

    spec = importlib.util.spec_from_file_location("index_records", ROOT / "benchmarks" / "index_records.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_records_index_is_current():
    """``benchmarks/records/INDEX.md`` lists every record, what made it and who cites it: regenerate it with
    ``PYTHONPATH=. python benchmarks/index_records.py`` when a record or a citing page changes."""
    assert (ROOT / "benchmarks" / "records" / "INDEX.md").read_text() == _index_records().index_markdown()


def test_every_record_states_what_made_it():
    """Each record's row in the index names what made it: its own header (command, commit), or for a record written
    before headers existed its ``provenance.json`` entry (commit, machine, the weights each draft name stood for)."""
    rows = [line.split(" | ") for line in (ROOT / "benchmarks" / "records" / "INDEX.md").read_text().splitlines()
            if line.startswith("| `")]
    silent = [row[0].strip("| `") for row in rows if not row[1].strip()]
    assert rows and not silent, f"records that do not say what made them: {silent}"


def test_every_record_is_cited_and_every_cited_record_exists():
    """The records are the current set: each is cited by a page, notebook, benchmark or module (a superseded one
    leaves, git keeps it), and each ``benchmarks/records/NAME`` a page names exists."""
    module = _index_records()
    uncited = [name for name, pages in module.citations().items() if not pages]
    assert not uncited, f"records nothing cites: {uncited}"
    missing = set()
    for pattern in module.CITING:
        for page in ROOT.glob(pattern):
            for name in re.findall(r"benchmarks/records/([\w+\-.]+\.(?:jsonl|json|csv|md)|scaling)\b", module._text(page)):
                if not (ROOT / "benchmarks" / "records" / name).exists():
                    missing.add(f"{page.relative_to(ROOT)}: {name}")
    assert not missing, f"cited records that do not exist: {sorted(missing)}"


def test_a_record_is_cited_by_name_stem_or_pattern():
    module = _index_records()
    tokens = set(re.findall(r"[\w+\-]+(?:\.[\w+\-]+)*", "see `trees_head_amd` and runs_1.jsonl."))
    patterns = module._patterns("`heldout70_{a,b}_x.json` `claims_<claim>_t1_amd.csv` `lossless_*.jsonl` {x}")
    assert patterns == {"heldout70_a_x.json", "heldout70_b_x.json", "claims_*_t1_amd.csv", "lossless_*.jsonl"}
    assert module.cites(tokens, set(), Path("trees_head_amd.csv")) and module.cites(tokens, set(), Path("runs_1.jsonl"))
    assert not module.cites(tokens, set(), Path("trees_amd.csv"))
    assert module.cites(set(), patterns, Path("claims_gbv_t1_amd.csv"))
    assert not module.cites(set(), patterns, Path("claims_gbv_t0_amd.csv"))


def test_the_api_reference_is_current():
    """``docs/api.md`` is generated from the docstrings: regenerate it with ``PYTHONPATH=. python
    scripts/api_reference.py`` when a public name, signature or docstring's first line changes."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("api_reference", ROOT / "scripts" / "api_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "docs" / "api.md").read_text() == module.render()


def test_the_records_provenance_is_current():
    """``benchmarks/records/provenance.json`` (commit, machine and weights' sha256 of the records written before
    headers existed) is what ``benchmarks/record_provenance.py`` reads from the repository's history."""
    import importlib.util
    import json

    if subprocess.run(["git", "rev-parse", "--is-shallow-repository"], capture_output=True, text=True,
                      cwd=ROOT).stdout.strip() != "false":
        pytest.skip("needs the repository's full history (a git clone that is not shallow)")
    spec = importlib.util.spec_from_file_location("record_provenance", ROOT / "benchmarks" / "record_provenance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert json.loads((ROOT / "benchmarks" / "records" / "provenance.json").read_text()) == module.provenance()
