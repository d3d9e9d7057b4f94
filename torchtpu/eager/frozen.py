"""Python's garbage collector at a DeferAndFuse loop's steady state.

A full collection walks every object alive (~500k once a Llama step has compiled: JAX's traces,
PyTorch, the model) and comes every ~10-30 steps, because each step's ~1,700 recorded calls
outlive the young collections (CPython runs a full one once such survivors pass a quarter of the
long-lived objects): ~0.15 s of host time in one step of the chip's. The recorder's first reuse
of a long program since the mode was entered (a loop's steady state) collects once and freezes
what is alive (``gc.freeze``), so later full collections walk only what later steps make.
Leaving the mode unfreezes, so whatever among those died meanwhile is collected as usual; a
process where something else froze objects first (vLLM does, after its start-up) is left alone:
unfreezing would undo that.

The young collections are spaced out at the same point: by default CPython collects its youngest
generation once 700 more container objects were made than freed, ~12 times a 12-layer Llama step
(its recording leaves ~6.5k: pending values, their tensors and storages, call tuples), and what
each one walks mostly survives it (a step's activations and pending values live until backward or
the flush), to be walked again by the next generation's. While frozen, the threshold is
``YOUNG_THRESHOLD``, above what a step leaves until its flush frees it, so a steady loop collects
only as garbage cycles accumulate (~20k objects at most wait): 2-7% of a steady step's host CPU
(bench/RESULTS.md, defer8). Leaving the mode puts the thresholds back.
"""

from __future__ import annotations

import gc

from torchtpu import metrics

MIN_OPS = 256  # shorter recordings leave too few survivors to matter
YOUNG_THRESHOLD = 20_000


class Freezer:
    """One recorder's freeze: ``None`` while not decided since the mode was entered."""

    def __init__(self) -> None:
        self.froze: bool | None = None
        self._thresholds: tuple | None = None  # the collector's, replaced while frozen

    def steady(self, ops: int) -> None:
        """A program of ops recorded calls ran again."""
        if self.froze is not None or ops < MIN_OPS:
            return
        self.froze = False
        if gc.get_freeze_count():
            return
        gc.collect()
        gc.freeze()
        self.froze = True
        metrics.count("gc_freezes")
        thresholds = gc.get_threshold()
        if thresholds[0] < YOUNG_THRESHOLD:
            self._thresholds = thresholds
            gc.set_threshold(YOUNG_THRESHOLD, *thresholds[1:])

    def release(self) -> None:
        """Hand what was frozen back to the garbage collector, with its thresholds."""
        if self.froze:
            gc.unfreeze()
        if self._thresholds is not None:
            # Unless someone set others meanwhile: theirs stand.
            if gc.get_threshold()[0] == YOUNG_THRESHOLD:
                gc.set_threshold(*self._thresholds)
            self._thresholds = None
        self.froze = None
