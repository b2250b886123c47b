"""Where things live: the source checkout's ``data/`` folder and the per-machine cache, with the answers timed once
per machine kept there (``cached_answer`` / ``keep_answer``, keyed by ``cpu_key`` and the question).

Pure Python, like :mod:`specresearch.checks`: every room may use it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

__all__ = ["repo_root", "data_dir", "cache_dir", "pypi_wheel", "empty_modules", "answers_file", "cpu_fields", "cpu_name", "cpu_key", "cached_answer", "keep_answer"]


def repo_root() -> Path:
    """The source checkout (the package is installed editable): ``data/``, ``benchmarks/``, ``docs/`` live here."""
    return Path(__file__).resolve().parent.parent


def data_dir(*parts: str) -> Path:
    """``<checkout>/data/<parts...>``: shipped drafts, prompt sets, committed corpora."""
    return repo_root().joinpath("data", *parts)


def cache_dir(*parts: str) -> Path:
    """``$SPECRESEARCH_CACHE/<parts...>`` (default ``~/.cache/specresearch``): converted models, corpora,
    checkpoints, per-machine choices. An empty ``SPECRESEARCH_CACHE`` means the default."""
    root = os.environ.get("SPECRESEARCH_CACHE") or Path.home() / ".cache" / "specresearch"
    return Path(root).joinpath(*parts)


def pypi_wheel(spec: str) -> Path:
    """The wheel of ``spec`` (``name==version``) downloaded from the package index as published (``pip download
    --no-deps``) and unpacked under the cache, once: the folder to put first on ``sys.path`` to run that library's own
    code without installing it into the project's environment."""
    import subprocess
    import sys
    import zipfile

    folder = cache_dir("pypi_libraries", spec.replace("==", "-"))
    if not (folder / ".done").exists():
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--only-binary", ":all:", spec,
                        "-d", str(folder)], check=True, stdin=subprocess.DEVNULL)
        (wheel,) = folder.glob("*.whl")
        zipfile.ZipFile(wheel).extractall(folder / "site")
        (folder / ".done").write_text(wheel.name)
    return folder / "site"


def empty_modules(names) -> list[str]:
    """Make the top-level packages ``names`` that are not installed importable as empty modules (any attribute is a
    class that takes any arguments, subclassing and subscripting), for running a library's own code whose import chain
    names packages that code never calls; returns the names made so. For benchmarks that run other projects' code,
    never for the toolkit's own."""
    import importlib.abc
    import importlib.machinery
    import importlib.util
    import sys
    import types

    missing = [name for name in names if importlib.util.find_spec(name) is None]

    class Empty(types.ModuleType):
        def __getattr__(self, attribute):
            if attribute.startswith("__"):
                raise AttributeError(attribute)
            return type(attribute, (), {"__init__": lambda self, *a, **k: None, "__call__": lambda self, *a, **k: None,
                                        "__class_getitem__": classmethod(lambda cls, item: cls),
                                        "__init_subclass__": classmethod(lambda cls, **k: None)})

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            return importlib.machinery.ModuleSpec(name, self, is_package=True) if name.split(".")[0] in missing else None

        def create_module(self, spec):
            module = Empty(spec.name)
            module.__path__ = []
            return module

        def exec_module(self, module):
            pass

    if missing:
        sys.meta_path.insert(0, Finder())
    return missing


def cpu_fields() -> dict[str, str]:
    """The first CPU's fields in ``/proc/cpuinfo`` (``model name``, ``flags``, ...); {} where there is no such file."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first CPU's
    return fields


def cpu_name() -> str:
    """This CPU's model name (``/proc/cpuinfo``), or what ``platform`` says where there is none."""
    return cpu_fields().get("model name") or platform.processor() or platform.machine()


def cpu_key() -> str:
    """This CPU as the per-machine caches name it: its model name and a digest of its ``/proc/cpuinfo`` flags. Two
    CPUs can share a name and not their instruction sets ("AMD EPYC" with and without AVX-512 here): a product timed
    on one, or a kernel compiled for it with ``-march=native``, does not hold on the other."""
    flags = cpu_fields().get("flags", "")
    return f"{cpu_name()} flags {hashlib.sha1(flags.encode()).hexdigest()[:8]}" if flags else cpu_name()


def answers_file(file: str) -> Path:
    """Where a file of per-machine answers lives: ``$SPECRESEARCH_ANSWERS/<file>`` where that is set (the test suite
    sets it to a temporary folder, so that timings taken under its load never steer the defaults of later runs), else
    ``<cache_dir>/<file>``."""
    root = os.environ.get("SPECRESEARCH_ANSWERS")
    return Path(root) / file if root else cache_dir(file)


def cached_answer(file: str, key: str):
    """The JSON value kept under ``key`` in :func:`answers_file` ``(file)`` by :func:`keep_answer`, or None (no file,
    no entry, or a file that does not parse)."""
    try:
        return json.loads(answers_file(file).read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def keep_answer(file: str, key: str, value) -> None:
    """Keep ``value`` (JSON) under ``key`` in :func:`answers_file` ``(file)`` for later processes; a write that fails
    (a read-only cache) is not an error: the answer is timed again next time."""
    path = answers_file(file)
    try:
        table = json.loads(path.read_text()) if path.exists() else {}
        table = table if isinstance(table, dict) else {}
        table[key] = value
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table, indent=1) + "\n")
    except (OSError, ValueError):
        pass
