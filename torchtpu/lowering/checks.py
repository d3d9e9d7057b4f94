"""Debug-mode checks: what a device does not check, per op, in one small registry.

A device gathers with an out-of-range index without complaint (XLA clamps it), so the Debug
executor looks each op up here and, before running it, calls its check with the same arguments
the lowering gets (schema order, concrete arrays). A check returns an exception to raise, or None.
The executor adds the op's name; checks never run in Strict or DeferAndFuse.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from torchtpu.lowering.registry import OpOverload, _overloads

aten = torch.ops.aten

CHECKS: dict[OpOverload, Callable] = {}


def check(*targets) -> Callable:
    """Register the decorated function as the Debug check of each target op (or op packet)."""

    def register(fn: Callable) -> Callable:
        for target in targets:
            for op in _overloads(target):
                CHECKS[op] = fn
        return fn

    return register


def find(op: OpOverload) -> Callable | None:
    return CHECKS.get(op)


def out_of_bounds(index, size: int, dim: int, negative: bool) -> IndexError | None:
    """An IndexError for the first value of index outside dimension dim of the given size."""
    if index is None:
        return None
    values = np.asarray(index)
    if values.dtype == np.bool_ or values.dtype == np.uint8 or values.size == 0:
        return None  # masks are checked by shape, which PyTorch's meta kernels already do
    low = -size if negative else 0
    bad = (values < low) | (values >= size)
    if not bad.any():
        return None
    value = int(values[bad].flat[0])
    return IndexError(f"index {value} is out of bounds for dimension {dim} with size {size}")


def _dim(x, dim: int) -> int:
    return dim + x.ndim if dim < 0 else dim


def _size(x, dim: int) -> int:
    return x.shape[dim] if x.ndim else 1


@check(aten.gather.default)
def _gather(self, dim, index, *rest):
    d = _dim(self, dim)
    return out_of_bounds(index, _size(self, d), d, negative=False)


@check(aten.scatter, aten.scatter_add.default, aten.scatter_reduce.two)
def _scatter(self, dim, index, *rest):
    d = _dim(self, dim)
    return out_of_bounds(index, _size(self, d), d, negative=False)


@check(aten.index_select.default)
def _index_select(self, dim, index):
    d = _dim(self, dim)
    return out_of_bounds(index, _size(self, d), d, negative=False)


@check(aten.embedding.default)
def _embedding(weight, indices, *rest):
    return out_of_bounds(indices, weight.shape[0], 0, negative=False)


@check(aten.index.Tensor, aten.index_put.default, aten._index_put_impl.default)
def _index(self, indices, *rest):
    for d, index in enumerate(indices):
        err = out_of_bounds(index, self.shape[d], d, negative=True) if d < self.ndim else None
        if err is not None:
            return err
    return None
