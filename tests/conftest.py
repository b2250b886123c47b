import atexit
import os
import shutil
import tempfile

import pytest

# Two cores on the reference machine: keep torch from oversubscribing when pytest-xdist runs 2 workers.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# No hub, ever: huggingface_hub reads this once, at its import, so it must be set before any test imports
# transformers (the CLI sets it too, but only for a process whose first import of transformers is its own).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# CausalLM on CPU times SkinnyLinear against nn.Linear when it loads and keeps the faster path per row count;
# tests pin every row count to SkinnyLinear so that what they run does not depend on the machine's timings.
os.environ.setdefault("SPECRESEARCH_SKINNY_ROWS", "all")
# Answers a run times once per machine (the cost curve of the default configuration, the skinny rows) go to a folder
# of this session: timed under the suite's load they would steer the defaults of the user's later runs.
if "SPECRESEARCH_ANSWERS" not in os.environ:
    os.environ["SPECRESEARCH_ANSWERS"] = tempfile.mkdtemp(prefix="specresearch-answers-")
    atexit.register(shutil.rmtree, os.environ["SPECRESEARCH_ANSWERS"], True)


@pytest.fixture(autouse=True)
def _torch_threads():
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return
    torch.set_num_threads(1)


@pytest.fixture
def brief_cost_timing(monkeypatch):
    """The machine's step costs (``engine.cost.measure_cost_curve``) timed for real, but briefly: 3 repeats, 16 tokens,
    one round (the default configuration's own timing takes a minute of a test)."""
    import specresearch.engine.cost as cost

    measure = cost.measure_cost_curve
    monkeypatch.setattr(cost, "measure_cost_curve",
                        lambda *a, **k: measure(*a, **{**k, "repeats": 3, "new_tokens": 16, "rounds": 1}))
