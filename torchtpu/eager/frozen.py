"""Python's garbage collector at a DeferAndFuse loop's steady state.

A full collection walks every object alive (~500k once a Llama step has compiled: JAX's traces,
PyTorch, the model) and comes every ~10-30 steps, because each step's ~1,700 recorded calls
outlive the young collections (CPython runs a full one once such survivors pass a quarter of the
long-lived objects): ~0.15 s of host time in one step of the chip's. The recorder's first reuse
of a long program since the mode was entered (a loop's steady state) collects once and freezes
what is alive (``gc.freeze``), so later full collections walk only what later steps make.
Leaving the mode unfreezes, so whatever among those died meanwhile is collected as usual; a
process where something else froze objects first (vLLM does, after its start-up) is left alone:
unfreezing would undo that. Seeing that costs a walk of the frozen heap (``gc.get_freeze_count``:
99 ms in a process holding vLLM, CPython 3.11), so once seen it is believed for the next
``RECHECK`` entries of the mode (a loop that leaves and re-enters it every step).

The young collections are spaced out at the same point: by default CPython collects its youngest
generation once 700 more container objects were made than freed, ~12 times a 12-layer Llama step
(its recording leaves ~6.5k: pending values, their tensors and storages, call tuples), and what
each one walks mostly survives it (a step's activations and pending values live until backward or
the flush), to be walked again by the next generation's. While frozen, the threshold is
``YOUNG_THRESHOLD``, above what a step leaves until its flush frees it, so a steady loop collects
only as garbage cycles accumulate (~20k objects at most wait): 2-7% of a steady step's host CPU
(bench/RESULTS.md, defer8). Leaving the mode puts the thresholds back.

Strict's training loop (``SteadyLoop``, told of each optimizer step's end by
``compile/optimizer_steps.py``) meets the same full collections: ~470k objects walked every ~80-120
steps of a 12-layer Llama (0.35-1.1 s each, ~3-4 ms a step amortized: strict12). Strict has no
mode to leave, so its freeze is bounded: it comes after ``STEADY_STEPS`` steps in a row that
made no program (a loop at its steady state), ends at the first step that makes one (another
model, another shape: what the earlier loop left may be garbage now), and is made again every
``REFREEZE_STEPS`` steps, each time after a full collection: cyclic garbage among the frozen
objects (what a discarded model's cycles held) lives at most that many steps. The first freeze
collects nothing first (a full collection there, 0.35-1.1 s, would land in the few steps a
benchmark times after its warm-up: ``bench/strict_chip.py`` times steps 3-5), so garbage left
before it waits for the first refreeze too. What dies without
a cycle goes at once, as always (a reference count reaching zero frees it whether frozen or
not). Young collections are spaced out as in DeferAndFuse's freeze: a steady Strict step frees
what it makes, so none comes (100 steps: 550 young collections before, none after).
``TORCHTPU_GC_FREEZE=0`` leaves Strict's loops to CPython's collector as it is.
"""

from __future__ import annotations

import gc

from torchtpu import metrics, settings

MIN_OPS = 256  # shorter recordings leave too few survivors to matter
YOUNG_THRESHOLD = 20_000
RECHECK = 64


class Freezer:
    """One recorder's freeze: ``None`` while not decided since the mode was entered."""

    def __init__(self) -> None:
        self.froze: bool | None = None
        self._thresholds: tuple | None = None  # the collector's, replaced while frozen
        self.others_believed = 0  # entries left that take another's freeze as still there

    def steady(self, ops: int, collect: bool = True) -> None:
        """A program of ops recorded calls ran again; ``collect``: collect before freezing."""
        if self.froze is not None or ops < MIN_OPS:
            return
        self.froze = False
        if self.others_believed:
            self.others_believed -= 1
            return
        if gc.get_freeze_count():
            self.others_believed = RECHECK
            return
        if collect:
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


# Strict's loop: steps in a row that made no program before its freeze, and steps between
# refreezes (each a full collection: ~0.35-1.1 s at a 12-layer Llama's ~470k objects).
STEADY_STEPS = 3
REFREEZE_STEPS = 500


class SteadyLoop:
    """Strict's optimizer steps and the collector's freeze (see the module's doc)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.freezer = Freezer()
        self._made: int | None = None  # programs made by the end of the last step
        self._steady = 0  # steps in a row since then that made none

    def step_ended(self) -> None:
        """An optimizer step of Strict's ended (on the main thread)."""
        if not self.enabled:
            return
        made = metrics.programs_made()
        if made != self._made:
            self._made, self._steady = made, 0
            self.freezer.release()
            return
        self._steady += 1
        if self._steady == STEADY_STEPS:
            # (A Strict step is no recording: its length is not what decides here.)
            self.freezer.steady(MIN_OPS, collect=False)
        elif self.freezer.froze and self._steady % REFREEZE_STEPS == 0:
            gc.unfreeze()
            gc.collect()
            gc.freeze()
            metrics.count("gc_freezes")

    def reset(self) -> None:
        """Unfreeze what this loop froze; the next step starts counting anew."""
        self.freezer.release()
        self._made, self._steady = None, 0


STRICT_LOOP = SteadyLoop(settings.GC_FREEZE.get())  # read at import
