"""Every numbered notebook runs top to bottom headless (quick parameters) and writes its figures."""

from pathlib import Path

import pytest

from specresearch.report import execute_notebook, find_notebooks

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = find_notebooks(ROOT / "notebooks")


@pytest.mark.slow
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(notebook, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    run = execute_notebook(notebook, tmp_path, quick=True, timeout=900, html=False)
    assert run.executed.is_file()
    import nbformat

    nb = nbformat.read(run.executed, as_version=4)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no numbered notebook"
