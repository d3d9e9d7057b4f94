"""``F.scaled_dot_product_attention``'s fused op on tpu, forward and backward, and the flash
form of attention (``aten._flash_attention_forward/backward``, dense and variable-length) on the
same math.

The lowerings here are ``aten._scaled_dot_product_fused_attention_overrideable`` and its
backward, pure JAX functions shared by eager and compiled graphs; which calls reach them (the
SDPA backend choice, ``sdpa_kernel``, the long-sequence flash path) is decided on tensors, by
``eager/sdpa_routing.py``.

Numerics: scores, softmax and every product's accumulation in float32 (float64 inputs take the
math path itself). Products take their operands in the inputs' dtype: a half-precision q @ k and
grad_out @ v are exact products summed in float32 (what upcasting first gives, at a quarter of
the bytes), and the probabilities and score gradients are rounded to that dtype before their
products with v, grad_out, k and q, as FlashAttention and PyTorch's CPU flash kernel do (float32
(L, S) operands were most of a bf16 GPT-2 block's traffic on TPU). A causal mask aligned
top-left (``tril(ones(L, S))``), a boolean mask keeps True, a float mask is
added, and a row with nothing left to attend to gives zeros (``_safe_softmax``), not NaN.

Dropout (``dropout_p > 0``) drops attention probabilities after the softmax, keeping each with
probability ``1 - p`` and scaling kept ones by ``1 / (1 - p)``. Its mask comes from the default
device generator (a lowering that draws a key only for calls with dropout), so a seed replays
it in every executor, and attention without dropout leaves the generator where it was. The
forward returns the key it used, packed bit for bit into ``philox_seed`` (``philox_offset`` is
0), and the backward draws the same mask again from it: no mask is stored, and both ops stay pure
functions of their inputs, so AOTAutograd hands the key from the compiled forward to the compiled
backward like any saved tensor.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import torch
import torch.fx as fx
from jax import lax

from torchtpu.lowering import attention_tpu
from torchtpu.lowering.padding import Mask, Refused, padded, same, val
from torchtpu.lowering.registry import META_STRIDES, lowers, padding_rule, size_arguments

aten = torch.ops.aten
_HIGHEST = lax.Precision.HIGHEST


# ----------------------------------------------------------------------------- lowerings

def _mm(spec: str, a, b):
    return jnp.einsum(spec, a, b, precision=_HIGHEST, preferred_element_type=jnp.float32)


def _low(x, like):
    """x rounded to like's dtype when that is half precision (an (L, S) operand of a product,
    as flash kernels keep it), else float32."""
    return x.astype(like.dtype if like.dtype in (jnp.bfloat16, jnp.float16) else jnp.float32)


def _scale(q, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def _scores(q, k, attn_bias, is_causal: bool, scale: float | None):
    """Masked, scaled float32 scores (N, H, L, S) and the scale used."""
    scale = _scale(q, scale)
    s = _mm("nhle,nhse->nhls", _low(q, q), _low(k, q)) * scale
    if is_causal:
        # tril's positions in int32 (under x64 jnp.tril compares int64 ones, emulated on a TPU)
        rows = lax.broadcasted_iota(jnp.int32, s.shape[-2:], 0)
        s = jnp.where(rows >= lax.broadcasted_iota(jnp.int32, s.shape[-2:], 1), s, -jnp.inf)
    if attn_bias is not None:
        if attn_bias.dtype == jnp.bool_:
            s = jnp.where(attn_bias, s, -jnp.inf)
        else:
            s = s + attn_bias.astype(jnp.float32)
    return s, scale


def _softmax(s):
    """Row probabilities of scores and their logsumexp; a row with nothing to attend to has
    probabilities 0 and logsumexp -inf. The probabilities are exp(s - max) / sum, as CPU's
    softmax computes them, not exp(s - logsumexp): with large scores the logsumexp's rounding
    (its ulp at 5000 is 5e-4) would scale every probability, a lone one included."""
    # (initial: no keys, S = 0, is a row with nothing to attend to, as CPU's math path has it)
    m = s.max(-1, keepdims=True, initial=-jnp.inf)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    e = jnp.exp(s - m)
    total = e.sum(-1, keepdims=True)
    p = e / jnp.where(total == 0, 1.0, total)
    return p, (m + jnp.log(total))[..., 0]


def _pack_key(key):
    """A PRNG key's two uint32 words as one int64, bit for bit (the philox_seed tensor)."""
    lo, hi = jax.random.key_data(key).astype(jnp.uint64)
    return lax.bitcast_convert_type((hi << 32) | lo, jnp.int64)


