"""Execute the notebooks headless and write the report (executed notebooks, HTML, PNG figures).

This is the main job of the README: ``specresearch report`` runs every notebook in ``notebooks/``
top to bottom in a fresh kernel and writes ``reports/<name>.ipynb``, ``reports/<name>.html`` and the
figures the notebooks save under ``reports/figures/``; a full (not ``--quick``) run then copies the
figures the README and ``docs/`` show (``DOCS_FIGURES``) to ``docs/figures/``, which are committed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from specresearch.experiments.plotting import FIGURES_ENV

__all__ = ["DOCS_FIGURES", "KERNEL_TEARDOWN_NOISE", "KERNEL_TEARDOWN_TRACEBACK", "NotebookRun", "execute_notebook", "find_notebooks", "publish_figures",
           "run_report"]

# Figures shown in README.md and docs/ (stems of reports/figures/*.png), refreshed by every full main job.
DOCS_FIGURES = (
    "01_two_symbol_counterexample",
    "03_block_gain_heatmap",
    "04_expected_tokens",
    "05_be_vs_gamma",
    "05_be_gain_vs_temperature",
    "05_gain_vs_alpha",
    "07_losslessness",
    "09_acceptance_by_depth",
    "10_draft_trees",
    "10_tree_step_costs",
    "10_trees_cpu_gpu",
    "11_lossy_frontier",
    "12_engines_executed",
    "09_data_scaling",
    "09_alpha_vs_cost",
    "09_speedup_vs_gamma",
    "09_combined_draft",
    "09_speedup_intervals",
)


# libzmq can abort the kernel process while it terminates its context at shutdown, after every cell has
# run and replied (zeromq/libzmq#1307, #3715: poll() reports POLLHUP on a closing signaler pipe). It says
# nothing about the notebook; the run keeps the line in ``kernel_stderr`` but it is not a kernel message.
KERNEL_TEARDOWN_NOISE = ("Assertion failed: pfd.revents & POLLIN",)
# ipykernel can also answer the shutdown request (``process_control``) by flushing stdout through an iopub
# pipe already closed; tornado logs that as one traceback ending in this error. Such a traceback (and only
# one that passes through ``process_control``) is left out whole.
KERNEL_TEARDOWN_TRACEBACK = ("ERROR:tornado.general:Uncaught exception in ZMQStream callback", "process_control",
                             "zmq.error.ZMQError: Socket operation on non-socket")


@dataclass(frozen=True)
class NotebookRun:
    """What executing one notebook produced."""

    notebook: Path
    executed: Path
    html: Path | None
    seconds: float
    kernel_stderr: str = ""
    """What the kernel process wrote to its stderr (outside any cell's output), start to shutdown."""

    def kernel_messages(self) -> list[str]:
        """The lines of ``kernel_stderr`` other than ``KERNEL_TEARDOWN_NOISE`` and the shutdown traceback of
        ``KERNEL_TEARDOWN_TRACEBACK``."""
        lines, kept = self.kernel_stderr.splitlines(), []
        start, through, error = KERNEL_TEARDOWN_TRACEBACK
        i = 0
        while i < len(lines):
            if lines[i].startswith(start):  # the block runs to its exception line, the first unindented one after
                end = next((j for j in range(i + 2, len(lines)) if lines[j] and not lines[j][0].isspace()), len(lines) - 1)
                block = lines[i : end + 1]
                if lines[end].startswith(error) and any(through in line for line in block):
                    i = end + 1
                    continue
            kept.append(lines[i])
            i += 1
        return [line for line in kept if line.strip() and not any(noise in line for noise in KERNEL_TEARDOWN_NOISE)]


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
    """Run ``notebook`` in a fresh kernel, started in its folder as JupyterLab starts it, and write the executed copy.

    A notebook that reads a path relative to the repository root fails here as it would in JupyterLab: notebooks
    reach the repository's files through ``specresearch.paths.repo_root()``.

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
    # The kernel inherits this process's environment. Nobody watches a headless kernel's stderr, so the
    # per-model "Loading weights" bars of transformers stay out of the executed notebooks.
    kernel_env = {"SPECRESEARCH_QUICK": "1" if quick else "0", FIGURES_ENV: str((out_dir / "figures").resolve()),
                  "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    env_backup = {k: os.environ.get(k) for k in kernel_env}
    os.environ.update(kernel_env)
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="specresearch-kernel-") as sockets:
            client = NotebookClient(nb, timeout=timeout, kernel_name="python3", config=_kernel_config(sockets),
                                    resources={"metadata": {"path": str(notebook.resolve().parent)}})
            # The kernel's own stderr (not its cells' output, which goes to the notebook) is kept with the
            # run instead of being interleaved with this process's.
            log = Path(sockets) / "kernel-stderr.txt"
            try:
                with log.open("wb") as stderr:
                    client.execute(stderr=stderr)
            finally:
                kernel_stderr = log.read_text(errors="replace") if log.is_file() else ""
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
    return NotebookRun(notebook, executed, html_path, seconds, kernel_stderr)


def _kernel_config(socket_dir: str):
    """Kernel over local IPC sockets in ``socket_dir``: the kernel talks to this process only, and the
    plain-TCP transport (which makes ipykernel print an encryption warning per notebook) is not used."""
    from traitlets.config import Config

    return Config({"KernelManager": {"transport": "ipc", "ip": os.path.join(socket_dir, "kernel")}})


def _export_html(nb, path: Path) -> Path:
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_notebook_node(nb)
    path.write_text(body, encoding="utf-8")
    return path


def publish_figures(figures_dir: str | os.PathLike, dest: str | os.PathLike, *, since: float = 0.0,
                    names: tuple[str, ...] = DOCS_FIGURES) -> list[Path]:
    """Copy ``<figures_dir>/<name>.png`` for each of ``names`` written at or after ``since`` (a
    ``time.time()``) to ``dest``; figures not written by the run in question are left as they are.

    Returns the paths written under ``dest``.
    """
    figures_dir, dest = Path(figures_dir), Path(dest)
    fresh = [figures_dir / f"{n}.png" for n in names
             if (figures_dir / f"{n}.png").is_file() and (figures_dir / f"{n}.png").stat().st_mtime >= since]
    if fresh:
        dest.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copyfile(src, dest / src.name)) for src in fresh]


def run_report(notebooks_dir="notebooks", out_dir="reports", *, quick=False, only=None,
               docs_figures: str | os.PathLike | None = "docs/figures") -> list[NotebookRun]:
    """Execute every numbered notebook (or those whose name contains one of ``only``) into ``out_dir``.

    Unless ``quick`` (small parameters) or ``docs_figures`` is None, the ``DOCS_FIGURES`` this run wrote
    are then copied to ``docs_figures``.
    """
    from tqdm.auto import tqdm

    paths = find_notebooks(notebooks_dir)
    if only:
        paths = [p for p in paths if any(key in p.name for key in only)]
        if not paths:
            raise ValueError(f"only={only!r} matches no notebook in {notebooks_dir}")
    runs, start = [], time.time()
    for path in tqdm(paths, desc="notebooks", unit="nb"):
        runs.append(execute_notebook(path, out_dir, quick=quick))
        tqdm.write(f"{path.name}: {runs[-1].seconds:.1f} s -> {runs[-1].html}")
        for line in runs[-1].kernel_messages():
            tqdm.write(f"  kernel stderr: {line}")
    if not quick and docs_figures is not None:
        copied = publish_figures(Path(out_dir) / "figures", docs_figures, since=start)
        if copied:
            tqdm.write(f"{len(copied)} figures -> {docs_figures}/: {', '.join(p.stem for p in copied)}")
    return runs
