"""Every numbered notebook runs top to bottom headless (quick parameters; the kernel starts in the notebook's folder,
as in JupyterLab), writes its figures, and runs quietly: no error, no stderr output in any cell, nothing from the
kernel process on its own stderr (which the runner keeps with the run) or on this process's. Its words match its
numbers: every decimal or percentage in its markdown appears in the outputs of that run (a notebook states a number
by printing it, or names the record it reads), citations of papers' sections and inline code aside."""

import os
import re
import time
from pathlib import Path

import nbformat
import pytest

from specresearch.experiments.report import (
    DOCS_FIGURES,
    KERNEL_TEARDOWN_NOISE,
    KERNEL_TEARDOWN_TRACEBACK,
    NotebookRun,
    execute_notebook,
    find_notebooks,
    publish_figures,
)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = find_notebooks(ROOT / "notebooks")


def _outputs(path: Path, kind: str) -> list:
    nb = nbformat.read(path, as_version=4)
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.output_type == kind or o.get("name") == kind]


PROSE_NUMBER = re.compile(r"(?<![\w.])(\d+\.\d+|\d+(?:\.\d+)?%)(?![\w])")
CITED = re.compile(r"`[^`]*`|\b(?:Cor|Thm|Theorem|Sec|Fig|Eq|Lemma|Prop|Table|Alg)\.?\s*\d+(?:\.\d+)*|\b\d{4}\.\d{4,5}\b")


def unprinted_numbers(path: Path) -> list[str]:
    """The decimals and percentages of an executed notebook's markdown that none of its outputs contain."""
    nb = nbformat.read(path, as_version=4)
    printed = []
    for cell in nb.cells:
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            printed.append(output.get("text", ""))
            printed += ["".join(v) if isinstance(v, list) else v for k, v in output.get("data", {}).items()
                        if k.startswith("text/")]
    text = "\n".join(printed)
    prose = [CITED.sub(" ", cell.source) for cell in nb.cells if cell.cell_type == "markdown"]
    return [n for source in prose for n in PROSE_NUMBER.findall(source) if n not in text]


def test_unprinted_numbers_are_found(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("alpha is 0.42 and 12% gain (Cor. 3.9, `gamma 1.5`, arXiv 2211.17192)"),
                nbformat.v4.new_code_cell("print(0.41)")]
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="0.41 and 12%\n")]
    (tmp_path / "n.ipynb").write_text(nbformat.writes(nb))
    assert unprinted_numbers(tmp_path / "n.ipynb") == ["0.42"]


ANNOUNCED = re.compile(r"\[specresearch\] timing .+ on this CPU \(\d+ MB of the model's weights, at most ~\d+ s\); once "
                       r"per machine, kept in <cache>/\w+\.json$")


@pytest.mark.slow
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(notebook, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(ROOT)
    run = execute_notebook(notebook, tmp_path, quick=True, timeout=900, html=False)
    assert run.executed.is_file()
    assert not _outputs(run.executed, "error")
    assert unprinted_numbers(run.executed) == [], "the notebook's prose states numbers its run did not print"
    # quiet: no warnings or progress bars written by the cells, no transport warnings from the kernel; the one line a
    # once-per-machine kernel calibration announces is said on purpose (the suite's answers live in a folder of its
    # own, so a notebook run alone calibrates there; run in the suite it finds an earlier test's answers)
    said = [o.text for o in _outputs(run.executed, "stderr")]
    unannounced = [line for text in said for line in text.splitlines() if not ANNOUNCED.match(line)]
    assert not unannounced, [line[:300] for line in unannounced]
    assert run.kernel_messages() == []
    assert capfd.readouterr().err == ""


@pytest.mark.slow
def test_kernel_runs_on_this_interpreter_in_the_notebooks_folder_quietly(tmp_path, capfd):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "import os, sys\nprint(sys.executable)\nprint(os.environ['HF_HUB_DISABLE_PROGRESS_BARS'])\nprint(os.getcwd())")]
    (tmp_path / "01_env.ipynb").write_text(nbformat.writes(nb))
    before = os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS")
    run = execute_notebook(tmp_path / "01_env.ipynb", tmp_path / "out", quick=True, html=False)
    executable, bars_off, cwd = _outputs(run.executed, "stdout")[0].text.split()
    import sys

    assert Path(executable).resolve().parent == Path(sys.executable).resolve().parent
    assert bars_off == "1"
    assert Path(cwd) == tmp_path.resolve()  # the kernel starts in the notebook's folder, as in JupyterLab
    assert os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") == before  # the runner restores its environment
    assert run.kernel_messages() == []
    assert capfd.readouterr().err == ""