def _unpack_key(seed):
    """The key _pack_key packed into seed."""
    bits = lax.bitcast_convert_type(seed, jnp.uint64)
    words = jnp.stack([bits & 0xFFFFFFFF, bits >> 32]).astype(jnp.uint32)
    return jax.random.wrap_key_data(words, impl="threefry2x32")


def _dropout_scale(key, shape: tuple, dropout_p: float):
    """Per-probability factors: 1 / (1 - p) where kept (probability 1 - p), 0 where dropped."""
    keep = 1.0 - dropout_p
    if keep == 0.0:
        return jnp.zeros(shape, jnp.float32)
    kept = jax.random.uniform(key, shape, jnp.float32) < keep
    return jnp.where(kept, jnp.float32(1.0 / keep), jnp.float32(0.0))


def _has_dropout(q, k, v, attn_bias=None, dropout_p=0.0, *_, **__) -> bool:
    return dropout_p > 0.0


# Only a call with dropout draws a key: without it the device generator does not advance, as
# with PyTorch's own fused kernels.
@lowers(aten._scaled_dot_product_fused_attention_overrideable.default, random=_has_dropout,
        layout=META_STRIDES)
def sdpa_forward(key, q, k, v, attn_bias=None, dropout_p=0.0, is_causal=False,
                 return_debug_mask=False, scale=None):
    def dense(q, k, v):
        s, _ = _scores(q, k, attn_bias, is_causal, scale)
        p, lse = _softmax(s)
        if dropout_p > 0.0:
            p = p * _dropout_scale(key, p.shape, dropout_p)
        return _mm("nhls,nhsv->nhlv", _low(p, v), _low(v, v)).astype(q.dtype), lse

    if attention_tpu.applies(q, k, v, attn_bias, dropout_p, is_causal):
        tpu = functools.partial(attention_tpu.forward, scale=_scale(q, scale))
        out, lse = lax.platform_dependent(q, k, v, tpu=tpu, default=dense)
    else:
        out, lse = dense(q, k, v)
    # The key travels to backward as philox_seed (the offset stays 0): backward rebuilds it and
    # draws the same mask, so no mask is stored and the op stays a pure function of its inputs.
    seed = _pack_key(key) if dropout_p > 0.0 else jnp.zeros((), jnp.int64)
    # cum_seq_q/k and the debug mask are undefined (no nested tensors, no debug mask); max_q and
    # max_k are the sequence lengths.
    return out, lse, None, None, q.shape[-2], k.shape[-2], seed, jnp.zeros((), jnp.int64), None


def _gradients(p, grad_out, q, k, v, scale: float, drop=None, want=(True, True, True)):
    """dq, dk, dv (float32, None where not wanted) and d(scores) of out = (p * drop) @ v."""
    g = _low(grad_out, v)
    dp = _mm("nhlv,nhsv->nhls", g, _low(v, v))
    if drop is not None:
        dp = dp * drop
    # d(softmax): rowsum(p * dp) equals rowsum(grad_out * out), without out's rounding.
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    if drop is not None:
        p = p * drop  # what multiplied v in forward
    want_q, want_k, want_v = want
    dq = _mm("nhls,nhse->nhle", _low(ds, k), _low(k, k)) * scale if want_q else None
    dk = _mm("nhls,nhle->nhse", _low(ds, q), _low(q, q)) * scale if want_k else None
    dv = _mm("nhls,nhlv->nhsv", _low(p, v), g) if want_v else None
    return dq, dk, dv, ds


