"""Models: the model and draft Protocols, the causal-LM wrapper (KV cache, rollback), CPU kernels, embedded models.

* :mod:`~specresearch.models.causal_lm` -- :class:`CausalLM`, a transformers causal LM behind prefill / score / rollback.
* :mod:`~specresearch.models.embedded` -- the offline target shipped inside a PyPI wheel (SmolLM2-135M-Instruct).
"""

from importlib.metadata import PackageNotFoundError, version

from specresearch.checks import OutdatedDependency
from specresearch.config import TRANSFORMERS_FLOOR

__all__ = ["check_transformers"]


def check_transformers(installed: str | None = None) -> None:
    """Raise :class:`~specresearch.checks.OutdatedDependency` (an ``ImportError``) unless transformers (``installed``;
    default: the installed version) is at least ``config.TRANSFORMERS_FLOOR``. An environment made without pip's
    resolver (``--no-deps``, conda, PYTHONPATH) would otherwise fail deep inside a model load, naming neither the
    version nor the fix."""
    from packaging.version import Version

    if installed is None:
        try:
            installed = version("transformers")
        except PackageNotFoundError:  # transformers' own import then says it is missing
            return
    if Version(installed) < Version(TRANSFORMERS_FLOOR):
        raise OutdatedDependency(f"transformers {installed} is installed, and specresearch needs "
                                 f">= {TRANSFORMERS_FLOOR}: pip install -U 'transformers>={TRANSFORMERS_FLOOR}' "
                                 "(docs/environments.md)")


check_transformers()
