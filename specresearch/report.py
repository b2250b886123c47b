"""Execute the notebooks headless and write the report (executed notebooks, HTML, PNG figures).

This is the main job of the README: ``specresearch report`` runs every notebook in ``notebooks/``
top to bottom in a fresh kernel and writes ``reports/<name>.ipynb``, ``reports/<name>.html`` and the
figures the notebooks save under ``reports/figures/``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from specresearch.plotting import FIGURES_ENV


@dataclass(frozen=True)
class NotebookRun:
    """What executing one notebook produced."""

    notebook: Path
    executed: Path
    html: Path | None
    seconds: float


def find_notebooks(directory: str | os.PathLike = "notebooks") -> list[Path]:
    """The numbered notebooks of ``directory`` in order (``NN_name.ipynb``)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"notebook directory {str(directory)!r} does not exist; run from the repository root")
    return sorted(p for p in directory.glob("[0-9][0-9]_*.ipynb"))


def execute_notebook(
    notebook: str | os.PathLike,
    out_dir: str | os.PathLike = "reports",
    *,
    quick: bool = False,
    timeout: int = 1800,
    html: bool = True,
) -> NotebookRun:
    """Run ``notebook`` in a fresh kernel (cwd = repository root) and write the executed copy.

    Args:
        notebook: path to an ``.ipynb``.
        out_dir: where the executed notebook, its HTML and ``figures/`` go.
        quick: sets ``SPECRESEARCH_QUICK=1`` for the kernel, so notebooks shrink their parameters.
        timeout: seconds allowed per cell.
        html: also export HTML (nbconvert).
    Raises:
        nbclient.exceptions.CellExecutionError: a cell failed (its traceback is in the message).
    """
    import nbformat
    from nbclient import NotebookClient

    notebook, out_dir = Path(notebook), Path(out_dir)
    if not notebook.is_file():
        raise ValueError(f"notebook {str(notebook)!r} does not exist")
    out_dir.mkdir(parents=True, exist_ok=True)
    nb = nbformat.read(notebook, as_version=4)
    env_backup = {k: os.environ.get(k) for k in ("SPECRESEARCH_QUICK", FIGURES_ENV)}
    os.environ["SPECRESEARCH_QUICK"] = "1" if quick else "0"
    os.environ[FIGURES_ENV] = str((out_dir / "figures").resolve())
    start = time.perf_counter()
    try:
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(Path.cwd())}})
        client.execute()
    finally:
        for key, value in env_backup.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    seconds = time.perf_counter() - start
    executed = out_dir / notebook.name
    nbformat.write(nb, executed)
    html_path = _export_html(nb, out_dir / f"{notebook.stem}.html") if html else None
    return NotebookRun(notebook, executed, html_path, seconds)


def _export_html(nb, path: Path) -> Path:
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_notebook_node(nb)
    path.write_text(body, encoding="utf-8")
    return path


def run_report(notebooks_dir="notebooks", out_dir="reports", *, quick=False, only=None) -> list[NotebookRun]:
    """Execute every numbered notebook (or those whose name contains one of ``only``) into ``out_dir``."""
    from tqdm.auto import tqdm

    paths = find_notebooks(notebooks_dir)
    if only:
        paths = [p for p in paths if any(key in p.name for key in only)]
        if not paths:
            raise ValueError(f"only={only!r} matches no notebook in {notebooks_dir}")
    runs = []
    for path in tqdm(paths, desc="notebooks", unit="nb"):
        runs.append(execute_notebook(path, out_dir, quick=quick))
        tqdm.write(f"{path.name}: {runs[-1].seconds:.1f} s -> {runs[-1].html}")
    return runs