def _sum_to(x, shape: tuple):
    """Reduce a broadcast gradient back to an operand's shape."""
    lead = x.ndim - len(shape)
    x = x.sum(tuple(range(lead))) if lead else x
    axes = tuple(i for i, d in enumerate(shape) if d == 1 and x.shape[i] != 1)
    return x.sum(axes, keepdims=True) if axes else x


@lowers(aten._scaled_dot_product_fused_attention_overrideable_backward.default,
        layout=META_STRIDES)
def sdpa_backward(grad_out, q, k, v, attn_bias, grad_input_mask, out, lse, cum_seq_q, cum_seq_k,
                  max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, scale=None):
    if attention_tpu.applies(q, k, v, attn_bias, dropout_p, is_causal):
        def dense(grad_out, q, k, v, out, lse):
            s, scale_ = _scores(q, k, None, True, scale)
            p, _ = _softmax(s)
            grads = _gradients(p, grad_out, q, k, v, scale_)[:3]
            return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))

        tpu = functools.partial(attention_tpu.backward, scale=_scale(q, scale))
        grads = lax.platform_dependent(grad_out, q, k, v, out, lse,
                                       tpu=lambda g, q, k, v, o, lse: tpu(q, k, v, o, lse, g),
                                       default=dense)
        return tuple(g if want else None for g, want in zip(grads, grad_input_mask[:3])) + (None,)
    s, scale = _scores(q, k, attn_bias, is_causal, scale)
    p, _ = _softmax(s)  # recomputed as the forward computed them (lse is its by-product)
    drop = None
    if dropout_p > 0.0:
        drop = _dropout_scale(_unpack_key(philox_seed), p.shape, dropout_p)
    dq, dk, dv, ds = _gradients(p, grad_out, q, k, v, scale, drop, grad_input_mask[:3])
    want_bias = grad_input_mask[3]
    dbias = None
    if want_bias and attn_bias is not None and attn_bias.dtype != jnp.bool_:
        dbias = _sum_to(ds, attn_bias.shape)
    return dq, dk, dv, dbias


# Dynamic shapes: the backward's max_q and max_k only set sizes.
size_arguments(aten._scaled_dot_product_fused_attention_overrideable_backward.default, 10, 11)
_ATTENTION = {
    # (is_causal index, attn_bias index, masked args) of the forward and the backward.
    aten._scaled_dot_product_fused_attention_overrideable.default: (5, 3, (1, 2)),
    aten._scaled_dot_product_fused_attention_overrideable_backward.default: (
        13, 4, (0, 1, 2, 3, 6, 7)),
}


@padding_rule(*_ATTENTION)
def _attention_padding(node: fx.Node, layouts: dict) -> list:
    """Dynamic shapes: padded keys and values are zeroed forward; backward also zeroes the
    padded query rows' inputs, which would otherwise reach real keys' gradients. What keeps real
    queries off padded keys is causality (a padded key comes after every real query) or the
    attention mask, whose padded key columns are set to "never attend" (False, or -inf for an
    additive mask)."""
    causal, bias, masked = _ATTENTION[node.target]
    args = node.args
    seq = [layouts[args[i]][2] for i in masked]
    if not padded((seq[0],), [0]):
        return []
    same(seq, f"{node.target} attends")
    if len(seq[0]) > 1:
        raise Refused(f"{node.target} over a merged dim")
    out = [Mask(i, (2,), "zero") for i in masked]
    mask = args[bias] if len(args) > bias else None
    if isinstance(mask, fx.Node):
        key_dim = val(mask).dim() - 1
        if layouts[mask][key_dim] != seq[0]:
            raise Refused(f"{node.target}: the attention mask's key dim is not the keys'")
        never = "false" if val(mask).dtype == torch.bool else "lowest"
        return [*out, Mask(bias, (key_dim,), never)]
    if len(args) > causal and args[causal] is True:
        return out
    raise Refused(f"{node.target} over a symbolic length without a causal or attention mask")


