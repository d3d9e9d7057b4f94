"""Executors: how a prepared op call runs. Strict is the default; Debug and DeferAndFuse plug in.

An executor receives a lowering, its static spec and the dynamic values, and returns arrays. It
never names ops: what an op computes comes from the lowering table (what CPU would refuse is
checked before, by the dispatcher, in every mode). DeferAndFuse lives in ``eager/defer.py``.
"""

from __future__ import annotations

import functools
import operator
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchtpu import metrics, settings
from torchtpu.device import launch
from torchtpu.device.hooks import HOOKS
from torchtpu.eager import lazy_casts, numbers
from torchtpu.eager.program import Spec, cast_outputs, held, one_pointwise_input, rebuild
from torchtpu.lowering.registry import Lowering


def _hold(owner: Strict, lowering: Lowering, spec: Spec, fn, read, count: int, dyn: tuple):
    """Strict's (``owner``'s) held value of a pointwise call of ``count`` tensors
    (``lazy_casts.lazy_op`` for one, ``held_call`` for several; the call's traced numbers as
    device arrays), or None to launch it: where ``owner.lazy_ops`` is off (a test may switch it
    at any time) or the call is not held."""
    if not owner.lazy_ops:
        return None
    if len(dyn) > count:
        dyn = numbers.on_device(spec, dyn)
    if count > 1:
        return lazy_casts.held_call(owner, lowering, spec, fn, count, dyn)
    return lazy_casts.lazy_op(owner, lowering, spec, fn, read, dyn)


class Strict:
    """One op at a time, asynchronously: each call runs its cached program and returns at once."""

    name = "strict"
    # Whether float casts wait to be converted inside their consumers' programs
    # (``lazy_casts``): one launch each less; ``lazy_ops``: pointwise calls of tensors too.
    lazy_casts = True
    lazy_ops = True

    def run(self, lowering: Lowering, spec: Spec, dyn: tuple):
        metrics.count_execution()
        # Every op call comes here: the spec's program and number slots, once known, are read
        # off it without a call each.
        found = spec._program
        fn = found[2] if found is not None and found[0] is lowering else held(lowering, spec)[2]
        if self.lazy_ops:
            read, count = one_pointwise_input(lowering, spec)
            if read is not False:
                lazy = _hold(self, lowering, spec, fn, read, count, dyn)
                if lazy is not None:
                    return lazy
        slots = spec._scalars
        if not (numbers.scalar_slots(spec) if slots is None else slots):
            out = launch.run(lowering.op, fn, dyn)
        else:
            # Its traced numbers as device arrays, kept for the next call: a program handing
            # one back as a result (JAX forwards an input it returns) gives a copy, which a
            # storage may own.
            dyn = numbers.on_device(spec, dyn)
            out = numbers.not_kept(launch.run(lowering.op, fn, dyn))
        # Narrowing lazy casts it read come back converted: their values now.
        return out if not spec.keeps else lazy_casts.settle(spec.keeps, dyn, out)

    def launcher(self, lowering: Lowering, spec: Spec):
        """The program a call of spec runs, where ``run`` would do nothing but launch it on
        the call's arrays as they are and settle the kept casts it reads (``spec.keeps``: the
        caller settles them, ``lazy_casts.settle``): no value held, no numbers to keep; else
        None. Asked once per remembered call (``seen_calls``) and executor: what decides is
        the spec's, and an executor that runs calls another way answers None."""
        if type(self).run is not Strict.run or numbers.scalar_slots(spec):
            return None
        if one_pointwise_input(lowering, spec)[0] is not False:
            return None  # it may be held (``lazy_ops``, which a test may switch at any time)
        return held(lowering, spec)[2]  # called as ``run`` calls it

    def holder(self, lowering: Lowering, spec: Spec):
        """For a call of spec that ``run`` first tries to hold (a pointwise call: ``lazy_ops``),
        a function of the call's arrays giving its held value, or None where ``run`` would
        launch it (``lazy_ops`` off, or the call not held: see ``lazy_casts.lazy_op``); else
        None. Asked once per remembered call and executor, as ``launcher``."""
        if type(self).run is not Strict.run:
            return None
        read, count = one_pointwise_input(lowering, spec)
        if read is False:
            return None
        fn = held(lowering, spec)[2]
        if numbers.scalar_slots(spec):
            # (``_hold`` itself, a frame a held call fewer than a method calling it.)
            return functools.partial(_hold, self, lowering, spec, fn, read, count)
        # No traced number to send (``len(dyn) == count``): ``_hold``'s pick, made now (a
        # frame a held call fewer, ~850 a 12-layer Llama step).
        return functools.partial(lazy_casts.held_call, self, lowering, spec, fn, count) \
            if count > 1 else functools.partial(lazy_casts.lazy_op, self, lowering, spec, fn, read)

    def run_concrete(self, lowering: Lowering, spec: Spec, dyn: tuple):
        """A call whose output shapes depend on values: run on concrete arrays, op by op."""
        metrics.count("executions")
        return launch.run(lowering.op, self._concrete, (lowering, spec, dyn))

    def run_program(self, label, fn, args: tuple):
        """A program an upper layer built for one op call (``compile/eager_buckets.py``), on
        concrete arguments: run now, in every mode."""
        metrics.count("executions")
        return launch.run(label, fn, args)

    @staticmethod
    def _concrete(lowering: Lowering, spec: Spec, dyn: tuple):
        return cast_outputs(lowering.fn(*rebuild(spec, lowering, dyn)), spec.final)

    def flush(self) -> None:
        """Strict runs every op as it comes: nothing is ever pending."""

    def enter(self) -> None:
        """Called when this executor becomes the current one."""
        if self.lazy_casts:
            HOOKS.lazy_cast = lazy_casts.lazy_cast
        HOOKS.settle_readers = lazy_casts.settle_readers

    def leave(self) -> None:
        """Called when another executor replaces this one: its lazy casts are computed."""
        HOOKS.lazy_cast = None
        lazy_casts.resolve_pending()
        HOOKS.settle_readers = None


