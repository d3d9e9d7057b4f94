"""A recorded call whose result is cast to half precision right after, traced for that cast
with the TPU's fast transcendentals (``registry.rounded_fast``, ``tpu_accuracy.rounded``).

A lowering sees its arguments, never its readers, so a float32 ``exp`` asks a TPU for its
accurate form (``tpu_accuracy``) even where the one reader rounds the result to bfloat16: a bf16
step's loss gradient, cast for the head's two products, which the TPU compiler recomputes inside
both; with the accurate ``exp`` they ran 1.5 and 0.6 ms longer than the JAX twin's on a v5e
chip (bench/RESULTS.md, whole12). A recording knows both ends. ``rewrite`` replaces a cast node
(``kernels.cast_of``: a half-precision dtype) whose one argument is the first result of a call
of a declared op (``program.op_of``: the table's call or a producer form's) by a program that
traces the producer's function inside ``tpu_accuracy.rounded_to_half`` and casts its value: it
takes the producer's arguments. The producer's own node stays: where nothing else reads it,
XLA drops it; where something does, that reader gets the accurate value. Captures and
DeferAndFuse's flushes apply it (``read_forms.apply``), after the producer forms. Nothing here
names an op.
"""

from __future__ import annotations

import functools
import inspect

import jax
import numpy as np

from torchtpu.cache import warm_keys
from torchtpu.device import kernels
from torchtpu.eager.program import op_of
from torchtpu.lowering.registry import ROUNDED_FAST
from torchtpu.runtime import tpu_accuracy

_HALF = (np.dtype(jax.numpy.bfloat16), np.dtype(np.float16))


def rewrite(nodes: list) -> int:
    """Replace in place the cast nodes (``(fn, tree, refs)``) of a declared op's result. Returns
    how many."""
    done = 0
    for i, (fn, tree, refs) in enumerate(nodes):
        dtype = kernels.cast_of(fn)
        if dtype is None or np.dtype(dtype) not in _HALF or tree is not None or len(refs) != 1:
            continue
        ref = refs[0]
        if ref.__class__ is not tuple or ref[1] != 0:
            continue  # an input of the program, or another result of its producer
        pfn, ptree, prefs = nodes[ref[0]]
        if ptree is not None or op_of(pfn) not in ROUNDED_FAST:
            continue
        nodes[i] = (_rounded(fn, pfn), None, prefs)
        done += 1
    return done


@functools.cache  # one program per pair: recordings' keys see one object
def _rounded(cast, producer):
    """The program of cast over producer's value traced in ``rounded_to_half``: it takes the
    producer's arguments."""
    source = inspect.unwrap(producer)  # its function, traced afresh (jit's trace is cached)

    def run(*dyn):
        with tpu_accuracy.rounded_to_half():
            value = jax.tree_util.tree_leaves(source(*dyn))[0]
        return cast(value)

    run.__name__ = f"{source.__name__}_rounded"
    jitted = jax.jit(run)
    parts = [getattr(f, "_ttpu_parts", None) for f in (cast, producer)]
    # Named by both programs' names where both have one (a warm start's key).
    return warm_keys.named(jitted, "rounded", *parts) if None not in parts else jitted
