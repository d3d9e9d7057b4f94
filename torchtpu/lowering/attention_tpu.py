"""Causal self-attention through JAX's Pallas splash kernel, the form SDPA's fused op takes in
programs lowered for a TPU, where it is faster than XLA's.

The rule, measured on a v5e chip (bench/RESULTS.md, "Attention on the v5e chip"; ``python
bench/tpu_attention.py``): for causal self-attention without mask or dropout, bfloat16 or
float16 q, k and v of shape (batch, heads, length, head_dim) with head_dim a multiple of 128 and
length a multiple of 512 from 1024 on, the splash kernel with 512 x 512 blocks and its fused
backward kernel ran forward + backward in 0.96 ms at 8 x 8 x 1024 x 128 (XLA's naive form 3.17
ms) and 1.41 ms at 4 x 8 x 2048 x 128 (6.02 ms), and took the JAX twin of the Llama step from
106 to 83 ms (1024 tokens) and from 168 to 90 ms (2048). At the kernel's default 128 blocks it
was slower than XLA's form (4.43 and 8.24 ms): block sizes decide it. Other calls keep XLA's form
(``attention.py``), as does every other platform: ``applies`` is decided on static facts, and
``jax.lax.platform_dependent`` lowers the kernel only for a TPU.

The forward keeps the kernel's log-sum-exp (SDPA's ``lse`` output); the backward runs the
kernel's own backward rule from (q, k, v, out, lse), as JAX's autodiff of the kernel would, with
no second forward. That rule (``_splash_attention_bwd``) is JAX's registered VJP of the kernel,
reached by name: ``tests/test_attention_tpu.py`` runs both through the Pallas interpreter against
CPU, so a JAX release that moves it fails there, not on a chip.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

BLOCK = 512
MIN_LENGTH = 1024
_HALF = (jnp.bfloat16, jnp.float16)


def applies(q, k, v, attn_bias, dropout_p: float, is_causal: bool) -> bool:
    """Whether a call of SDPA's fused op takes the splash kernel where it runs on a TPU."""
    if attn_bias is not None or dropout_p > 0.0 or not is_causal:
        return False
    if q.ndim != 4 or not (q.shape == k.shape == v.shape):
        return False
    if not (q.dtype == k.dtype == v.dtype and q.dtype in _HALF):
        return False
    length, dim = q.shape[2], q.shape[3]
    return dim % 128 == 0 and length >= MIN_LENGTH and length % BLOCK == 0


@functools.lru_cache(maxsize=64)
def kernel(heads: int, length: int, interpret: bool = False):
    """The splash kernel for causal attention over ``heads`` heads of ``length`` positions,
    returning its log-sum-exp too, with 512 x 512 blocks and the fused backward kernel."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as sk,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as sm,
    )

    b = min(BLOCK, length)
    blocks = sk.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b,
                           block_kv_dkv=b, block_kv_dkv_compute=b, use_fused_bwd_kernel=True)
    mask = sm.MultiHeadMask([sm.CausalMask((length, length)) for _ in range(heads)])
    # The kernel keeps its block tables as arrays: made concrete here, not as a tracer of the
    # program being traced, since the kernel outlives it (cached for the next program), and on
    # this process's own first device (a compile-only TPU target's devices run nothing).
    with jax.ensure_compile_time_eval(), jax.default_device(jax.local_devices()[0]), \
            _as_mosaic_takes_it():
        return sk.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=blocks,
                                  save_residuals=True, interpret=interpret)


@contextlib.contextmanager
def _as_mosaic_takes_it():
    """Trace the kernel as a JAX program that never set x64 would: 32-bit indices (Mosaic's
    verifier refuses the int64 arithmetic x64 makes of them) and one-pass bf16 products."""
    with jax.enable_x64(False), jax.default_matmul_precision("default"):
        yield


def forward(q, k, v, scale: float, interpret: bool = False):
    """(out in q's dtype, lse float32 (batch, heads, length)) of causal attention."""
    run = kernel(q.shape[1], q.shape[2], interpret)
    scaled = (q * scale).astype(q.dtype)
    with _as_mosaic_takes_it():
        out, (lse,) = jax.vmap(run)(scaled, k, v)
    return out.astype(q.dtype), lse.astype(jnp.float32)


def backward(q, k, v, out, lse, grad_out, scale: float, interpret: bool = False):
    """(dq, dk, dv) in the inputs' dtype, from the forward's out and lse."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as sk,
    )

    run = kernel(q.shape[1], q.shape[2], interpret)
    kw = run.kwargs

    def one(q, k, v, out, lse, g):
        res = (q, k, v, None, None, out, lse, run.dq_mask_info, run.dkv_mask_info)
        grads = sk._splash_attention_bwd(
            False, kw["mask_value"], kw["is_mqa"], kw["block_sizes"],
            kw["residual_checkpoint_name"], kw["mask_function"], kw["attn_logits_soft_cap"],
            kw["interpret"], res, g)
        return grads[3:6]

    args = ((q * scale).astype(q.dtype), k, v, out.astype(q.dtype), lse,
            grad_out.astype(q.dtype))
    with _as_mosaic_takes_it():
        dq, dk, dv = jax.vmap(one)(*args)
    return (dq * scale).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
