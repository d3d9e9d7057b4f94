"""Activation checkpointing that XLA keeps: the recomputation starts behind an optimization barrier.

``torch.utils.checkpoint`` drops a region's activations in the forward and runs the region again
in the backward. When forward and backward are one XLA program (a captured step, a compiled
whole step) the second run computes the same values from the same inputs, and XLA's common
subexpression elimination merges it with the first: every activation is kept, the saving is
gone (measured: an 8-block step's temporaries were the same to the byte with and without
checkpointing). So the recomputation reads its inputs through ``lax.optimization_barrier``:
values XLA cannot see through, so the recomputed ops are new ones, scheduled where the backward
needs them. (JAX's ``jax.checkpoint`` does the same with ``prevent_cse``.)

A recomputation that shares a program with the forward starts in eager code (and the captures
that record it, the compiled whole step among them): ``install()`` wraps the two functions
through which ``torch.utils.checkpoint`` hands a region its saved inputs again,
``detach_variable`` (``use_reentrant=True``) and ``_CheckpointFrame.get_inputs``
(``use_reentrant=False``, which ``checkpoint_sequential`` and the selective policies of
``create_selective_checkpoint_contexts`` use). Only tpu tensors pass through the barrier, as
fresh leaves with the same ``requires_grad``, which is what both forms expect of their inputs.

Dynamo's graphs need no barrier: AOTAutograd's partitioner copies the nodes a checkpoint tagged
into the backward graph, a program of its own that XLA cannot merge with the forward. A tagged
region holding a random op (``scaled_dot_product_attention`` counts as one) is wrapped by the
partitioner in ``run_and_save_rng_state`` / ``run_with_rng_state``, which the compiled path does
not lower yet: such a graph is refused naming the op (eager code and captured steps serve
it).
"""

from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint as torch_checkpoint

_installed = False
# Gradients of checkpointed regions' outputs that arrived in the backward and whose region has
# not recomputed yet: the next recomputation's barrier takes them, so it waits for them.
_arrived: list = []


def _barrier():
    from torchtpu.kernels import ops  # noqa: PLC0415 (defines torch.ops.torchtpu's barrier)

    return ops.optimization_barrier


def _on_tpu(v) -> bool:
    return isinstance(v, torch.Tensor) and v.device.type == "tpu"


def _through_barrier(values):
    """values with each tpu tensor replaced by its value behind one barrier (with the arrived
    gradients), as a leaf with the same requires_grad."""
    values = tuple(values)
    at = [k for k, v in enumerate(values) if _on_tpu(v)]
    if not at:
        return values
    waits = [g for g in _arrived if _on_tpu(g)]
    _arrived.clear()
    with torch.no_grad():
        fenced = _barrier()([values[k] for k in at] + waits)
        if waits:
            tie = fenced[-1].reshape(-1)[0] * 0
            fenced = [_tied(f, tie) for f in fenced[:len(at)]]
    out = list(values)
    for k, f in zip(at, fenced[:len(at)], strict=True):
        out[k] = f.detach().requires_grad_(values[k].requires_grad)
    return tuple(out)


def _tied(value, tie):
    """value + tie (a zero computed from a gradient), for floating values."""
    if not value.is_floating_point():
        return value
    return value + tie.to(value.dtype)


def _note_gradient(grad):
    _arrived.append(grad)


def _watch_outputs(out) -> None:
    """Each tpu output that requires grad tells its gradient's arrival (see ``_arrived``)."""
    for v in (out if isinstance(out, (tuple, list)) else (out,)):
        if _on_tpu(v) and v.requires_grad:
            v.register_hook(_note_gradient)


def install() -> None:
    """Wrap torch.utils.checkpoint's hand-over of a region's inputs to its recomputation, and
    its ``checkpoint`` (outside ``torch.compile``) to watch the regions' output gradients."""
    global _installed
    if _installed:
        return
    _installed = True
    detach_variable = torch_checkpoint.detach_variable

    def detach_fenced(inputs):
        return _through_barrier(detach_variable(inputs))

    detach_fenced.__doc__ = detach_variable.__doc__
    torch_checkpoint.detach_variable = detach_fenced
    frame = torch_checkpoint._CheckpointFrame
    get_inputs = frame.get_inputs

    def get_inputs_fenced(self):
        return _through_barrier(get_inputs(self))

    frame.get_inputs = get_inputs_fenced
    checkpoint = torch_checkpoint.checkpoint

    @functools.wraps(checkpoint)
    def checkpoint_watched(function, *args, **kwargs):
        out = checkpoint(function, *args, **kwargs)
        if not torch.compiler.is_compiling():
            _watch_outputs(out)
        return out

    torch_checkpoint.checkpoint = checkpoint_watched
