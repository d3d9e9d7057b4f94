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

``torch.nn.utils.clip_grad_norm_`` opens the region a step earlier: a training loop clips just
before it steps, and the clip is three more programs (the gradients' norms, their norm, the
gradients' multiply), a read and a write of every gradient that AdamW's pass reads again. Recorded
with the step, XLA fuses the multiply into the update: one program from the clip to the step's end.
The norm the clip returns is that program's output, or the recording's flush when read before (a
logging ``.item()``). A clip whose step never comes (a loop that clips to log the norm, a custom
optimizer outside ``torch.optim``'s hooks) must not leave the loop recording: the region ends, and
runs what it holds, at the next clip or at the ``CLIP_SLACK``-th op call after the clip returned.
Not where Strict holds lazy values (``lazy_casts``: an eager backward's gradients cast to float32
under autocast): the region's start would compute each alone, 15 launches more in a 2-layer
eager Llama step than the clip's three, which read them fused.
"""

from __future__ import annotations

import functools
import sys
import threading

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from torchtpu import settings
from torchtpu.compile import eager_buckets
from torchtpu.eager import executor, frozen, lazy_casts
from torchtpu.eager.defer_executor import DeferAndFuse, concrete
from torchtpu.eager.program import Spec
from torchtpu.lowering.registry import Lowering

# Op calls a region opened by a clip records after the clip returned and before its optimizer
# step's start; past them the step is taken not to come (a loop's between-clip-and-step work is a
# scheduler's or a scaler's few calls, or none).
CLIP_SLACK = 32


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
        # Opened by a clip that returned: op calls recorded since (None: a step is in the region).
        self.after_clip: int | None = None

    def run(self, lowering: Lowering, spec: Spec, dyn: tuple):
        if self.after_clip is not None:
            self.after_clip += 1
            if self.after_clip > CLIP_SLACK:  # no step came: what the clip recorded runs now
                executor.set_current(self.previous)
                return self.previous.run(lowering, spec, concrete(dyn))
        return super().run(lowering, spec, dyn)

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
        if current.after_clip is not None:  # the step the clip opened the region for
            current.after_clip = None
            current.frame = sys._getframe(1)
            current.adopt(opt)
            return
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
        # The end of a Strict loop's step: where its collector's freeze is decided.
        frozen.STRICT_LOOP.step_ended()


def _clip_opening(original):
    """``clip_grad_norm_`` that opens the step's region (see the module's doc) where Strict runs
    and a gradient is on tpu."""

    @functools.wraps(original)
    def clip_grad_norm_(parameters, *args, **kwargs):
        if torch.compiler.is_compiling() or not _handles or not _main_thread():
            return original(parameters, *args, **kwargs)
        if not isinstance(parameters, torch.Tensor):
            parameters = list(parameters)  # (a generator, read here and by the clip)
        current = executor.current()
        if isinstance(current, StepRegion) and current.after_clip is not None:
            executor.set_current(current.previous)  # the last clip's step never came
            current = executor.current()
        grads = [p.grad for p in ([parameters] if isinstance(parameters, torch.Tensor)
                                  else parameters) if p.grad is not None]
        if type(current) is not executor.Strict or lazy_casts.any_pending() \
                or not any(g.device.type == "tpu" for g in grads):
            # (Strict's held values, an eager backward's gradient casts among them, would each
            # run alone at the region's start: the clip's own programs read them, fused.)
            return original(parameters, *args, **kwargs)
        region = StepRegion(current, None)
        executor.set_current(region)
        try:
            norm = original(parameters, *args, **kwargs)
        except BaseException:
            executor.set_current(current)
            raise
        region.after_clip = 0
        return norm

    clip_grad_norm_.torchtpu_original = original
    return clip_grad_norm_


def _wrap_clip() -> None:
    from torch.nn.utils import clip_grad

    if not hasattr(clip_grad.clip_grad_norm_, "torchtpu_original"):
        # clip_grad's own ``clip_grad_norm`` calls the module's name: both spellings are served.
        clip_grad.clip_grad_norm_ = torch.nn.utils.clip_grad_norm_ = _clip_opening(
            clip_grad.clip_grad_norm_)


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
    _wrap_clip()
    set_enabled(settings.FUSED_STEPS.get())
