"""The model's forward per vLLM step as one captured program, one per padded batch shape.

Eager, a decode step of even a tiny model is about a hundred torchtpu ops, each its own XLA
program call with its Python dispatch around it; vLLM's CUDA platform answers the same cost
with CUDA graphs. Here the model runner pads each step to a few sizes (:func:`bucket`: powers
of two of tokens and of requests, as vLLM pads to its cudagraph capture sizes), so that steps
repeat a handful of shapes, and :class:`StepGraphs` captures the forward of each shape with
``torch.tpu.graph`` the first time it runs and replays that one program afterwards. Only
decode steps are captured (vLLM's FULL_DECODE_ONLY): they are nearly every step and come in a
few shapes, while steps holding prefills come in many, each of which would compile a program of
its own (seconds, on the first request that meets it); those run op by op.

A replay reads the storages the capture read, so everything the forward reads must live in a
storage that holds the new step's values: the weights, the KV caches (written in place by the
program), and vLLM's persistent input buffers (token ids, positions, query start locations,
sequence lengths, block table, slot mapping), which vLLM refills before every step. The
attention metadata is built from those buffers inside the forward (``attention.py``), never
from tensors made per step. A capture is keyed by its shapes and by the addresses of those
buffers, so a buffer vLLM reallocates is captured again instead of being read stale.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

# distinct step shapes kept before the least recently used capture is dropped
MAX_CAPTURES = 64


def bucket(n: int, limit: int) -> int:
    """n rounded up to a power of two, at most ``limit`` (and never below n)."""
    return max(n, min(1 << max(0, n - 1).bit_length(), limit))


class StepGraphs:
    """Captured forwards by key; a key whose capture failed runs eagerly from then on."""

    def __init__(self, max_captures: int = MAX_CAPTURES) -> None:
        self.max_captures = max_captures
        self._graphs: OrderedDict = OrderedDict()  # key -> (TPUGraph, output)
        self.uncapturable: set = set()  # keys whose capture failed
        self.captures = 0
        self.replays = 0

    def __call__(self, key, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The forward's output for this step: replayed if key was captured, else captured."""
        if key in self.uncapturable:
            return forward()
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(key, forward)
            if entry is None:
                return forward()
        else:
            self._graphs.move_to_end(key)
        graph, output = entry
        graph.replay()
        self.replays += 1
        return output

    def _capture(self, key, forward: Callable[[], torch.Tensor]):
        graph = torch.tpu.TPUGraph()
        try:
            with torch.tpu.graph(graph):
                output = forward()
        except torch.tpu.CaptureError as e:
            log.warning("torchtpu.capture: a vLLM step of shape %s runs eagerly: %s", key, e)
            self.uncapturable.add(key)
            return None
        if not isinstance(output, torch.Tensor):
            # pipeline-parallel intermediates and auxiliary outputs stay eager
            self.uncapturable.add(key)
            return None
        if len(self._graphs) >= self.max_captures:
            self._graphs.popitem(last=False)
        self._graphs[key] = (graph, output)
        self.captures += 1
        return graph, output
