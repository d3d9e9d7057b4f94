"""Neural-network ops that need their own lowering: distances (cdist, pdist), embedding_bag and
the CTC loss, forward and backward.

Most of the family needs none: every other op of it that reaches the device has a
``torch._decomp`` decomposition whose pieces are lowered elsewhere, and tests/test_nn_ops.py checks
each against CPU, forward and backward. That covers ``_softmax``/``_log_softmax`` and their
backward_data ops, gelu/silu/relu/leaky_relu/elu/hardtanh/softplus/mish/hardswish/hardsigmoid
and their backwards, ``native_layer_norm``, ``native_batch_norm`` (its decomposition writes the
running stats back with ``copy_``, which lands in the device storage), ``native_group_norm``,
``_fused_rms_norm``, the nll/mse/bce/smooth_l1/huber losses. ``scaled_dot_product_attention`` on
a tpu tensor takes the math path (no fused kernel is registered for PrivateUse1), which is
CompositeImplicitAutograd and so reaches the device as bmm/softmax/where pieces.

Lower an op here only when it has no decomposition, or its decomposition is wrong or measurably
too slow. Backward lowerings follow PyTorch's formulas where they differ from the gradient of the
forward (zero gradient at zero distance, ties of the inf-norm).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import torch
from jax import lax

from torchtpu.lowering.registry import lowers

aten = torch.ops.aten
HIGHEST = lax.Precision.HIGHEST


# ----------------------------------------------------------------------------- distances

def _p_distance(diff, p: float):
    """The p-norm over the last dim of diff, with PyTorch's special cases for p = 0, 1, 2, inf."""
    a = jnp.abs(diff)
    if p == 0:
        return (a != 0).sum(-1).astype(diff.dtype)
    if p == 1:
        return a.sum(-1)
    if p == 2:
        return jnp.sqrt((a * a).sum(-1))
    if math.isinf(p):
        return a.max(-1, initial=0)
    return (a ** p).sum(-1) ** (1 / p)


def _p_distance_grad(diff, dist, p: float):
    """d dist / d diff, as PyTorch's cdist/pdist backward computes it (0 where dist is 0)."""
    d = dist[..., None]
    zero = jnp.zeros((), diff.dtype)
    safe = jnp.where(d == 0, 1, d)
    if p == 0:
        return jnp.zeros_like(diff)
    if p == 1:
        return jnp.sign(diff)
    if math.isinf(p):
        return jnp.sign(diff) * (jnp.abs(diff) == d)
    if p == 2:
        g = diff / safe
    elif p < 2:
        g = jnp.sign(diff) * jnp.abs(diff) ** (p - 1) / safe ** (p - 1)
        g = jnp.where(diff == 0, zero, g) if p < 1 else g
    else:
        g = diff * jnp.abs(diff) ** (p - 2) / safe ** (p - 1)
    return jnp.where(d == 0, zero, g)


def _uses_mm(p: float, rows: int, cols: int, compute_mode) -> bool:
    # PyTorch's compute_mode: None/0 use matmul for p=2 past 25 rows, 1 always, 2 never.
    if p != 2 or compute_mode == 2:
        return False
    return compute_mode == 1 or rows > 25 or cols > 25


@lowers(aten._cdist_forward.default)
def cdist(x1, x2, p, compute_mode=None):
    if _uses_mm(p, x1.shape[-2], x2.shape[-2], compute_mode):
        # |a|^2 + |b|^2 - 2 a.b, as the CPU computes it (cheaper, less accurate).
        sq1 = (x1 * x1).sum(-1)[..., :, None]
        sq2 = (x2 * x2).sum(-1)[..., None, :]
        cross = jnp.matmul(x1, jnp.swapaxes(x2, -1, -2), precision=HIGHEST)
        return jnp.sqrt(jnp.maximum(sq1 + sq2 - 2 * cross, 0))
    return _p_distance(x1[..., :, None, :] - x2[..., None, :, :], p)


@lowers(aten._cdist_backward.default)
def cdist_backward(grad, x1, x2, p, dist):
    diff = x1[..., :, None, :] - x2[..., None, :, :]
    return (grad[..., None] * _p_distance_grad(diff, dist, p)).sum(-2)


def _pairs(n: int):
    return jnp.triu_indices(n, 1)


@lowers(aten._pdist_forward.default)
def pdist(x, p=2.0):
    i, j = _pairs(x.shape[0])
    return _p_distance(x[i] - x[j], p)


@lowers(aten._pdist_backward.default)
def pdist_backward(grad, x, p, dist):
    i, j = _pairs(x.shape[0])
    g = grad[:, None] * _p_distance_grad(x[i] - x[j], dist, p)
    return jnp.zeros_like(x).at[i].add(g).at[j].add(-g)
