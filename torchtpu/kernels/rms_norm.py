"""A fused RMSNorm written in Pallas, forward and backward, as the op ``torchtpu::rms_norm``.

``y = x / sqrt(mean(x**2, -1) + eps) * weight`` over the last dimension. Rows are processed in
blocks of ``_BLOCK_ROWS`` (one grid step each; the last dimension stays whole in one block), in
float32 whatever the input dtype. Forward also writes each row's reciprocal RMS, which the
backward kernel reuses instead of recomputing it; the backward writes ``dx`` per row block and a
partial ``dweight`` per block, summed outside the kernel (a grid step may not reduce across
blocks on TPU without ordering). ``jax.custom_vjp`` ties the two kernels together, so the op's
backward (derived by ``jax_op`` with ``jax.vjp``) runs the Pallas backward kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from torchtpu.kernels import pallas_mode
from torchtpu.kernels.jax_op import jax_op

_BLOCK_ROWS = 256


def _forward_kernel(x_ref, w_ref, y_ref, rstd_ref, *, eps: float):
    x = x_ref[...].astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    y_ref[...] = (x * rstd * w_ref[...].astype(jnp.float32)).astype(y_ref.dtype)
    rstd_ref[...] = rstd


def _backward_kernel(x_ref, w_ref, rstd_ref, dy_ref, dx_ref, dw_ref):
    x = x_ref[...].astype(jnp.float32)
    rstd = rstd_ref[...]
    dy = dy_ref[...].astype(jnp.float32)
    xhat = x * rstd
    g = dy * w_ref[...].astype(jnp.float32)
    dx = rstd * (g - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True))
    dx_ref[...] = dx.astype(dx_ref.dtype)
    dw_ref[...] = jnp.sum(dy * xhat, axis=0, keepdims=True)[None]


def _blocked(rows: int) -> tuple[int, int]:
    """(block rows, padded rows): one block when it fits, else blocks of _BLOCK_ROWS."""
    if rows <= _BLOCK_ROWS:
        return rows, rows
    return _BLOCK_ROWS, pl.cdiv(rows, _BLOCK_ROWS) * _BLOCK_ROWS


def _rows(x, padded: int):
    x2 = x.reshape(-1, x.shape[-1])
    return jnp.pad(x2, ((0, padded - x2.shape[0]), (0, 0))) if padded != x2.shape[0] else x2


def _row_spec(block: int, d: int) -> pl.BlockSpec:
    return pl.BlockSpec((block, d), lambda i: (i, 0))


def _cost(flops_per_element: int, *arrays) -> pl.CostEstimate:
    """What one kernel does, for the TPU cost model (a Mosaic kernel is opaque to it): a few
    flops per element of x, one rsqrt per row, every array read or written once."""
    rows, d = arrays[0].shape
    return pl.CostEstimate(flops=flops_per_element * rows * d, transcendentals=rows,
                           bytes_accessed=sum(a.size * a.dtype.itemsize for a in arrays))


def _forward(x, weight, eps):
    d = x.shape[-1]
    rows = x.size // d
    block, padded = _blocked(rows)
    args = _rows(x, padded), weight.reshape(1, d)
    outs = [jax.ShapeDtypeStruct((padded, d), x.dtype),
            jax.ShapeDtypeStruct((padded, 1), jnp.float32)]
    with pallas_mode.kernel_defaults():
        y, rstd = pl.pallas_call(
            functools.partial(_forward_kernel, eps=eps),
            grid=(padded // block,),
            in_specs=[_row_spec(block, d), pl.BlockSpec((1, d), lambda i: (0, 0))],
            out_specs=[_row_spec(block, d), _row_spec(block, 1)],
            out_shape=outs,
            cost_estimate=_cost(4, *args, *outs),
            name="rms_norm_forward",
        )(*args)
    return y[:rows].reshape(x.shape), rstd


def _backward_arrays(x, weight, rstd, dy):
    d = x.shape[-1]
    rows = x.size // d
    block, padded = _blocked(rows)
    steps = padded // block
    args = _rows(x, padded), weight.reshape(1, d), rstd, _rows(dy, padded)
    outs = [jax.ShapeDtypeStruct((padded, d), x.dtype),
            jax.ShapeDtypeStruct((steps, 1, d), jnp.float32)]
    with pallas_mode.kernel_defaults():
        dx, dw = pl.pallas_call(
            _backward_kernel,
            grid=(steps,),
            in_specs=[_row_spec(block, d), pl.BlockSpec((1, d), lambda i: (0, 0)),
                      _row_spec(block, 1), _row_spec(block, d)],
            out_specs=[_row_spec(block, d), pl.BlockSpec((1, 1, d), lambda i: (i, 0, 0))],
            out_shape=outs,
            cost_estimate=_cost(10, *args, *outs),
            name="rms_norm_backward",
        )(*args)
    return dx[:rows].reshape(x.shape), dw.sum((0, 1)).astype(weight.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm_jax(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """The Pallas RMSNorm on JAX arrays (differentiable through the Pallas backward kernel)."""
    return _forward(x, weight, eps)[0]


def _fwd(x, weight, eps):
    y, rstd = _forward(x, weight, eps)
    return y, (x, weight, rstd)


def _bwd(eps, residuals, dy):
    return _backward_arrays(*residuals, dy)


rms_norm_jax.defvjp(_fwd, _bwd)


def _rms_norm(x: jax.Array, weight: jax.Array, eps: float = 1e-6) -> jax.Array:
    return rms_norm_jax(x, weight, eps)


rms_norm = jax_op("torchtpu::rms_norm", _rms_norm)
rms_norm.__doc__ = """``rms_norm(x, weight, eps=1e-6)``: fused RMSNorm over the last dimension
(as ``torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)``), a Pallas kernel forward
and backward."""
