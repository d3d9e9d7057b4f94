"""Memory-overlap refusals for written tensors, as PyTorch's CPU kernels make them (the
executors check what ops write; ``copy_``, a device kernel, checks its target).

The device computes every op functionally and then writes the results, so an output that
aliases an input would give a well-defined answer here where CPU refuses the call. These checks
refuse what CPU refuses: a written tensor whose elements share memory (an ``expand``-ed out=),
an out= or in-place target that partially overlaps an input, and, for the ops that read their
input while writing their output in any order, any overlap at all.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false

# Ops whose CPU kernels refuse any overlap between what they write and what they read (full
# overlap included), where elementwise ops allow full overlap (``torch.add(x, y, out=x)``).
NO_OVERLAP = frozenset({
    "cat", "gather", "index_select", "take", "masked_select", "kthvalue", "bernoulli", "index",
    "index_add", "index_copy", "index_fill", "masked_scatter", "put", "scatter", "scatter_add",
    "index_put", "_index_put_impl",
})

# Arguments CPU's kernels never check against the target: masked_scatter_'s source (any
# overlap), and a Tensor value the fill ops read as a number.
_READ_FIRST = {"masked_scatter": "source", "masked_fill": "value", "index_fill": "value",
              "fill": "value"}


def read_first(op: torch._ops.OpOverload) -> str | None:
    """The name of op's argument that may overlap what op writes, as on CPU, or None."""
    return _READ_FIRST.get(op._schema.name.split("::")[-1].rstrip("_"))


_INTERNAL = ("unsupported operation: more than one element of the written-to tensor refers to a "
             "single memory location. Please clone() the tensor before performing the operation.")
_BETWEEN = ("unsupported operation: some elements of the input tensor and the written-to tensor "
            "refer to a single memory location. Please clone() the tensor before performing the "
            "operation.")


@functools.lru_cache(maxsize=4096)
def _dense(size: tuple, stride: tuple) -> bool:
    return is_non_overlapping_and_dense_or_false(torch.empty_strided(size, stride, device="meta"))


def _status(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """"full", "partial" or None, decided only for dense tensors as PyTorch does."""
    if a is b:
        return "full"
    # Different storages first: the cheap test; PyTorch's density test costs ~20 us a tensor.
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return None
    if a.numel() == 0 or b.numel() == 0 or not (_dense(a.shape, a.stride())
                                                    and _dense(b.shape, b.stride())):
        return None
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
    if (a0, a1) == (b0, b1):
        return "full" if a.stride() == b.stride() else "partial"
    return "partial" if a0 < b1 and b0 < a1 else None


# CPU's fill_ with a Scalar and zero_ skip the check: they write one value, so an expand-ed
# target is well defined (fill_ with a Tensor value, and every other op, check).
_WRITE_ONE_VALUE = frozenset({torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default})
# CPU's threshold builds its iterator with no overlap checks at all (threshold is idempotent):
# an expand-ed or overlapping target is written, in place or as out=.
_UNCHECKED = frozenset({"aten::threshold", "aten::threshold_"})
# These only warn on an expand-ed target, in CPU's words (after the category), and write it.
_WARN_EXPANDED = {"aten::index_put_": ("index_put_", "tensor[indices] = tensor"),
                  "aten::_index_put_impl_": ("index_put_", "tensor[indices] = tensor"),
                  "aten::masked_fill_": ("masked_fill_", "tensor[mask] = scalar"),
                  "aten::index_fill_": ("index_fill_", "tensor[mask] = scalar")}


def check_internal(written: list, op: torch._ops.OpOverload | None = None) -> None:
    """Raise RuntimeError if a written tensor's elements share memory (before any resize of an
    out= argument, as CPU checks)."""
    if op in _WRITE_ONE_VALUE or (op is not None and op._schema.name in _UNCHECKED):
        return
    warn = _WARN_EXPANDED.get(op._schema.name) if op is not None else None
    for w in written:
        if isinstance(w, torch.Tensor) and torch._debug_has_internal_overlap(w) == 1:
            if warn is None:
                raise RuntimeError(_INTERNAL)
            warnings.warn(f"torchtpu.check: Use of {warn[0]} on expanded tensors is deprecated. "
                          "Please clone() "
                          "the tensor before performing this operation. This also applies to "
                          f"advanced indexing e.g. {warn[1]}", UserWarning, stacklevel=2)


def check_between(op: torch._ops.OpOverload, written: list, inputs: list) -> None:
    """Raise RuntimeError if CPU would refuse to write the written tensors while reading inputs
    (an in-place op's written arguments are not among its inputs; the same tensor passed again
    in another argument is); after out= arguments take their result shapes, as CPU checks."""
    if op._schema.name in _UNCHECKED:
        return
    any_overlap = op._schema.name.split("::")[-1].rstrip("_") in NO_OVERLAP
    # Only tensors of one storage can overlap: grouping by storage keeps a foreach call over n
    # tensors at n lookups instead of n * n pairs (AdamW's lists: ~700 pairs a call).
    by_storage: dict = {}
    for x in inputs:
        if isinstance(x, torch.Tensor):
            by_storage.setdefault(x.untyped_storage().data_ptr(), []).append(x)
    for w in written:
        if not isinstance(w, torch.Tensor):
            continue
        for x in by_storage.get(w.untyped_storage().data_ptr(), ()):
            status = _status(w, x)
            if status == "partial" or (status == "full" and any_overlap):
                raise RuntimeError(_BETWEEN)


def check(op: torch._ops.OpOverload, written: list, inputs: list) -> None:
    """Both checks, for calls that resize nothing."""
    check_internal(written, op)
    check_between(op, written, inputs)
