"""Strict runs each optimizer step over tpu parameters as one program.

PyTorch's default optimizers are ``foreach`` ones: an ``AdamW.step()`` is ~8 ``_foreach_*``
calls, each a full read and write of the parameters or their state. Run one by one (Strict's
way), a 218 M-parameter step moves ~20 GB; as one program XLA fuses them into one pass per
parameter (~7 GB, what ``fused=True`` or a compiled step moves). PyTorch itself does not default
to ``fused`` on any device (``_default_to_fused_or_foreach`` is called with ``use_fused=False``
"to give the fused impl bake-in time"), so the step is fused here instead, whatever the
optimizer: between PyTorch's global optimizer step hooks (``register_optimizer_step_pre_hook``
and ``..._post_hook``) the executor is DeferAndFuse's (``eager/defer.py``), and the step's end
runs what it recorded as one program. Each step records the same structure, so the program is
compiled once; Python numbers that change each step (a bias correction, a scheduler's ``lr``)
are inputs of it, not constants. The first step's state (AdamW's moments, made by
``_init_group``) is made eagerly, outside the recording (``DeferAndFuse.adopt``).

Only Strict's steps: Debug runs op by op on purpose, DeferAndFuse records them anyway, a capture
(``torch.tpu.graph``, a whole step) records into its own program, and Dynamo tracing a step
(``torch.compile``) sees hooks that do nothing. Eager size buckets are off inside a step (as in a
``torch_xla.compile`` region): a ``foreach=False`` optimizer's per-parameter calls would look
like growth to them. A host read inside the step (a custom optimizer's ``.item()``) runs what is
recorded so far, as under DeferAndFuse. A step that raises never reaches the post hook: what it
recorded stays pending, correct, until the next host read or the next step's start runs it.
Only the main thread's steps (a training loop's): the process has one recording, and a step on
another thread (ranks run as threads, a worker thread) may meet other threads' ops running
meanwhile, which would read the recording's pending values. ``TORCHTPU_FUSED_STEPS=0`` keeps
Strict's op-by-op steps.
"""

from __future__ import annotations

import os
import sys
import threading

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from torchtpu.compile import eager_buckets
from torchtpu.eager import executor
from torchtpu.eager.defer_executor import DeferAndFuse


class StepRegion(DeferAndFuse):
    """DeferAndFuse for the length of one optimizer step; leaving it runs the step."""

    def __init__(self, previous: executor.Strict, frame) -> None:
        super().__init__()
        self.previous = previous
        self._buckets = False
        # The frame of the step call that opened the region, and how many step calls run inside
        # it: a subclass's step calling super().step() runs the global hooks again, nested.
        self.frame = frame
        self.nested = 0

    def enter(self) -> None:
        # Not DeferAndFuse.enter: its own step hook would be added to the hooks PyTorch is
        # running, and the step's end is this region's to handle.
        self.start_recording()
        self._buckets = eager_buckets.enabled()
        eager_buckets.set_enabled(False)

    def leave(self) -> None:
        self.forget_adopted()
        eager_buckets.set_enabled(self._buckets)
        self.stop_recording()


def _on_tpu(opt: torch.optim.Optimizer) -> bool:
    return any(p.device.type == "tpu" for group in opt.param_groups for p in group["params"])


def _on_stack(frame) -> bool:
    f = sys._getframe(1)
    while f is not None:
        if f is frame:
            return True
        f = f.f_back
    return False


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _before(opt, args, kwargs) -> None:
    if torch.compiler.is_compiling() or not _main_thread():
        return
    current = executor.current()
    if isinstance(current, StepRegion):
        if _on_stack(current.frame):  # a step called inside the open one's step
            current.nested += 1
            return
        executor.set_current(current.previous)  # the last step raised: its ops run first
        current = executor.current()
    if type(current) is executor.Strict and _on_tpu(opt):
        region = StepRegion(current, sys._getframe(1))
        executor.set_current(region)
        region.adopt(opt)


def _after(opt, args, kwargs) -> None:
    if torch.compiler.is_compiling() or not _main_thread():
        return
    current = executor.current()
    if isinstance(current, StepRegion):
        if current.nested:
            current.nested -= 1
            return
        executor.set_current(current.previous)


_handles: list = []


def enabled() -> bool:
    return bool(_handles)


def set_enabled(on: bool) -> None:
    """Run Strict's optimizer steps as one program each (the default), or op by op."""
    if on and not _handles:
        _handles.extend([register_optimizer_step_pre_hook(_before),
                         register_optimizer_step_post_hook(_after)])
    elif not on:
        while _handles:
            _handles.pop().remove()


def install() -> None:
    set_enabled(os.environ.get("TORCHTPU_FUSED_STEPS", "1") != "0")
