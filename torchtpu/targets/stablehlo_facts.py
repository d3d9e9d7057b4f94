"""What a StableHLO module says of itself, before any compiler sees it: its entry's argument
and result bytes (logical, before TPU tiles), how many of its ops have 64-bit results, which
a TPU emulates (``tpu_target.Report`` carries both), and whether it holds complex128, which a TPU
cannot compute."""

from __future__ import annotations

import re

import jax
import numpy as np

_WIDE = re.compile(r"tensor<(?:[0-9?]+x)+(f64|i64|ui64|complex<f64>)>")


def facts(parsed) -> dict:
    """``{"logical": entry bytes, "wide": {"float64": n, "int64": n}, "complex128": bool}`` for
    a parsed module (wide: non-scalar 64-bit results only; complex128: any value, scalars too)."""
    main = None
    for op in parsed.body.operations:
        if op.operation.name == "func.func" and str(op.attributes["sym_name"]) == '"main"':
            main = op
            break
    logical = 0
    if main is not None:
        ftype = jax._src.lib.mlir.ir.FunctionType(
            jax._src.lib.mlir.ir.TypeAttr(main.attributes["function_type"]).value)
        logical = sum(_type_bytes(t) for t in (*ftype.inputs, *ftype.results))
    wide = {"float64": 0, "int64": 0}
    complex128 = False
    for line in parsed.operation.get_asm(large_elements_limit=4).splitlines():
        complex128 = complex128 or "complex<f64>" in line
        if "=" not in line:
            continue
        result_type = line.rsplit("->", 1)[-1] if "->" in line else line.rsplit(":", 1)[-1]
        for m in _WIDE.finditer(result_type):
            wide["float64" if "f64" in m.group(1) else "int64"] += 1
            break
    return {"logical": logical, "wide": wide, "complex128": complex128}


def _type_bytes(t) -> int:
    from jax._src.lib.mlir import ir

    try:
        shaped = ir.RankedTensorType(t)
    except (TypeError, ValueError):
        return 0
    if not shaped.has_static_shape:
        return 0
    element = shaped.element_type
    width = getattr(element, "width", None)
    if width is None:
        m = re.search(r"(\d+)", str(element))
        width = int(m.group(1)) if m else 32
    return int(np.prod(shaped.shape, dtype=np.int64)) * max(1, width // 8)