# ----------------------------------------------------------------------------- flash form
# ``aten._flash_attention_forward/backward``, which PyTorch's ``varlen_attn`` (TorchTitan's varlen
# backend) and direct callers use. Dense form: q (B, L, H, E), logsumexp (B, H, L). Varlen form:
# sequences packed along dim 0, q (T, H, E), ``cum_seq_q/k`` their (N + 1,) offsets, logsumexp
# (H, T). Both become one padded (N, H, max_len, E) batch with per-sequence lengths, so the SDPA
# math above serves them: a sequence's tokens are gathered into its row and gathered back out
# (each token sits in exactly one row, so the backward needs no scatter-add). As in FlashAttention,
# causal and window masks are aligned bottom-right (query i of a sequence sees key j when
# j - (i + len_k - len_q) lies in [-left, right], -1 meaning unbounded; causal sets right = 0),
# and K/V may have fewer heads than Q (grouped queries). A query with no key to attend to gets
# zeros and logsumexp -inf (FlashAttention: +inf); tokens outside every sequence get zeros, and
# so do those past max_q/max_k in a sequence longer than that (the caller's promise; values
# cannot be checked inside a program).

def _flash_check(dropout_p, return_debug_mask, seqused_k=None, alibi_slopes=None,
                 block_table=None) -> None:
    unsupported = [name for name, bad in (
        ("dropout_p > 0", dropout_p > 0.0), ("return_debug_mask", return_debug_mask),
        ("seqused_k", seqused_k is not None), ("alibi_slopes", alibi_slopes is not None),
        ("block_table", block_table is not None)) if bad]
    if unsupported:
        raise NotImplementedError(
            f"torchtpu.unsupported: aten._flash_attention_forward with {', '.join(unsupported)} "
            f"has no tpu lowering; use F.scaled_dot_product_attention (fused on tpu, dropout "
            f"included) or drop the argument")


def _padded(x, cum, max_len: int):
    """(N, H, max_len, E) rows of x: a dense (B, L, H, E) batch, or packed (T, H, E) sequences."""
    if cum is None:
        return x.transpose(0, 2, 1, 3)
    idx = cum[:-1, None] + jnp.arange(max_len)
    return jnp.take(x, idx, axis=0, mode="fill", fill_value=0).transpose(0, 2, 1, 3)


def _lengths(x, cum, max_len: int):
    if cum is None:
        return jnp.full((x.shape[0],), x.shape[1], jnp.int32)
    return jnp.minimum(cum[1:] - cum[:-1], max_len)


def _unpadded(y, cum, total: int):
    """The inverse of _padded: (N, H, max_len, E) rows back to x's layout (zeros between rows)."""
    y = y.transpose(0, 2, 1, 3)
    if cum is None:
        return y
    n_rows, max_len = y.shape[:2]
    t = jnp.arange(total)
    row = (t[:, None] >= cum[None, 1:]).sum(1)  # the sequence each token falls in
    pos = t - cum[jnp.minimum(row, n_rows - 1)]
    inside = (row < n_rows) & (pos >= 0) & (pos < max_len)
    picked = y[jnp.minimum(row, n_rows - 1), jnp.clip(pos, 0, max_len - 1)]
    return jnp.where(inside[:, None, None], picked, jnp.zeros((), y.dtype))


