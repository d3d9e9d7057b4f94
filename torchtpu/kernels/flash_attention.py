"""Blocked (flash-style) attention in Pallas, forward and backward: ``torchtpu::flash_attention``.

``softmax(q k^T * scale [causal]) v`` for (batch, heads, length, head_dim) inputs without ever
holding the (length x length) score matrix: each grid step owns one block of queries and walks
the key/value blocks with an online softmax (running max and sum), writing the output and each
row's log-sum-exp. The backward recomputes probabilities block by block from that log-sum-exp:
one kernel accumulates ``dq`` per query block, one accumulates ``dk`` and ``dv`` per key block
(each output block is written by exactly one grid step, so no atomics). Math is float32.

Lengths that are not a multiple of the block are padded; padded keys are masked out and padded
query rows are cut off. ``jax.custom_vjp`` binds the kernels, so the op's backward (derived by
``jax_op``) runs the Pallas backward kernels. ``F.scaled_dot_product_attention`` uses this op
for long sequences when asked (``torch.tpu.ops.flash_sdpa``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from torchtpu import errors
from torchtpu.kernels import pallas_mode
from torchtpu.kernels.jax_op import jax_op

_BLOCK = 128
_NEG = -1e30  # finite: exp(_NEG - m) is 0 and never NaN, unlike -inf - -inf


def _dot(a, b, trans_b: bool = False):
    dims = (((1,), (1,)), ((), ())) if trans_b else (((1,), (0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)


def _scores(q, k, qi, kj, *, scale, causal, kv_len, block_q, block_k):
    """Masked scores of query block qi against key block kj (float32)."""
    s = _dot(q, k, trans_b=True) * scale
    rows = qi * block_q + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
    cols = kj * block_k + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    keep = cols < kv_len
    if causal:
        keep = keep & (cols <= rows)
    return jnp.where(keep, s, _NEG)


def _forward_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, **geometry):
    block_q, block_k = geometry["block_q"], geometry["block_k"]
    qi = pl.program_id(1)
    q = q_ref[...].astype(jnp.float32)
    steps = k_ref.shape[0] // block_k

    def step(j, carry):
        acc, m, total = carry
        k = k_ref[pl.ds(j * block_k, block_k), :].astype(jnp.float32)
        v = v_ref[pl.ds(j * block_k, block_k), :].astype(jnp.float32)
        s = _scores(q, k, qi, j, **geometry)
        m_new = jnp.maximum(m, s.max(-1, keepdims=True))
        p = jnp.exp(s - m_new)
        correction = jnp.exp(m - m_new)
        return acc * correction + _dot(p, v), m_new, total * correction + p.sum(-1, keepdims=True)

    acc = jnp.zeros((block_q, v_ref.shape[-1]), jnp.float32)
    m = jnp.full((block_q, 1), _NEG, jnp.float32)
    acc, m, total = jax.lax.fori_loop(0, steps, step, (acc, m, jnp.zeros_like(m)))
    o_ref[...] = (acc / total).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(total)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, **geometry):
    block_k = geometry["block_k"]
    qi = pl.program_id(1)
    q = q_ref[...].astype(jnp.float32)
    do = do_ref[...].astype(jnp.float32)
    lse, delta = lse_ref[...], delta_ref[...]

    def step(j, dq):
        k = k_ref[pl.ds(j * block_k, block_k), :].astype(jnp.float32)
        v = v_ref[pl.ds(j * block_k, block_k), :].astype(jnp.float32)
        p = jnp.exp(_scores(q, k, qi, j, **geometry) - lse)
        ds = p * (_dot(do, v, trans_b=True) - delta)
        return dq + _dot(ds, k)

    dq = jax.lax.fori_loop(0, k_ref.shape[0] // block_k, step, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * geometry["scale"]).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, **geometry):
    block_q = geometry["block_q"]
    kj = pl.program_id(1)
    k = k_ref[...].astype(jnp.float32)
    v = v_ref[...].astype(jnp.float32)

    def step(i, carry):
        dk, dv = carry
        rows = pl.ds(i * block_q, block_q)
        q = q_ref[rows, :].astype(jnp.float32)
        do = do_ref[rows, :].astype(jnp.float32)
        p = jnp.exp(_scores(q, k, i, kj, **geometry) - lse_ref[rows, :])
        ds = p * (_dot(do, v, trans_b=True) - delta_ref[rows, :])
        return dk + _dot(ds.T, q), dv + _dot(p.T, do)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(0, q_ref.shape[0] // block_q, step, (zeros, zeros))
    dk_ref[...] = (dk * geometry["scale"]).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------- layout

def _pad_to(x, length: int):
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0))) if x.shape[1] != length else x


def _geometry(q, k, scale, causal):
    lq, lk = q.shape[-2], k.shape[-2]
    block_q, block_k = min(_BLOCK, lq), min(_BLOCK, lk)
    return dict(scale=scale, causal=causal, kv_len=lk, block_q=block_q, block_k=block_k), (
        pl.cdiv(lq, block_q) * block_q, pl.cdiv(lk, block_k) * block_k)


def _flat(x, length: int):
    """(B, H, L, D) -> (B*H, padded L, D)."""
    return _pad_to(x.reshape(-1, *x.shape[-2:]), length)


def _blocks(rows: int, d: int, along: int):
    """The spec of one (rows, d) block of a (B*H, L, d) array; ``along``: which grid axis walks L
    (None: the whole length)."""
    if along is None:
        return pl.BlockSpec((None, rows, d), lambda b, i: (b, 0, 0))
    return pl.BlockSpec((None, rows, d), lambda b, i: (b, i, 0))


def _cost(matmuls: int, lq: int, lk: int, d: int, *arrays) -> pl.CostEstimate:
    """What one kernel does, for the TPU cost model (a Mosaic kernel is opaque to it): ``matmuls``
    (lq x lk x d) products per (batch x head), one exp per score, every array read or written
    once (every key block is visited, causal or not)."""
    bh = arrays[0].shape[0]
    return pl.CostEstimate(flops=2 * matmuls * bh * lq * lk * d, transcendentals=bh * lq * lk,
                           bytes_accessed=sum(a.size * a.dtype.itemsize for a in arrays))


def _forward(q, k, v, scale, causal):
    geometry, (lq, lk) = _geometry(q, k, scale, causal)
    bq, d, dv = geometry["block_q"], q.shape[-1], v.shape[-1]
    bh = q.size // (q.shape[-2] * d)
    args = _flat(q, lq), _flat(k, lk), _flat(v, lk)
    outs = [jax.ShapeDtypeStruct((bh, lq, dv), q.dtype),
            jax.ShapeDtypeStruct((bh, lq, 1), jnp.float32)]
    with pallas_mode.kernel_defaults():
        o, lse = pl.pallas_call(
            functools.partial(_forward_kernel, **geometry),
            grid=(bh, lq // bq),
            in_specs=[_blocks(bq, d, 1), _blocks(lk, d, None), _blocks(lk, dv, None)],
            out_specs=[_blocks(bq, dv, 1), _blocks(bq, 1, 1)],
            out_shape=outs,
            cost_estimate=_cost(2, lq, lk, d, *args, *outs),
            name="flash_attention_forward",
        )(*args)
    out = o[:, :q.shape[-2]].reshape(*q.shape[:-1], dv)
    return out, lse


def _backward(q, k, v, out, lse, dout, scale, causal):
    geometry, (lq, lk) = _geometry(q, k, scale, causal)
    bq, bk, d, dv = geometry["block_q"], geometry["block_k"], q.shape[-1], v.shape[-1]
    bh = q.size // (q.shape[-2] * d)
    qf, kf, vf, dof = _flat(q, lq), _flat(k, lk), _flat(v, lk), _flat(dout, lq)
    delta = (dof.astype(jnp.float32) * _flat(out, lq).astype(jnp.float32)).sum(-1, keepdims=True)
    with pallas_mode.kernel_defaults():
        dq = pl.pallas_call(
            functools.partial(_dq_kernel, **geometry),
            grid=(bh, lq // bq),
            in_specs=[_blocks(bq, d, 1), _blocks(lk, d, None), _blocks(lk, dv, None),
                      _blocks(bq, dv, 1), _blocks(bq, 1, 1), _blocks(bq, 1, 1)],
            out_specs=_blocks(bq, d, 1),
            out_shape=jax.ShapeDtypeStruct((bh, lq, d), q.dtype),
            cost_estimate=_cost(3, lq, lk, d, qf, kf, vf, dof, lse, delta, qf),
            name="flash_attention_dq",
        )(qf, kf, vf, dof, lse, delta)
    with pallas_mode.kernel_defaults():
        dk, dvv = pl.pallas_call(
            functools.partial(_dkv_kernel, **geometry),
            grid=(bh, lk // bk),
            in_specs=[_blocks(lq, d, None), _blocks(bk, d, 1), _blocks(bk, dv, 1),
                      _blocks(lq, dv, None), _blocks(lq, 1, None), _blocks(lq, 1, None)],
            out_specs=[_blocks(bk, d, 1), _blocks(bk, dv, 1)],
            out_shape=[jax.ShapeDtypeStruct((bh, lk, d), k.dtype),
                       jax.ShapeDtypeStruct((bh, lk, dv), v.dtype)],
            cost_estimate=_cost(4, lq, lk, d, qf, kf, vf, dof, lse, delta, kf, vf),
            name="flash_attention_dkv",
        )(qf, kf, vf, dof, lse, delta)
    cut = q.shape[-2], k.shape[-2]
    return (dq[:, :cut[0]].reshape(q.shape), dk[:, :cut[1]].reshape(k.shape),
            dvv[:, :cut[1]].reshape(v.shape))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def flash_attention_jax(q, k, v, scale: float, causal: bool):
    """Blocked attention on JAX arrays (differentiable through the Pallas backward kernels)."""
    return _forward(q, k, v, scale, causal)[0]


def _fwd(q, k, v, scale, causal):
    out, lse = _forward(q, k, v, scale, causal)
    return out, (q, k, v, out, lse)


def _bwd(scale, causal, residuals, dout):
    return _backward(*residuals, dout, scale, causal)


flash_attention_jax.defvjp(_fwd, _bwd)


def _flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, is_causal: bool = False,
                     scale: float | None = None) -> jax.Array:
    if q.shape[:-2] != k.shape[:-2] or k.shape[:-1] != v.shape[:-1] or q.shape[-1] != k.shape[-1]:
        raise ValueError(errors.message(
            "kernel", f"torchtpu::flash_attention: q {q.shape}, k {k.shape}, v {v.shape} do "
            "not fit (batch..., length, head_dim); k and v need q's batch and heads"))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return flash_attention_jax(q, k, v, float(scale), bool(is_causal))


flash_attention = jax_op("torchtpu::flash_attention", _flash_attention)
flash_attention.__doc__ = """``flash_attention(q, k, v, is_causal=False, scale=None)``: attention
over (batch..., length, head_dim) tensors as ``F.scaled_dot_product_attention`` computes it
(causal mask aligned top-left), in blocked Pallas kernels forward and backward."""
