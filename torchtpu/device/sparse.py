"""Sparse layouts on the device: refused, by name, wherever one would be made or used.

tpu tensors are strided only: a storage is one XLA buffer (``device/storage.py``), and XLA has no
sparse arrays. Without this, PyTorch's generic sparse code would half-work: a COO tensor fails
with a dispatcher error about the "Sparsetpu" backend, and a CSR/CSC/BSR/BSC one is built on
tpu from strided member tensors, then fails in ways that do not say why (``values()`` and even
``.cpu()`` raise "expected sparse ... layout but got SparseCsr"). So the compressed layouts'
constructors get kernels for the ``SparseCsrPrivateUse1`` key (``.to("tpu")`` of a CPU tensor,
``torch.sparse_csr_tensor(..., device="tpu")`` go through them), a strided tpu tensor's
conversions (``to_sparse()``, ``to_sparse_csr()``, ...) get kernels of their own, and both
sparse keys get a fallback for every other op (COO construction among them): each raises
``NotImplementedError`` naming the layout and the way out. Nothing is densified behind the
user's back.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from torchtpu import errors

_KEYS = {"SparsePrivateUse1": torch.sparse_coo, "SparseCsrPrivateUse1": None}

# Every compressed-layout constructor PyTorch dispatches on the layout's key.
_COMPRESSED_CONSTRUCTORS = (
    "_sparse_compressed_tensor_unsafe", "_sparse_compressed_tensor_with_dims",
    "sparse_compressed_tensor", "_sparse_csr_tensor_unsafe", "_sparse_csc_tensor_unsafe",
    "_sparse_bsr_tensor_unsafe", "_sparse_bsc_tensor_unsafe", "sparse_csr_tensor",
    "sparse_csc_tensor", "sparse_bsr_tensor", "sparse_bsc_tensor",
)


# A strided tpu tensor's conversions to a sparse layout: refused at the call, rather than run by
# the CPU fallback (or refused by a fallback policy of "error" as if a lowering were missing).
_CONVERSIONS = {"_to_sparse": torch.sparse_coo, "_to_sparse_csr": torch.sparse_csr,
                "_to_sparse_csc": torch.sparse_csc, "_to_sparse_bsr": torch.sparse_bsr,
                "_to_sparse_bsc": torch.sparse_bsc}


def _layout(args: tuple, kwargs: dict, default) -> str:
    layout = kwargs.get("layout")
    if layout is None:
        layout = next((x.layout for x in tree_flatten((args, kwargs))[0]
                       if isinstance(x, torch.Tensor) and x.layout != torch.strided), default)
    return str(layout) if layout is not None else "a sparse compressed layout"


def refusal(op, layout: str) -> NotImplementedError:
    return NotImplementedError(errors.message(
        "unsupported", f"sparse tensors ({layout}) are not supported on tpu, whose tensors are "
        f"strided only (aten op '{op}'); keep the sparse tensor on CPU, or move its dense form "
        "(t.to_dense().to('tpu'))"))


def _refuse_for(default_layout):
    def refuse(op, *args, **kwargs):
        raise refusal(op, _layout(args, kwargs, default_layout))

    return refuse


def _refuse_op(op, default_layout=None):
    def refuse(*args, **kwargs):
        raise refusal(op, _layout(args, kwargs, default_layout))

    return refuse


def _overloads(name: str):
    packet = getattr(torch.ops.aten, name)
    return [getattr(packet, overload) for overload in packet.overloads()]


def register(lib: torch.library.Library) -> list[torch.library.Library]:
    """Refuse sparse layouts on tpu; returns the fallback libraries, to be kept alive."""
    for name in _COMPRESSED_CONSTRUCTORS:
        for op in _overloads(name):
            lib.impl(op, _refuse_op(op), "SparseCsrPrivateUse1")
    for name, layout in _CONVERSIONS.items():
        for op in _overloads(name):
            lib.impl(op, _refuse_op(op, layout), "PrivateUse1")
    fallbacks = []
    for key, layout in _KEYS.items():
        fallback = torch.library.Library("_", "IMPL")
        fallback.fallback(_refuse_for(layout), key)
        fallbacks.append(fallback)
    return fallbacks
