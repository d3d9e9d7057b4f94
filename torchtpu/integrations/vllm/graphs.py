"""The model's forward per vLLM step as one captured program, one per padded batch shape.

Eager, a decode step of even a tiny model is about a hundred torchtpu ops, each its own XLA
program call with its Python dispatch around it; vLLM's CUDA platform answers the same cost
with CUDA graphs. Here the model runner pads each step to a few sizes (:func:`bucket`: powers
of two of tokens and of requests, as vLLM pads to its cudagraph capture sizes), so that steps
repeat a handful of shapes, and :class:`StepGraphs` captures the forward of each shape with
``torch.tpu.graph`` the first time it runs and replays that one program afterwards. Steps the
host prepares (``host_steps.py``) are bucketed coarsely enough, prefills included, that the
worker captures every bucket at start-up; others capture their decode steps only (vLLM's
FULL_DECODE_ONLY), since their steps holding prefills come in many shapes, each of which would
compile a program of its own (seconds, on the first request that meets it).

A replay reads the storages the capture read, so everything the forward reads must live in a
storage that holds the new step's values: the weights, the KV caches (written in place by the
program), and vLLM's persistent input buffers (token ids, positions, query start locations,
sequence lengths, block table, slot mapping), which vLLM refills before every step. The
attention metadata is built from those buffers inside the forward (``attention.py``), never
from tensors made per step. A capture is keyed by its shapes and by the addresses of those
buffers, so a buffer vLLM reallocates is captured again instead of being read stale.

A step's inputs can also come from the host (:class:`HostFeeds`): the model runner then
prepares the step in NumPy alone, as vLLM's CPU platform does, and the captured program reads
vLLM's host buffers (token ids, positions, query start locations, sequence lengths, block table,
slot mapping) as inputs of its own at each replay, where a CUDA graph would copy them from pinned
memory. The device copies of those buffers are neither written nor read on such steps: no op
runs outside the one program but the copy of its tokens to the host.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from torchtpu.device.hooks import HOOKS
from torchtpu.eager.capture import storage_of

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

    def __call__(self, key, forward: Callable[[], torch.Tensor | tuple],
                 feeds: HostFeeds | None = None) -> torch.Tensor | tuple:
        """The forward's output (a tensor, or a tuple of them) for this step: replayed if key
        was captured, else captured.

        With ``feeds``, a capture reads those device buffers' values from the host at each
        replay (the key must then say so: a program either reads them fed or it does not).
        """
        if key in self.uncapturable:
            return self._eager(forward, feeds)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(key, forward, feeds)
            if entry is None:
                return self._eager(forward, feeds)
        else:
            self._graphs.move_to_end(key)
        graph, output = entry
        graph.replay()
        self.replays += 1
        return output

    @staticmethod
    def _eager(forward: Callable[[], torch.Tensor | tuple], feeds: HostFeeds | None):
        if feeds is not None:  # op by op, the forward reads the device buffers
            feeds.materialize()
        return forward()

    def _capture(self, key, forward: Callable[[], torch.Tensor | tuple],
                 feeds: HostFeeds | None):
        graph = torch.tpu.TPUGraph()
        try:
            with torch.tpu.graph(graph):
                if feeds is not None:
                    feeds.install()
                output = forward()
        except torch.tpu.CaptureError as e:
            log.warning("torchtpu.capture: a vLLM step of shape %s runs eagerly: %s", key, e)
            self.uncapturable.add(key)
            return None
        if not (isinstance(output, torch.Tensor) or (isinstance(output, tuple) and all(
                isinstance(t, torch.Tensor) for t in output))):
            # pipeline-parallel intermediates and auxiliary outputs stay eager
            self.uncapturable.add(key)
            return None
        if len(self._graphs) >= self.max_captures:
            self._graphs.popitem(last=False)
        self._graphs[key] = (graph, output)
        self.captures += 1
        return graph, output


class HostFeeds:
    """Device buffers whose values a captured step reads from host arrays at each replay.

    ``add(device_buffer, host, rows)`` pairs a persistent device tensor with a function returning
    the host array of the same elements (the whole buffer) for the current step, and, where the
    step reads the buffer's first rows only, a function of the step's padded (tokens, requests)
    giving how many (``step``: this step's). Inside a capture, :meth:`install` makes the
    pairings inputs of the program, packed into one transfer of the rows it reads
    (``eager/fed_pack.py``).
    """

    def __init__(self) -> None:
        self._pairs: list[tuple[torch.Tensor, Callable[[], np.ndarray], Callable | None]] = []
        self._step = (0, 0)  # the padded (tokens, requests) of the step being captured

    def add(self, device: torch.Tensor, host: Callable[[], np.ndarray],
            rows: Callable[[int, int], int] | None = None) -> None:
        if device.device.type != "tpu":
            raise ValueError(f"torchtpu.argument: a fed buffer lives on 'tpu', not {device.device}")
        self._pairs.append((device, host, rows))

    def tensors(self) -> list[torch.Tensor]:
        return [d for d, _, _ in self._pairs]

    def step(self, tokens: int, reqs: int) -> HostFeeds:
        """Say the padded tokens and requests of the step about to run (its program's rows)."""
        self._step = (tokens, reqs)
        return self

    def install(self) -> None:
        """Feed every pairing into the capture in progress (call inside ``torch.tpu.graph``)."""
        capture = HOOKS.capture
        if capture is None:
            raise RuntimeError("torchtpu.capture: HostFeeds.install() outside a graph capture")
        for device, host, rows in self._pairs:
            st = storage_of(device)
            read = None if rows is None else max(1, min(rows(*self._step), device.shape[0]))
            if read is None or tuple(st._tpu_array.shape) != tuple(device.shape):
                capture.feed(st, host, packed=True)  # (whole: packing copies the values)
            else:  # the first rows only: vLLM rewrites its buffers while this step may run
                capture.feed(st, lambda host=host, read=read: host()[:read], packed=True,
                             rows=read)

    def materialize(self) -> None:
        """Write the host values into the device buffers (a fed step that runs eagerly)."""
        for device, host, _ in self._pairs:
            flat = torch.from_numpy(np.ascontiguousarray(host()).reshape(-1))
            device.view(-1).copy_(flat.to(device.dtype)[: device.numel()])
