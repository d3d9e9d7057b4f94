"""``jax_op(..., donate_argnums=...)``: which tensors may give their buffers to the call.

As in the reference (and ``jax.jit``), a donated argument is consumed: its buffer goes to the
function's program, where XLA may write a result into it, and the tensor holds no value
afterwards (reading it is an error naming the op; writing it whole, ``t.copy_(...)``, gives it a
value again). The op stays functional (``mutates_args=()``): the results are new tensors.

A buffer may only be given away when nothing else can see it, so a donation is refused, before
anything runs, with the reason and the fix when the tensor:
- shares its storage with another live tensor (a view, ``detach()``, ``.data``): they would lose
  their value too;
- requires grad: autograd may need the value in backward;
- is passed in another argument of the same call too;
- is used inside a graph capture (``torch.tpu.graph``), whose replays could not repeat it.

Executors do the rest: Strict and Debug run the op's program with the buffer donated
(``lowering.donates``), DeferAndFuse donates the consumed buffer to the fused program when it
flushes (nothing holds it any more), and a compiled graph donates a graph input passed directly
to a donated argument (``compile/backend.py``).
"""

from __future__ import annotations

import torch

from torchtpu import errors
from torchtpu.device import ownership
from torchtpu.eager import schema


def check(name: str, op, donated: tuple, args: tuple, kwargs: dict) -> list:
    """The tensors this call of ``op`` consumes, after refusing any that cannot be given up."""
    if not donated:
        return []
    oi = schema.info(op)
    values, _ = schema.bind(oi, args, kwargs)
    call_tensors = [v for v in values if isinstance(v, torch.Tensor)]
    consumed = []
    for i in donated:
        t = values[i]
        if not isinstance(t, torch.Tensor) or t.device.type != "tpu":
            continue  # None for an optional tensor; a CPU tensor is refused by the op itself
        problem = ownership.donation_refusal(t, oi.names[i], call_tensors)
        if problem is not None:
            raise RuntimeError(errors.message(
                "kernel", f"jax_op {name!r} cannot take the buffer of argument "
                f"{oi.names[i]!r} (donate_argnums): {problem}"))
        consumed.append(t)
    return consumed


def consume(name: str, consumed: list) -> None:
    """After the call: each donated tensor gives up its buffer."""
    for t in consumed:
        ownership.consume(t, f"jax_op {name!r} (donate_argnums)")
