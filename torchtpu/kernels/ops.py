"""``torch.tpu.ops``: device ops beyond ATen, each a ``jax_op`` (so eager and compiled alike).

- ``optimization_barrier(tensors)``: the same values, through ``lax.optimization_barrier``: XLA
  may not move computation across it (to bound live ranges or force an order); gradients pass
  through unchanged.
- ``ragged_dot(lhs, rhs, group_sizes)``: the grouped matmul of mixture-of-experts layers: rows
  ``[start_g, start_g + group_sizes[g])`` of ``lhs`` (m, k) multiply ``rhs[g]`` (k, n); rows past
  the sum of the sizes give zeros. Differentiable in ``lhs`` and ``rhs``.
- ``rms_norm`` and ``flash_attention``: the Pallas kernels (``rms_norm.py``,
  ``flash_attention.py``); ``flash_sdpa(min_seq_len)`` makes ``F.scaled_dot_product_attention``
  use the flash kernel for sequences at least that long (``None``: never, the default).
"""

from __future__ import annotations

import jax
import torch

from torchtpu import errors
from torchtpu.eager import sdpa_routing
from torchtpu.kernels.flash_attention import flash_attention
from torchtpu.kernels.jax_op import define, jax_op
from torchtpu.kernels.rms_norm import rms_norm
from torchtpu.kernels.signature import Param, Signature


def _barrier(tensors):
    return list(jax.lax.optimization_barrier(tuple(tensors)))


_optimization_barrier = define(
    "torchtpu::optimization_barrier", _barrier,
    Signature((Param("tensors", "Tensor[]"),), ("Tensor[]",), True), differentiable=False)
_optimization_barrier.register_autograd(
    lambda ctx, grads: (list(grads),), setup_context=lambda ctx, inputs, output: None)


def optimization_barrier(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> list:
    """``tensors``' values, with an XLA optimization barrier around them (see the module doc)."""
    if isinstance(tensors, torch.Tensor):
        raise TypeError(errors.message(
            "kernel", "optimization_barrier takes a list or tuple of tensors, not one tensor "
            "(wrap it: optimization_barrier([t]))"))
    out = _optimization_barrier(list(tensors))
    return type(tensors)(out) if isinstance(tensors, tuple) else out


def _ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.shape != (rhs.shape[0],) \
            or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(errors.message(
            "kernel", f"torch.tpu.ops.ragged_dot: lhs {lhs.shape} (m, k), rhs {rhs.shape} "
            f"(groups, k, n) and group_sizes {group_sizes.shape} (groups,) do not fit"))
    return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype("int32"),
                              precision=jax.lax.Precision.HIGHEST)


ragged_dot = jax_op("torchtpu::ragged_dot", _ragged_dot)


def flash_sdpa(min_seq_len: int | None) -> None:
    """Route ``F.scaled_dot_product_attention`` calls without mask and dropout whose query or key
    length is at least ``min_seq_len`` to the Pallas flash kernel; ``None`` switches it off."""
    if min_seq_len is not None and (not isinstance(min_seq_len, int) or min_seq_len < 1):
        raise ValueError(errors.message(
            "kernel", f"flash_sdpa: min_seq_len must be a positive int or None, not "
            f"{min_seq_len!r}"))
    sdpa_routing.set_long_sequence_path(
        None if min_seq_len is None else (min_seq_len, flash_attention))


__all__ = ["flash_attention", "flash_sdpa", "optimization_barrier", "ragged_dot", "rms_norm"]
