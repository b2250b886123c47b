"""A record of what ``CausalLM``'s mends change on a model, so that a caller's model can be handed back as it was built.

The mends that make a family's cached calls exact (``models.positions``, ``models.recurrent.clamp_time_steps``,
``models.griffin``, ``models.rotary``) work on the model in place: an attribute set, a forward replaced, a hook
registered, a buffer rewritten. Each goes through :func:`set_attribute`, :func:`keep_hook` or :func:`keep_undo`, which
log how to undo it on the model; :func:`undo_mends` undoes them, last first (``engine.hf``, which borrows
transformers' model for one ``generate`` call and must leave it as it was).
"""

from __future__ import annotations

from functools import partial

__all__ = ["set_attribute", "keep_hook", "keep_undo", "undo_mends"]

_LOG = "specresearch_mends"  # on the model: the undo steps, in the order the mends ran


def _log(model) -> list:
    log = vars(model).get(_LOG)
    if log is None:
        log = []
        object.__setattr__(model, _LOG, log)  # a plain attribute, not a submodule
    return log


def set_attribute(model, owner, name: str, value) -> None:
    """``owner.name = value``, logged on ``model`` with what was there (an attribute of the instance, a buffer, or
    none: the class's, which the undo uncovers again)."""
    held = name in vars(owner) or name in (getattr(owner, "_buffers", None) or {}) or name in (
        getattr(owner, "_parameters", None) or {})
    _log(model).append(partial(_restore, owner, name, held, getattr(owner, name, None) if held else None))
    setattr(owner, name, value)


def keep_hook(model, handle) -> None:
    """Log a hook's ``handle`` (``register_forward_hook`` / ``register_forward_pre_hook``) on ``model``."""
    keep_undo(model, handle.remove)


def keep_undo(model, undo) -> None:
    """Log ``undo()`` on ``model`` (a buffer's values copied back, say)."""
    _log(model).append(undo)


def undo_mends(model) -> int:
    """Undo every logged mend of ``model``, last first; returns how many steps it undid."""
    log = vars(model).pop(_LOG, None) or []
    for undo in reversed(log):
        undo()
    return len(log)


def _restore(owner, name: str, held: bool, value) -> None:
    if held:
        setattr(owner, name, value)
    elif name in vars(owner):
        delattr(owner, name)
