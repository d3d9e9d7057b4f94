"""Executors: how a prepared op call runs. Strict is the default; the others plug in here.

An executor receives a lowering, its static spec and the dynamic values, and returns arrays. It
never names ops; what an op computes comes from the lowering table.
"""

from __future__ import annotations

import jax

from torchtpu import metrics
from torchtpu.eager.program import Spec, cast_outputs, program, rebuild
from torchtpu.lowering.registry import Lowering


class Strict:
    """One op at a time, asynchronously: each call runs its cached program and returns at once."""

    name = "strict"

    def run(self, lowering: Lowering, spec: Spec, dyn: tuple):
        metrics.count("executions")
        if lowering.data_dependent_shape:
            # Output shapes depend on values: run on concrete arrays, op by op.
            return cast_outputs(lowering.fn(*rebuild(spec, lowering, dyn)), spec.final)
        return program(lowering, spec)(*dyn)

    def flush(self) -> None:
        """Strict runs every op as it comes: nothing is ever pending."""

    def is_materialized(self, t) -> bool:
        return True


class Debug(Strict):
    """Synchronous: waits for every op, so a failure surfaces at the op that caused it."""

    name = "debug"

    def run(self, lowering: Lowering, spec: Spec, dyn: tuple):
        out = super().run(lowering, spec, dyn)
        return jax.block_until_ready(out)


_current: list = [Strict()]


def current() -> Strict:
    return _current[0]


def set_current(executor: Strict) -> None:
    _current[0] = executor


def flush() -> None:
    """Run whatever the current executor holds pending (nothing, for Strict and Debug)."""
    current().flush()


def is_materialized(t) -> bool:
    return current().is_materialized(t)