def _flash_inputs(q, k, v, cum_q, cum_k, max_q: int, max_k: int, is_causal: bool,
                  left: int | None, right: int | None):
    """Padded q, k, v (K/V heads repeated to Q's) and the (N, 1, L, S) mask of allowed pairs."""
    max_q = q.shape[1] if cum_q is None else max_q
    max_k = k.shape[1] if cum_k is None else max_k
    qp, kp, vp = _padded(q, cum_q, max_q), _padded(k, cum_k, max_k), _padded(v, cum_k, max_k)
    heads, kv_heads = qp.shape[1], kp.shape[1]
    if heads % kv_heads:
        raise ValueError(f"torchtpu.argument: aten._flash_attention_forward: {heads} query heads "
                         f"are not a multiple of {kv_heads} key/value heads")
    kp, vp = jnp.repeat(kp, heads // kv_heads, 1), jnp.repeat(vp, heads // kv_heads, 1)
    len_q = _lengths(q, cum_q, max_q)[:, None, None]
    len_k = _lengths(k, cum_k, max_k)[:, None, None]
    i, j = jnp.arange(max_q)[:, None], jnp.arange(max_k)[None, :]
    keep = (i < len_q) & (j < len_k)
    diagonal = i + (len_k - len_q)
    right = 0 if is_causal else right
    if right is not None and right >= 0:
        keep = keep & (j <= diagonal + right)
    if left is not None and left >= 0:
        keep = keep & (j >= diagonal - left)
    return qp, kp, vp, keep[:, None]


def _grouped(dx, kv_heads: int):
    """Sum a repeated K/V head's gradient over the query heads that shared it."""
    n, heads, s, e = dx.shape
    return dx.reshape(n, kv_heads, heads // kv_heads, s, e).sum(2)


@lowers(aten._flash_attention_forward.default)
def flash_forward(q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                  return_debug_mask, scale=None, window_size_left=None, window_size_right=None,
                  seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
    # num_splits only picks how a GPU kernel splits its reduction.
    _flash_check(dropout_p, return_debug_mask, seqused_k, alibi_slopes, block_table)
    qp, kp, vp, keep = _flash_inputs(q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, is_causal,
                                     window_size_left, window_size_right)
    s, _ = _scores(qp, kp, keep, False, scale)
    p, lse = _softmax(s)
    out = _mm("nhls,nhsv->nhlv", _low(p, vp), _low(vp, vp))
    out = _unpadded(out, cum_seq_q, q.shape[0]).astype(q.dtype)
    if cum_seq_q is not None:
        lse = _unpadded(lse[..., None], cum_seq_q, q.shape[0])[..., 0].T
    # rng_state and unused: no dropout, so no generator state (zeros, as FlashAttention's).
    return (out, lse, jnp.zeros((2,), jnp.uint64), jnp.zeros((), jnp.uint64),
            jnp.zeros((0,), q.dtype))


@lowers(aten._flash_attention_backward.default)
def flash_backward(grad_out, q, k, v, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                   is_causal, rng_state, unused, scale=None, window_size_left=None,
                   window_size_right=None):
    _flash_check(dropout_p, False)
    qp, kp, vp, keep = _flash_inputs(q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, is_causal,
                                     window_size_left, window_size_right)
    s, scale = _scores(qp, kp, keep, False, scale)
    p, _ = _softmax(s)  # recomputed as the forward computed them (lse is its by-product)
    dq, dk, dv, _ = _gradients(p, _padded(grad_out, cum_seq_q, qp.shape[2]), qp, kp, vp, scale)
    kv_heads = k.shape[-2]
    dk, dv = _grouped(dk, kv_heads), _grouped(dv, kv_heads)
    return (_unpadded(dq, cum_seq_q, q.shape[0]).astype(q.dtype),
            _unpadded(dk, cum_seq_k, k.shape[0]).astype(k.dtype),
            _unpadded(dv, cum_seq_k, v.shape[0]).astype(v.dtype))


def _varlen_forward(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None,
                    window_size=None, enable_gqa=False, seqused_k=None, block_table=None,
                    num_splits=None):
    left, right = window_size or (-1, -1)
    out, lse, rng_state, _, _ = flash_forward(
        q, k, v, cu_seq_q, cu_seq_q if cu_seq_k is None else cu_seq_k, max_q, max_k, 0.0,
        is_causal, False, scale, left, right, seqused_k, None, block_table)
    return out, lse, rng_state


def _varlen_backward(grad_out, q, k, v, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal,
                     rng_state, scale=None, window_size=None):
    left, right = window_size or (-1, -1)
    return flash_backward(grad_out, q, k, v, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, 0.0,
                          is_causal, rng_state, None, scale, left, right)


def register_varlen() -> None:
    """Lower ``torch.nn.attention.varlen``'s custom ops, which a compiled graph holds whole (eager
    runs their Python bodies, which call the flash ops above). Called once that module is
    imported (it costs about as much as ``import torch`` itself, so torchtpu does not import it).
    cu_seq_k=None means the keys are packed as the queries are."""
    ops = torch.ops.torch_attn
    lowers(ops._varlen_attn.default)(_varlen_forward)
    lowers(ops._varlen_attn_backward.default)(_varlen_backward)
