import os

import pytest

# Two cores on the reference machine: keep torch from oversubscribing when pytest-xdist runs 2 workers.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _torch_threads():
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return
    torch.set_num_threads(1)
