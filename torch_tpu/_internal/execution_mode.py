"""``torch_tpu._internal.execution_mode``: the reference's eager-mode names, on torch.tpu's modes.

- ``em.eager_mode = EagerMode.X`` switches the process; ``with em.eager_mode(EagerMode.X):``
  switches for the block; ``em.set_eager_mode(EagerMode.X)`` switches now and, used as a context
  manager, back at the block's end; ``em.get_eager_mode()`` reads the mode.
- ``EagerMode``: ``DEFER_NEVER`` (Strict), ``DEFER_NEVER_AND_LAUNCH_BLOCKING`` (Debug),
  ``DEFER_AND_FUSE``, ``INTERNAL_DEFER_ALL`` (the same as ``DEFER_AND_FUSE`` here) and the
  deprecated ``DEFER_AND_FUSE_WITH_O1`` (``eager/modes.py``).
- The older names: ``DeferMode`` (``DEFAULT`` and ``ALL`` defer and fuse, ``NEVER`` is Strict),
  ``set_defer_mode``, ``get_defer_mode``, ``defer_mode(...)``.
- ``cpu_fallback_mode(enabled)``: ops without a lowering run on CPU inside the block, or are
  refused (``enable_cpu_fallback`` / ``is_cpu_fallback_enabled`` for the process).
"""

from __future__ import annotations

import contextlib
import enum
import sys
import types

from torchtpu.eager import fallback, modes

EagerMode = modes.EagerMode
get_eager_mode = modes.get_eager_mode


class set_eager_mode:  # noqa: N801 (a function to its callers, as the reference's)
    """Switch the process to mode now; used as a context manager, back to the previous mode at
    its end (the reference's scripts use it both ways)."""

    def __init__(self, mode: EagerMode) -> None:
        self._previous = modes.get_eager_mode()
        modes.switch(mode)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        modes.switch(self._previous)


@contextlib.contextmanager
def _eager_mode(mode: EagerMode):
    """Mode for the block (switched as it is entered)."""
    with modes.set_eager_mode(mode):
        yield


class DeferMode(enum.Enum):
    DEFAULT = EagerMode.DEFER_AND_FUSE
    ALL = EagerMode.INTERNAL_DEFER_ALL
    NEVER = EagerMode.DEFER_NEVER


def _as_eager(mode) -> EagerMode:
    if isinstance(mode, DeferMode):
        return mode.value
    raise TypeError(f"torchtpu.argument: a DeferMode is expected, not {mode!r}")


def set_defer_mode(mode: DeferMode) -> None:
    modes.switch(_as_eager(mode))


def get_defer_mode() -> DeferMode:
    if modes.get_eager_mode() in (EagerMode.DEFER_NEVER, EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING):
        return DeferMode.NEVER
    return DeferMode.DEFAULT


@contextlib.contextmanager
def defer_mode(mode: DeferMode):
    with modes.set_eager_mode(_as_eager(mode)):
        yield


def cpu_fallback_mode(enabled: bool):
    return fallback.allowed(enabled)


def enable_cpu_fallback(enabled: bool) -> None:
    fallback.allow(enabled)


def is_cpu_fallback_enabled() -> bool:
    return fallback.policy() != "error"


class _Module(types.ModuleType):
    """``eager_mode`` reads as the context manager and assigns as the process's mode."""

    @property
    def eager_mode(self):
        return _eager_mode

    @eager_mode.setter
    def eager_mode(self, mode: EagerMode) -> None:
        modes.switch(mode)


sys.modules[__name__].__class__ = _Module

__all__ = ["DeferMode", "EagerMode", "cpu_fallback_mode", "defer_mode",
           "enable_cpu_fallback", "get_defer_mode", "get_eager_mode", "is_cpu_fallback_enabled",
           "set_defer_mode", "set_eager_mode"]
