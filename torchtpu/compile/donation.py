"""Which inputs a compiled graph's program donates (``backend.py``), and what that consumes.

- A mutated input whose old array nothing else can see again (``mutated``): the write-back
  replaces it, so XLA updates it in place.
- A graph input passed directly to an op that donates that argument (``lowering.donates``:
  ``jax_op(..., donate_argnums=...)``, ``donating_inputs``): it is refused as eager refuses it
  (``ownership.donation_refusal``) and consumed after the call, as in eager; its array is donated
  when a program output of its shape and dtype can take it (else XLA could not use it and JAX
  would warn). A donated argument computed inside the graph (a view, an intermediate) is XLA's
  own buffer: nothing is consumed.
"""

from __future__ import annotations

import sys

import jax
import numpy as np
import torch
import torch.fx as fx

from torchtpu import errors
from torchtpu.compile.graph_function import GraphFunction
from torchtpu.device import dtypes, ownership
from torchtpu.eager import schema


def mutated(arrays: list, mutated_at: list, args: list) -> tuple:
    """Positions (in arrays) of the mutated inputs whose old array is dead after the call.

    Such an array is its storage's whole array (the write-back replaces it), appears once among
    the inputs, and has no holder but that storage: not a pending value of DeferAndFuse or its
    recording, not another storage. Anything else is not donated.
    """
    counts: dict = {}
    for a in arrays:
        counts[id(a)] = counts.get(id(a), 0) + 1
    donate = []
    for k, i in mutated_at:
        a = arrays[k]
        t = args[i]
        if not isinstance(a, jax.Array) or counts[id(a)] != 1 or t.is_cpu:
            continue
        if t.untyped_storage()._tpu_array is not a:
            continue  # a view or reinterpretation: the storage keeps the old array
        # References: the storage, the arrays list, a, and getrefcount's argument.
        if sys.getrefcount(a) <= 4:
            donate.append(k)
    return tuple(donate)


def donating_inputs(fn: GraphFunction, excluded: set) -> list:
    """(position among tensor inputs, position among inputs, op, parameter) of each graph input
    passed directly to a donated argument, but for inputs in excluded (mutated or returned)."""
    found, seen = [], set()
    for step in fn.steps:
        lowering = step.lowering
        if lowering is None or not lowering.donates:
            continue
        oi = schema.info(lowering.op)
        values, _ = schema.bind(oi, step.node.args, step.node.kwargs)
        for j in lowering.donates:
            v = values[j]
            if not (isinstance(v, fx.Node) and v.op == "placeholder"):
                continue
            i = fn.placeholders.index(v)
            if i in excluded or i in seen or not fn.tensor_inputs[i]:
                continue
            seen.add(i)
            found.append((sum(fn.tensor_inputs[:i]), i, lowering.op, oi.names[j]))
    return found


def output_kinds(fn: GraphFunction, forwarded: dict) -> dict:
    """(shape, dtype) -> how many of the program's outputs have it (forwarded ones are not
    program outputs; symbolic shapes are left out)."""
    kinds: dict = {}
    for k, n in enumerate(fn.output):
        v = n.meta.get("val") if isinstance(n, fx.Node) else None
        if k not in forwarded and isinstance(v, torch.Tensor) and all(
                isinstance(d, int) for d in v.shape):
            kind = (tuple(v.shape), np.dtype(dtypes.to_jax(v.dtype)))
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def taken(arrays: list, donating: list, args: list, outputs: dict) -> tuple[tuple, list]:
    """(positions in arrays to donate, tensors to consume) for the inputs donating ops take.

    Each is refused as eager refuses it; its array is donated when the storage holds it whole,
    nothing else does and a program output of its shape and dtype can take it (``outputs``:
    how many of each there are); else the program reads it and it is consumed all the same."""
    donate, consumed, free = [], [], dict(outputs)
    call_tensors = [a for a in args if isinstance(a, torch.Tensor)]
    for k, i, op, param in donating:
        t = args[i]
        problem = ownership.donation_refusal(t, param, call_tensors)
        if problem is not None:
            raise RuntimeError(errors.message(
                "kernel", f"{op._schema.name!r} (compiled) cannot take the buffer of argument "
                f"{param!r} (donate_argnums): {problem}"))
        a = arrays[k]
        kind = (tuple(a.shape), np.dtype(a.dtype))
        # References: the storage, the arrays list, a, and getrefcount's argument.
        if t.untyped_storage()._tpu_array is a and sys.getrefcount(a) <= 4 and free.get(kind):
            free[kind] -= 1
            donate.append(k)
        consumed.append((t, f"{op._schema.name!r} (compiled, donate_argnums)"))
    return tuple(donate), consumed
