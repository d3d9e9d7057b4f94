"""torch.export's symbolic sizes as JAX symbolic dimensions (``jax.export`` shape polymorphism).

Each symbol of the program's user inputs becomes one JAX dimension variable, named after the
first input dimension that is that symbol alone (``input_ids_1``: input ``input_ids``, axis 1),
with the range ``torch.export`` derived for it (``Dim("seq", max=64)``: at most 64) as a
constraint of one ``jax.export.SymbolicScope``, so that every input shares it. JAX dimensions
are at least 1; a range reaching down to 0 starts at 1.
"""

from __future__ import annotations

import jax
import sympy
import torch

import torchtpu_artifact as artifact
from torchtpu.export.program import JaxProgram, Slot


def _expr(d) -> sympy.Expr | int:
    return d.node.expr if isinstance(d, torch.SymInt) else int(d)


def _bound(v) -> int | None:
    """A range end as an int; None for torch's int_oo (no bound)."""
    return int(v) if getattr(v, "is_Integer", False) else None


class Symbols:
    """The JAX names and ranges of a program's symbolic sizes, and its inputs' specs."""

    def __init__(self, program: JaxProgram) -> None:
        self.names: dict[sympy.Symbol, sympy.Symbol] = {}
        for slot in program.inputs:
            if slot.kind != artifact.USER_INPUT:
                continue
            for axis, d in enumerate(slot.val.shape):
                e = _expr(d)
                if isinstance(e, sympy.Symbol) and e not in self.names:
                    self.names[e] = sympy.Symbol(f"{slot.name}_{axis}", integer=True)
        for slot in program.inputs:
            for d in slot.val.shape:
                e = _expr(d)
                for s in getattr(e, "free_symbols", ()):
                    self.names.setdefault(s, sympy.Symbol(str(s), integer=True))
        ranges = program.ep.range_constraints
        self.ranges: dict[str, dict] = {}
        constraints = []
        for s, name in self.names.items():
            vr = ranges.get(s)
            low = max(_bound(vr.lower) or 1, 1) if vr is not None else 1
            high = _bound(vr.upper) if vr is not None else None
            self.ranges[str(name)] = {"min": low, "max": high}
            if low > 1:
                constraints.append(f"{name} >= {low}")
            if high is not None:
                constraints.append(f"{name} <= {high}")
        self.scope = jax.export.SymbolicScope(constraints)

    def text(self, slot: Slot) -> str:
        """slot's shape as JAX's shape-spec text: ``"input_ids_0, 16"``."""
        parts = []
        for d in slot.val.shape:
            e = _expr(d)
            parts.append(str(e) if isinstance(e, int) else str(e.xreplace(self.names)))
        return ", ".join(parts)

    def specs(self, program: JaxProgram) -> list[jax.ShapeDtypeStruct]:
        """One ShapeDtypeStruct per program input, symbolic where the export is."""
        found = []
        for slot, dtype in zip(program.inputs, program.input_dtypes(), strict=True):
            text = self.text(slot)
            try:
                shape = jax.export.symbolic_shape(text, scope=self.scope)
            except ValueError as e:
                raise ValueError(f"torchtpu.export: input {slot.name!r} has shape ({text}), "
                                 f"which JAX cannot take as a symbolic shape: {e}") from e
            found.append(jax.ShapeDtypeStruct(shape, dtype))
        return found
