"""The eager modes of ``torch.tpu.EagerMode`` and how the process picks one.

``TORCH_TPU_LAUNCH_BLOCKING=1`` (or the reference's ``TPU_LAUNCH_BLOCKING=1``) starts in Debug,
``TORCH_TPU_DEFER_AND_FUSE=1`` (``TPU_DEFER_AND_FUSE=1``) in DeferAndFuse. Leaving a mode flushes
what it holds, so pending values never cross a mode change unrun.

Two more names come from the reference's scripts. ``INTERNAL_DEFER_ALL`` holds every op pending
until a value is read: that is DeferAndFuse (factories included; a host-to-device copy is no
program and runs at once), so the name is an alias of ``DEFER_AND_FUSE``.
``DEFER_AND_FUSE_WITH_O1`` (deprecated there) is DeferAndFuse with programs compiled at
``xla_optimization_level=O1`` while the mode is on (``runtime/compiler_options``).

The mode is the process's, not a thread's: one executor serves every thread, and PyTorch's
autograd thread runs every thread's backward. Threads that entered different modes at once ran
one another's pending values through the wrong executor (a ``ValueError`` from deep inside JAX,
issue 37), so a thread may not change the mode while another thread is inside a
``set_eager_mode`` block: that raises ``torchtpu.unsupported``. Threads may share one mode (each
entering the same ``set_eager_mode`` block); the mode reverts when the last of them leaves.
"""

from __future__ import annotations

import contextlib
import enum
import os
import threading

from torchtpu import errors
from torchtpu.eager import defer_executor, executor


class EagerMode(enum.Enum):
    DEFER_NEVER = "strict"
    DEFER_NEVER_AND_LAUNCH_BLOCKING = "debug"
    DEFER_AND_FUSE = "defer_and_fuse"
    INTERNAL_DEFER_ALL = "defer_and_fuse"  # the same mode (an alias: `is DEFER_AND_FUSE`)
    DEFER_AND_FUSE_WITH_O1 = "defer_and_fuse_o1"  # deprecated


_EXECUTORS = {
    EagerMode.DEFER_NEVER: executor.Strict,
    EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING: executor.Debug,
    EagerMode.DEFER_AND_FUSE: defer_executor.DeferAndFuse,
    EagerMode.DEFER_AND_FUSE_WITH_O1: defer_executor.DeferAndFuse,
}
# Compiler options a mode holds while it is on.
_OPTIONS = {EagerMode.DEFER_AND_FUSE_WITH_O1: {"xla_optimization_level": "O1"}}
_mode = [EagerMode.DEFER_NEVER]
_options = contextlib.ExitStack()  # the current mode's compiler options


def get_eager_mode() -> EagerMode:
    return _mode[0]


# Threads inside set_eager_mode blocks: each one's stack of the modes its blocks found on entry.
_held: dict[int, list[EagerMode]] = {}
_base: list[EagerMode | None] = [None]  # the mode found by the first block of all those open
_lock = threading.Lock()


def _check_others(mode: EagerMode, action: str) -> None:
    me = threading.get_ident()
    others = [t for t in _held if t != me]
    if others and mode is not _mode[0]:
        names = {t.ident: t.name for t in threading.enumerate()}
        raise RuntimeError(
            f"torchtpu.unsupported: {action} {mode} on thread {threading.current_thread().name!r} "
            f"while thread {names.get(others[0], others[0])!r} runs in {_mode[0]} (a "
            "set_eager_mode block): the eager mode is per process, not per thread (one "
            "executor for all threads; PyTorch's autograd thread runs every thread's backward). "
            "Enter one mode for all threads, or run each mode in a process of its own")


def _switch(mode: EagerMode) -> None:
    if not isinstance(mode, EagerMode):
        raise TypeError(f"torchtpu.argument: eager mode must be a torch.tpu.EagerMode, not "
                        f"{mode!r}")
    if mode is _mode[0]:
        return
    if mode is EagerMode.DEFER_AND_FUSE_WITH_O1:
        errors.warn("config", "EagerMode.DEFER_AND_FUSE_WITH_O1 is deprecated (as in the "
                    "reference): it runs DEFER_AND_FUSE with programs compiled at "
                    "xla_optimization_level=O1; use DEFER_AND_FUSE, and "
                    "torch.tpu.custom_compiler_options for the level", DeprecationWarning,
                    stacklevel=4)
    executor.set_current(_EXECUTORS[mode]())
    _options.close()
    if mode in _OPTIONS:
        from torchtpu.runtime import compiler_options

        _options.enter_context(compiler_options.custom_compiler_options(_OPTIONS[mode]))
    _mode[0] = mode


def switch(mode: EagerMode) -> None:
    """Make mode the process's (``torch.tpu.eager_mode = mode``)."""
    with _lock:
        _check_others(mode, "eager_mode =")
        _switch(mode)


@contextlib.contextmanager
def set_eager_mode(mode: EagerMode):
    me = threading.get_ident()
    with _lock:
        _check_others(mode, "set_eager_mode")
        if not _held:
            _base[0] = _mode[0]
        _held.setdefault(me, []).append(_mode[0])
        _switch(mode)
    try:
        yield
    finally:
        with _lock:
            stack = _held[me]
            previous = stack.pop()
            if not stack:
                del _held[me]
            if stack:  # back to this thread's outer block's mode
                _switch(previous)
            elif not _held:  # the last block open: the mode the first one found
                _switch(_base[0])


def from_environment() -> None:
    """The starting mode: ``TORCH_TPU_*`` names first, then the reference's ``TPU_*`` ones."""
    for prefix in ("TORCH_TPU_", "TPU_"):
        if os.environ.get(prefix + "DEFER_AND_FUSE") == "1":
            return switch(EagerMode.DEFER_AND_FUSE)
        if os.environ.get(prefix + "LAUNCH_BLOCKING") == "1":
            return switch(EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING)
