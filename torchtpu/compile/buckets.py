"""Size buckets at run time: the padded size of each symbol, and the values of a dynamic graph
padded up to their bucket and cut back to their real sizes.

``dynamic.plan`` decides at compile time which graphs may run padded and how each dim is laid
out; this module does the per-call part on the host (a device pad or slice would itself be one
XLA program per size, which is what bucketing avoids).
"""

from __future__ import annotations

import math

import numpy as np
import sympy
import torch

from torchtpu.runtime import transfer


def size_expr(d) -> sympy.Expr:
    """A size (an int or a SymInt) as a sympy expression."""
    return d.node.expr if isinstance(d, torch.SymInt) else sympy.Integer(d)


def bucket(n: int, bucket_size: int, num_buckets: int) -> int:
    """The padded size for a symbolic size n."""
    for i in range(num_buckets):
        if n <= bucket_size << i:
            return bucket_size << i
    largest = bucket_size << (num_buckets - 1)
    return math.ceil(n / largest) * largest


def sizes_of(placeholders: list, args: list) -> dict:
    """Each symbol's value, read from the inputs whose sizes name it (arrays or tensors)."""
    values = {}
    for n, a in zip(placeholders, args, strict=True):
        v = n.meta.get("val")
        if isinstance(v, torch.SymInt):
            if isinstance(size_expr(v), sympy.Symbol):
                values[size_expr(v)] = int(a)
        elif isinstance(v, torch.Tensor):
            for d, actual in zip(v.shape, a.shape, strict=True):
                if isinstance(size_expr(d), sympy.Symbol):
                    values[size_expr(d)] = int(actual)
    return values


def evaluate(expr, values: dict):
    """A size expression at the given symbol values (ints, or traced scalars in a program)."""
    expr = size_expr(expr) if isinstance(expr, torch.SymInt) else sympy.sympify(expr)
    if expr.is_Integer:
        return int(expr)
    if isinstance(expr, sympy.Symbol):
        return values[expr]
    parts = [evaluate(a, values) for a in expr.args]
    if expr.is_Add:
        return sum(parts[1:], parts[0])
    if expr.is_Mul:
        out = parts[0]
        for p in parts[1:]:
            out = out * p
        return out
    if expr.func.__name__ == "FloorDiv":
        return parts[0] // parts[1]
    raise NotImplementedError(f"torchtpu.compile: cannot evaluate the size {expr}")


def real_value(val, values: dict):
    """A symbolic output number at the real sizes (the program saw padded ones)."""
    return int(size_expr(val).subs(values)) if isinstance(val, torch.SymInt) else val


def _factor_sizes(layout: tuple, values: dict) -> list:
    return [[int(values[f]) if isinstance(f, sympy.Symbol) else int(f) for f in dim]
            for dim in layout]


def pad(array, layout: tuple, values: dict, to: dict):
    """array laid out at the bucket sizes (zeros in padding) as a host array; array itself
    when no dim of it is padded (never a round trip through the host for nothing)."""
    real, padded = _factor_sizes(layout, values), _factor_sizes(layout, to)
    if real == padded:
        return array
    host = transfer.fetch(array)
    flat_real = [f for dim in real for f in dim]
    # Zeros with the values written in: a tenth of np.pad's cost, on every bucketed call.
    split = np.zeros([f for dim in padded for f in dim], host.dtype)
    split[tuple(slice(0, f) for f in flat_real)] = host.reshape(flat_real)
    return split.reshape([math.prod(dim) for dim in padded])


def unpad(array, layout: tuple, values: dict, to: dict):
    """The real elements of a padded array as a host array; array itself when nothing is
    padded."""
    real, padded = _factor_sizes(layout, values), _factor_sizes(layout, to)
    if real == padded:
        return array
    host = transfer.fetch(array)
    split = host.reshape([f for dim in padded for f in dim])
    split = split[tuple(slice(0, f) for dim in real for f in dim)]
    return split.reshape([math.prod(dim) for dim in real])
