"""``torch.compile(..., mode="reduce-overhead")`` on tpu: each Dynamo graph as captured programs.

Inductor answers this mode with CUDA Graphs; here each graph Dynamo hands over is run the way
``torch.tpu.make_graphed_callables`` runs a callable (``eager/graphed_callables.py``): its first
call with a new input signature captures the graph's forward, and its backward when an input
requires grad, each into one XLA program; every call replays them. No AOTAutograd and no per-op
work run on a replay. Dynamo's guards still decide which graph runs, so Python state stays
guarded.

A graph that writes its inputs in place (an optimizer step, gradient clipping) writes the call's
tensors: their arrays stand in for the captured ones and take the results back. A graph with CPU
tensor inputs is compiled the ordinary way: a capture would freeze their values (PyTorch's CUDA
Graphs trees skip such graphs too).
"""

from __future__ import annotations

import logging

import torch

from torchtpu.eager.graphed_callables import GraphedCallable, context

log = logging.getLogger(__name__)

# Distinct input signatures (and written-input identities) kept per graph before the oldest
# captures are dropped.
MAX_CAPTURES = 8


def _signature(args: tuple) -> tuple:
    return (context(),
            tuple((tuple(a.shape), a.dtype, a.requires_grad) if isinstance(a, torch.Tensor)
                  else (type(a), a) for a in args))


def graphed(gm: torch.fx.GraphModule, example_inputs: list):
    """A callable replaying gm's captured programs, or None if gm must be compiled normally."""
    if not all(isinstance(x, torch.Tensor) and x.device.type == "tpu" for x in example_inputs):
        log.info("torchtpu.compile: reduce-overhead: a graph with non-tpu or non-tensor inputs is "
                 "compiled without capture")
        return None
    captures: dict = {}

    def run(*args):
        key = _signature(args)
        entry = captures.get(key)
        if entry is None or not entry.can_write(args):
            if len(captures) >= MAX_CAPTURES:
                captures.pop(next(iter(captures)))
            entry = captures[key] = GraphedCallable(gm, tuple(args), warmup=0, allow_unused=True,
                                                    inputs_written=True)
        return list(entry(*args))

    return run
