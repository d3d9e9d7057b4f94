"""``torch_xla.compile``: a region whose ops run as one program at its end.

PyTorch/XLA traces the region lazily (eager mode off inside it) and runs the traced graph at its
end. Here the region runs under DeferAndFuse and ends with the step boundary (``_step.sync``),
so each call is one cached program and Python side effects (a scheduler's ``step()``, a
counter) run on every call, as in PyTorch/XLA; pending work from before the region runs first.
DeferAndFuse's own bound on a recording (``MAX_OPS``, which splits an endless eager loop into
programs) is lifted inside the region, as PyTorch/XLA's graph has none: a training step of a few
thousand ops is still one program. Eager size buckets (``compile/eager_buckets.py``, which run
a call at a growing size as a padded program of its own, at once) are off inside it for the same
reason: an optimizer's per-parameter loop looks like growth to them.
``full_graph=True`` raises when the body ran programs before its end (a host read such as
``.item()`` or ``print`` of a device value, or a data-dependent shape, split it), naming how many;
``max_different_graphs=N`` raises when the region's calls ended in more than N different
programs (told apart by the recording's calls and its inputs' shapes, as PyTorch/XLA tells graphs
apart by their hashes: whether a program had to be compiled, or was in a cache already, does not
count).
A decorator, a wrapper (``torch_xla.compile(fn)``) or a context manager (``with
torch_xla.compile():``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from torchtpu import metrics
from torchtpu.compile import eager_buckets
from torchtpu.eager import defer
from torchtpu.integrations.torch_xla import _missing, _step


class Region:
    """One compiled region; the programs its calls ended in."""

    def __init__(self, name: str | None, full_graph: bool, max_different_graphs: int | None):
        if max_different_graphs is not None and max_different_graphs < 1:
            raise ValueError(f"torchtpu.argument: max_different_graphs must be at least 1, got "
                             f"{max_different_graphs}")
        self.name, self.full_graph, self.limit = name or "region", full_graph, max_different_graphs
        self.graphs: set = set()
        self._saved: list = []

    def __enter__(self):
        _step.sync()
        self._saved.append((torch.tpu.eager_mode, metrics.snapshot(), defer.RECORDER.max_ops,
                            eager_buckets.enabled()))
        torch.tpu.eager_mode = torch.tpu.EagerMode.DEFER_AND_FUSE
        defer.RECORDER.max_ops = float("inf")
        eager_buckets.set_enabled(False)
        return self

    def __exit__(self, kind, error, tb) -> None:
        mode, before, max_ops, buckets = self._saved.pop()
        try:
            inside = metrics.snapshot()["executions"] - before["executions"]
            # (read only where counted: the key walks every input of the recording)
            program = defer.RECORDER.pending_key() if self.limit is not None else None
            _step.sync()
        finally:
            torch.tpu.eager_mode = mode
            defer.RECORDER.max_ops = max_ops
            eager_buckets.set_enabled(buckets)
        if kind is not None:
            return
        if self.full_graph and inside:
            raise RuntimeError(
                f"torchtpu.compile: torch_xla.compile({self.name!r}, full_graph=True) ran "
                f"{inside} program(s) before the end of its body: a host read (.item(), print "
                "of a device value, .cpu()) or a data-dependent shape (x[mask]) inside it; move "
                "it after the call (xm.add_step_closure) or drop full_graph")
        if program is not None and program not in self.graphs:
            self.graphs.add(program)
            if len(self.graphs) > self.limit:
                raise RuntimeError(
                    f"torchtpu.compile: torch_xla.compile({self.name!r}) ended in "
                    f"{len(self.graphs)} different programs, over max_different_graphs="
                    f"{self.limit}: its input shapes or Python values change between calls")

    def __call__(self, fn: Callable) -> Callable:
        if self.name == "region":
            self.name = getattr(fn, "__name__", self.name)

        @functools.wraps(fn)
        def compiled(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)

        return compiled


def compile(f: Callable | None = None, full_graph: bool = False, name: str | None = None,
            max_different_graphs: int | None = None, custom_compile_options: dict | None = None):
    """``torch_xla.compile``: see the module."""
    if custom_compile_options:
        raise NotImplementedError(_missing.text("torch_xla.compile(custom_compile_options=)")
                                  + "; XLA flags pass through XLA_FLAGS")
    region = Region(name or getattr(f, "__name__", None), full_graph, max_different_graphs)
    return region if f is None else region(f)