@pytest.mark.slow
def test_the_kernels_own_stderr_is_kept_with_the_run_not_printed(tmp_path, capfd):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import atexit, os\natexit.register(os.write, 2, b'said at exit\\n')")]
    (tmp_path / "01_exit.ipynb").write_text(nbformat.writes(nb))
    run = execute_notebook(tmp_path / "01_exit.ipynb", tmp_path / "out", quick=True, html=False)
    assert run.kernel_messages() == ["said at exit"]
    assert capfd.readouterr().err == ""


def test_kernel_messages_leave_out_only_the_known_teardown_abort(tmp_path):
    noise = f"{KERNEL_TEARDOWN_NOISE[0]} (src/signaler.cpp:238)"
    run = NotebookRun(tmp_path / "a.ipynb", tmp_path / "a.ipynb", None, 1.0, f"{noise}\nTraceback: boom\n\n")
    assert run.kernel_messages() == ["Traceback: boom"]
    assert NotebookRun(tmp_path / "a.ipynb", tmp_path / "a.ipynb", None, 1.0, noise).kernel_messages() == []
    start, through, error = KERNEL_TEARDOWN_TRACEBACK
    teardown = [start, "Traceback (most recent call last):", '  File "kernelbase.py", line 372, in dispatch_control',
                f"    await self.{through}(msg)", '  File "socket.py", line 713, in send', f"{error}"]
    other = [start, "Traceback (most recent call last):", '  File "kernelbase.py", line 500, in dispatch_shell', f"{error}"]
    run = NotebookRun(tmp_path / "a.ipynb", tmp_path / "a.ipynb", None, 1.0, "\n".join(["before", *teardown, "after"]))
    assert run.kernel_messages() == ["before", "after"]  # the shutdown traceback goes whole, nothing else does
    run = NotebookRun(tmp_path / "a.ipynb", tmp_path / "a.ipynb", None, 1.0, "\n".join(other))
    assert run.kernel_messages() == other  # the same error outside the shutdown request is a kernel message


def test_publish_figures_copies_only_the_listed_figures_written_by_this_run(tmp_path):
    src, dest = tmp_path / "figures", tmp_path / "docs" / "figures"
    src.mkdir()
    stale, fresh = DOCS_FIGURES[0], DOCS_FIGURES[1]
    (src / f"{stale}.png").write_bytes(b"old")
    os.utime(src / f"{stale}.png", (1e9, 1e9))
    since = time.time() - 1
    (src / f"{fresh}.png").write_bytes(b"new")
    (src / "99_not_listed.png").write_bytes(b"new")
    copied = publish_figures(src, dest, since=since)
    assert copied == [dest / f"{fresh}.png"]
    assert sorted(p.name for p in dest.iterdir()) == [f"{fresh}.png"]
    assert (dest / f"{fresh}.png").read_bytes() == b"new"


def test_docs_figures_are_written_by_a_notebook():
    sources = "".join(p.read_text() for p in NOTEBOOKS)
    for name in DOCS_FIGURES:
        assert f"'{name}'" in sources or f'\\"{name}\\"' in sources, name
        assert (ROOT / "docs" / "figures" / f"{name}.png").is_file(), f"docs/figures/{name}.png is not committed"


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no numbered notebook"