# Frames of these packages are internals: a check the device runs names the first frame outside
# them, the user's line.
_INTERNAL = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    os.path.dirname(torch.__file__) + os.sep,
)


def _internal(frame: types.FrameType) -> bool:
    return frame.f_code.co_filename.startswith(_INTERNAL)


def user_location() -> str:
    """Where the user's code is: "file:line" of the innermost frame outside the internals."""
    frame = sys._getframe(1)
    while frame is not None and _internal(frame):
        frame = frame.f_back
    if frame is None:
        return "on PyTorch's autograd thread (in backward)"
    return f"at {frame.f_code.co_filename}:{frame.f_lineno}"


def _nonfinite(out) -> bool:
    for x in jax.tree_util.tree_leaves(out):
        if jnp.issubdtype(x.dtype, jnp.inexact) and not bool(np.all(np.isfinite(np.asarray(x)))):
            return True
    return False


class Debug(Strict):
    """Synchronous: waits for every op, so a failure surfaces at the op that caused it.

    ``TORCHTPU_DEBUG_NANS=1`` also raises ``FloatingPointError`` at the first op whose result
    holds a NaN or an infinity. Errors it raises end at the user's line (see ``dispatch.kernel``).
    """

    name = "debug"
    lazy_casts = lazy_ops = False  # each op's result is checked, a cast's too

    def run(self, lowering: Lowering, spec: Spec, dyn: tuple):
        return self._checked(lowering.op, super().run(lowering, spec, dyn))

    def run_concrete(self, lowering: Lowering, spec: Spec, dyn: tuple):
        return self._checked(lowering.op, super().run_concrete(lowering, spec, dyn))

    def run_program(self, label, fn, args: tuple):
        return self._checked(label, super().run_program(label, fn, args))

    @staticmethod
    def _checked(label, out):
        out = jax.block_until_ready(out)
        if settings.DEBUG_NANS.get() and _nonfinite(out):
            raise FloatingPointError(
                f"torchtpu.numerics: {label} produced NaN or Inf (TORCHTPU_DEBUG_NANS=1)")
        return out


_current: list = [Strict()]
_current[0].enter()


# ``current()``: the current executor. Asked at every op call (~1,200 a 12-layer Llama step), so
# a C callable (the list's item 0), not a Python frame; ``set_current`` replaces the item.
current = functools.partial(operator.getitem, _current, 0)


def set_current(executor: Strict) -> None:
    """Make executor the current one; the previous one runs what it holds pending first."""
    previous = _current[0]
    previous.leave()
    _current[0] = executor
    executor.enter()


def flush() -> None:
    """Run whatever the current executor holds pending (nothing, for Strict and Debug)."""
    current().flush()

