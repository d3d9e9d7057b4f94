"""Masks inside a padded program: the nodes ``dynamic.plan`` marked run on masked inputs.

A padded program receives the real sizes of its symbols as traced int32 scalars. A node that
mixes positions along a padded dim sees its inputs with the padding replaced (``jnp.where``, so
a NaN or Inf in padding never leaks) by the identity of what it computes; a mean divides by the
real count; a symbolic size taken as a number is the real size; a negative index into a padded
dim counts from the real end.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import sympy
import torch.fx as fx
from jax import lax

from torchtpu.compile import buckets, dynamic
from torchtpu.lowering import padding
from torchtpu.lowering.registry import PADDED_MEANS

_TRUE_FILLS = {"true": True, "false": False, "zero": 0, "one": 1}


def _fill(kind, dtype):
    """The value padding is replaced by, in dtype."""
    if not isinstance(kind, str):
        return np.asarray(kind, dtype)
    if kind in _TRUE_FILLS:
        return np.asarray(_TRUE_FILLS[kind], dtype)
    if dtype == jnp.bool_:
        return np.asarray(kind == "highest", dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return np.asarray(-np.inf if kind == "lowest" else np.inf, dtype)
    info = jnp.iinfo(dtype)
    return np.asarray(info.min if kind == "lowest" else info.max, dtype)


class Padding:
    """One trace of a padded program: bucket sizes, real sizes, and the plan's masks."""

    def __init__(self, plan: dynamic.Plan, to: dict, real: tuple) -> None:
        self.plan = plan
        self.to = to
        self.real = dict(zip(plan.order, real, strict=True))

    def keep(self, shape: tuple, layout: tuple, dims) -> jnp.ndarray:
        """True at the real positions along dims (broadcastable to shape)."""
        keep = None
        for d in dims:
            index = lax.broadcasted_iota(
                jnp.int32, tuple(n if i == d else 1 for i, n in enumerate(shape)), d)
            stride = 1
            for f in reversed(layout[d]):
                size = self.to[f] if isinstance(f, sympy.Symbol) else f
                if isinstance(f, sympy.Symbol):
                    real = (index // stride) % size < self.real[f]
                    keep = real if keep is None else keep & real
                stride *= size
        return keep

    def run(self, step, env: dict, keys: tuple, scalars: list):
        node = step.node
        masks = self.plan.masks.get(node, ())
        numbers = self.plan.numbers.get(node, ())
        if not masks and not numbers:
            return step.run(env, keys, scalars)
        local = dict(env)
        for m in masks:
            if m.fill == "wrap":
                (d,) = m.dims
                (f,) = self.plan.layouts[node.args[0]][d]
                at, j = m.arg
                index = node.args[at][j]
                i = env[index]
                local[index] = jnp.where(i < 0, i + self.real[f].astype(i.dtype), i)
                continue
            arg = node.args[m.arg]
            x = env[arg]
            if m.fill == "end":  # real elements moved to the end, for positions counted from it
                (d,) = m.dims
                (f,) = self.plan.layouts[arg][d]
                local[arg] = jnp.roll(x, self.to[f] - self.real[f], axis=d)
                continue
            keep = self.keep(x.shape, self.plan.layouts[arg], m.dims)
            local[arg] = jnp.where(keep, x, _fill(m.fill, x.dtype))
        for n in numbers:
            local[n] = buckets.evaluate(n.meta["val"], self.real)
        if node.target in PADDED_MEANS:
            return self._mean(node, local[node.args[0]], step.dtypes)
        return step.run(local, keys, scalars)

    def _mean(self, node: fx.Node, x, dtype):
        """Sum of the masked input over the reduced dims, divided by their real count."""
        val = node.args[0].meta["val"]
        index = PADDED_MEANS[node.target]
        dims = padding.reduced_dims(node, index, x.ndim)
        keepdim = False if index is None else (
            node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
        count = 1
        for d in dims:
            count = count * buckets.evaluate(val.shape[d], self.real)
        total = jnp.sum(x.astype(dtype), axis=dims, keepdims=keepdim)
        return total / jnp.asarray(count).astype(dtype)
