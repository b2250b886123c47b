"""Write docs/api.md, the API reference: every public module of the package with its ``__all__`` names, their
signatures and the first line of their docstrings, room by room (docs/README.md, "Layout").

    PYTHONPATH=. .venv/bin/python scripts/api_reference.py          # rewrite docs/api.md
    PYTHONPATH=. .venv/bin/python scripts/api_reference.py --check  # exit 1 if docs/api.md is stale

``tests/test_layout.py`` keeps the file current, as it keeps benchmarks/records/INDEX.md.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "api.md"
ROOMS = ("base", "core", "exact", "models", "drafts", "engine", "training", "experiments", "audit")


def _first_line(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    line = doc.strip().split("\n\n")[0].replace("\n", " ")
    return re.sub(r"\s+", " ", line)


def _signature(name: str, obj) -> str:
    if not callable(obj):
        return f"`{name}`"
    try:
        signature = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return f"`{name}`"
    signature = re.sub(r" at 0x[0-9a-f]+", "", signature)  # default objects: no addresses
    return f"`{name}{signature}`"


def _modules() -> list[str]:
    import specresearch

    names = ["specresearch"]
    for info in pkgutil.walk_packages(specresearch.__path__, "specresearch."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return sorted(names, key=lambda n: (_room(n), n))


def _room(name: str) -> int:
    parts = name.split(".")
    return ROOMS.index(parts[1]) if len(parts) > 2 and parts[1] in ROOMS else 0


def render() -> str:
    lines = ["# API reference", "", "Generated from the docstrings by `scripts/api_reference.py` (do not edit by hand): each module's",
             "public names (`__all__`) with their signatures and the first line of their docstrings. The rooms and which way",
             "their imports point: [README.md](README.md), \"Layout\".", ""]
    for name in _modules():
        module = importlib.import_module(name)
        public = [n for n in getattr(module, "__all__", []) if not n.startswith("__")]
        if name != "specresearch" and not public:
            continue
        lines += [f"## `{name}`", "", _first_line(module), ""]
        for attribute in public:
            obj = getattr(module, attribute)
            if inspect.ismodule(obj):
                lines.append(f"- `{attribute}`: module `{obj.__name__}`")
                continue
            summary = _first_line(obj) if (inspect.isclass(obj) or inspect.isfunction(obj)) else ""
            lines.append(f"- {_signature(attribute, obj)}" + (f": {summary}" if summary else ""))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is not current")
    args = parser.parse_args()
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT} is stale: run scripts/api_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
