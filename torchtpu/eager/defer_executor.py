"""The DeferAndFuse executor: every op call is recorded into the process's recording (``defer.py``,
which holds the recording, its pending values and the flush) instead of run.

An optimizer step ends a recording (its hooks), and an optimizer's first step makes its state
outside the recording (``adopt``): the thread making it runs its calls at once, every other
thread (and PyTorch's autograd thread) goes on recording. Entering the mode starts recording on
the entering thread; leaving it runs what is recorded.
"""

from __future__ import annotations

import math
from threading import get_ident

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from torchtpu.device.hooks import HOOKS
from torchtpu.eager import defer_replay
from torchtpu.eager.defer import RECORDER, Pending
from torchtpu.eager.executor import Strict
from torchtpu.eager.program import Spec, program
from torchtpu.lowering.registry import Lowering


def concrete(x):
    """x (a call's value, or a list or tuple of them) with its pending values run and read."""
    if isinstance(x, Pending):
        return x.materialize()
    if isinstance(x, (list, tuple)):
        return type(x)(concrete(v) for v in x)
    return x


class DeferAndFuse(Strict):
    """Records ops into the process's recording; flushes run them as one fused program.

    An optimizer's first step makes its state outside the recording (``adopt``): made inside,
    AdamW's zeros would be the first step's program's own, and the second step would compile
    the steady program once more (~50 s of a 12-layer Llama's warm-up on the chip)."""

    name = "defer_and_fuse"

    def __init__(self) -> None:
        self._step_hooks: tuple = ()
        self._initializing = None  # the optimizer whose ``_init_group`` is wrapped

    def run(self, lowering: Lowering, spec: Spec, dyn: tuple):
        # The thread making an optimizer's state (``adopt``, ``Recorder.making``) runs its calls
        # as Strict runs them. Only it: another thread's calls read values pending in the
        # recording, which Strict's programs cannot take (a ValueError from JAX).
        if RECORDER.making and RECORDER.making == get_ident():
            return super().run(lowering, spec, dyn)
        # ``program``'s lookup, inline: every recorded op call comes here.
        found = spec._program
        return RECORDER.record(found[1] if found is not None and found[0] is lowering
                               else program(lowering, spec), dyn)

    def run_concrete(self, lowering: Lowering, spec: Spec, dyn: tuple):
        if RECORDER.making and RECORDER.making == get_ident():
            return super().run_concrete(lowering, spec, dyn)
        # The output shape needs the input values: run what is pending first.
        RECORDER.flush()
        return super().run_concrete(lowering, spec, concrete(dyn))

    def adopt(self, opt: torch.optim.Optimizer) -> None:
        """At opt's first step (a parameter with a gradient and no state): its state is made
        outside the recording, then read by the step's program as every later step's reads it."""
        original = getattr(opt, "_init_group", None)
        if original is None or self._initializing is not None or all(
                opt.state.get(p) for group in opt.param_groups for p in group["params"]
                if p.grad is not None):
            return

        def init_group(*args, **kwargs):
            # The recording stays the process's: only this thread's calls (its view reads and
            # writes too: ``Recorder.making``) run at once; nothing replays meanwhile.
            RECORDER.set_making(get_ident())
            defer_replay.stop()
            try:
                return original(*args, **kwargs)
            finally:
                RECORDER.set_making(0)
                defer_replay.start()

        opt._init_group = init_group  # (an instance attribute: the class's stays as it is)
        self._initializing = opt

    def forget_adopted(self) -> None:
        """Give the adopted optimizer its own ``_init_group`` back."""
        if self._initializing is not None:
            del self._initializing._init_group
            self._initializing = None

    def _step_starts(self, optimizer, args, kwargs) -> None:
        # Not in an unbounded recording (a ``torch_xla.compile`` region's, whose body must run
        # no program before its end).
        if HOOKS.deferrer is RECORDER and get_ident() == RECORDER.owner \
                and not math.isinf(RECORDER.max_ops):
            self.adopt(optimizer)

    def _step_ended(self, optimizer, args, kwargs) -> None:
        if get_ident() == RECORDER.owner:  # (another thread's step leaves the owner's adopted)
            self.forget_adopted()
        if HOOKS.deferrer is RECORDER:
            RECORDER.step_ended()

    def flush(self) -> None:
        RECORDER.flush()

    def enter(self) -> None:
        self.start_recording()
        self._step_hooks = (register_optimizer_step_pre_hook(self._step_starts),
                            register_optimizer_step_post_hook(self._step_ended))

    def leave(self) -> None:
        for hook in self._step_hooks:
            hook.remove()
        self._step_hooks = ()
        self.forget_adopted()
        self.stop_recording()

    def start_recording(self) -> None:
        """Ops record from here on; this thread's host reads flush."""
        HOOKS.deferrer = RECORDER
        RECORDER.own()
        defer_replay.start()

    def stop_recording(self) -> None:
        """Run what is recorded and drop the kept results."""
        HOOKS.deferrer = None
        defer_replay.stop()
        RECORDER.flush()
        RECORDER.release_spares()
        RECORDER.unfreeze()
