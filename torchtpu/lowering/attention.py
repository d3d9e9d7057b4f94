"""``F.scaled_dot_product_attention`` on tpu as one fused op forward and one backward.

PyTorch picks an SDPA backend through ``_fused_sdp_choice_stub``, a C++ DispatchStub that only a
C++ extension can fill for PrivateUse1; without it every call takes the math path (~15 ATen ops
forward, ~20 backward). So this module serves ``aten::scaled_dot_product_attention`` itself for
the device (Autograd and plain PrivateUse1 keys): ``sdp_choice`` (also the device's
``aten::_fused_sdp_choice`` kernel) picks OVERRIDEABLE or MATH, and the call becomes
``_scaled_dot_product_fused_attention_overrideable``, whose autograd formula calls the
overrideable backward; anything else runs PyTorch's own composite (math path, its checks and
errors). Both overrideable ops are lowered here, so eager and compiled graphs share them.

Numerics follow the math path: scores in float32 (float64 inputs take the math path itself), a
causal mask aligned top-left (``tril(ones(L, S))``), a boolean mask keeps True, a float mask is
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

import math

import jax
import jax.numpy as jnp
import torch
from jax import lax

from torchtpu.lowering.registry import lowers

aten = torch.ops.aten
_SDPBackend = torch._C._SDPBackend
_HIGHEST = lax.Precision.HIGHEST
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------- lowerings

def _mm(spec: str, a, b):
    return jnp.einsum(spec, a, b, precision=_HIGHEST, preferred_element_type=jnp.float32)


def _scores(q, k, attn_bias, is_causal: bool, scale: float | None):
    """Masked, scaled float32 scores (N, H, L, S) and the scale used."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = _mm("nhle,nhse->nhls", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    if is_causal:
        L, S = s.shape[-2:]
        s = jnp.where(jnp.tril(jnp.ones((L, S), bool)), s, -jnp.inf)
    if attn_bias is not None:
        if attn_bias.dtype == jnp.bool_:
            s = jnp.where(attn_bias, s, -jnp.inf)
        else:
            s = s + attn_bias.astype(jnp.float32)
    return s, scale


def _probabilities(s, lse):
    # A fully masked row has lse = -inf; its probabilities are 0 (exp(-inf - 0)).
    return jnp.exp(s - jnp.where(jnp.isneginf(lse), 0.0, lse)[..., None])


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
@lowers(aten._scaled_dot_product_fused_attention_overrideable.default, random=_has_dropout)
def sdpa_forward(key, q, k, v, attn_bias=None, dropout_p=0.0, is_causal=False,
                 return_debug_mask=False, scale=None):
    s, _ = _scores(q, k, attn_bias, is_causal, scale)
    m = s.max(-1)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    lse = m + jnp.log(jnp.exp(s - m[..., None]).sum(-1))
    p = _probabilities(s, lse)
    # The key travels to backward as philox_seed (the offset stays 0): backward rebuilds it and
    # draws the same mask, so no mask is stored and the op stays a pure function of its inputs.
    seed = _pack_key(key) if dropout_p > 0.0 else jnp.zeros((), jnp.int64)
    if dropout_p > 0.0:
        p = p * _dropout_scale(key, p.shape, dropout_p)
    out = _mm("nhls,nhsv->nhlv", p, v.astype(jnp.float32))
    # cum_seq_q/k and the debug mask are undefined (no nested tensors, no debug mask); max_q and
    # max_k are the sequence lengths.
    return out, lse, None, None, q.shape[-2], k.shape[-2], seed, jnp.zeros((), jnp.int64), None


def _sum_to(x, shape: tuple):
    """Reduce a broadcast gradient back to an operand's shape."""
    lead = x.ndim - len(shape)
    x = x.sum(tuple(range(lead))) if lead else x
    axes = tuple(i for i, d in enumerate(shape) if d == 1 and x.shape[i] != 1)
    return x.sum(axes, keepdims=True) if axes else x


@lowers(aten._scaled_dot_product_fused_attention_overrideable_backward.default)
def sdpa_backward(grad_out, q, k, v, attn_bias, grad_input_mask, out, lse, cum_seq_q, cum_seq_k,
                  max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, scale=None):
    s, scale = _scores(q, k, attn_bias, is_causal, scale)
    p = _probabilities(s, lse)
    g = grad_out.astype(jnp.float32)
    dp = _mm("nhlv,nhsv->nhls", g, v.astype(jnp.float32))
    if dropout_p > 0.0:
        drop = _dropout_scale(_unpack_key(philox_seed), p.shape, dropout_p)
        dp = dp * drop
    # d(softmax): rowsum(p * dp) equals rowsum(grad_out * out), without out's rounding.
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    if dropout_p > 0.0:
        p = p * drop  # what multiplied v in forward
    want_q, want_k, want_v, want_bias = grad_input_mask
    dq = _mm("nhls,nhse->nhle", ds, k.astype(jnp.float32)) * scale if want_q else None
    dk = _mm("nhls,nhle->nhse", ds, q.astype(jnp.float32)) * scale if want_k else None
    dv = _mm("nhls,nhlv->nhsv", p, g) if want_v else None
    dbias = None
    if want_bias and attn_bias is not None and attn_bias.dtype != jnp.bool_:
        dbias = _sum_to(ds, attn_bias.shape)
    return dq, dk, dv, dbias


# ----------------------------------------------------------------------------- backend choice

def _broadcastable(shape, target) -> bool:
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def sdp_choice(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
               scale=None, enable_gqa=False) -> int:
    """OVERRIDEABLE where the fused lowering computes what the math path would, else MATH.

    MATH also gets every call PyTorch would reject (mismatched dtypes or shapes), so its own
    composite raises its own errors.
    """
    fused = int(_SDPBackend.OVERRIDEABLE)
    math_path = int(_SDPBackend.MATH)
    if any(t.dim() != 4 for t in (query, key, value)):
        return math_path
    # float64 keeps the math path: the fused op's logsumexp is float32 by its schema's meta.
    if not (query.dtype == key.dtype == value.dtype and query.dtype in _FUSED_DTYPES):
        return math_path
    n, h, L, e = query.shape
    if key.shape[:2] != (n, h) or value.shape[:3] != key.shape[:3] or key.shape[-1] != e:
        return math_path  # GQA (enable_gqa with fewer k/v heads) included
    if attn_mask is not None:
        if is_causal or attn_mask.dtype not in (torch.bool, query.dtype):
            return math_path
        if not _broadcastable(attn_mask.shape, (n, h, L, key.shape[2])):
            return math_path
    if any(t.device != query.device for t in (key, value, attn_mask) if t is not None):
        return math_path
    return fused


# (min length, op) installed by an upper layer (``torch.tpu.ops.flash_sdpa``): calls without
# mask and dropout at least that long go to op(q, k, v, is_causal, scale) instead.
_long_sequence_path: list = [None]


def set_long_sequence_path(path: tuple | None) -> None:
    _long_sequence_path[0] = path


def _long_sequence_op(query, key, attn_mask, dropout_p, enable_gqa):
    path = _long_sequence_path[0]
    if path is None or attn_mask is not None or dropout_p > 0.0 or enable_gqa:
        return None
    min_len, op = path
    if max(query.shape[-2], key.shape[-2]) < min_len or query.dim() != 4:
        return None
    return op


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    long_op = _long_sequence_op(query, key, attn_mask, dropout_p, enable_gqa)
    if long_op is not None and sdp_choice(query, key, value) == int(_SDPBackend.OVERRIDEABLE):
        return long_op(query, key, value, is_causal, scale)
    if sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                  enable_gqa=enable_gqa) == int(_SDPBackend.OVERRIDEABLE):
        return aten._scaled_dot_product_fused_attention_overrideable.default(
            query, key, value, attn_mask, dropout_p, is_causal, False, scale=scale)[0]
    return aten.scaled_dot_product_attention.default.decompose(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def register(lib: torch.library.Library) -> None:
    """Serve SDPA and the backend choice for the device (``lib``: an ``aten`` IMPL library).

    The Autograd key is where a CompositeImplicitAutograd op is decomposed, so SDPA is taken
    there (the overrideable op then records its own backward); the PrivateUse1 key serves calls
    that skip autograd (inference mode).
    """
    lib.impl(aten._fused_sdp_choice.default, sdp_choice, "PrivateUse1")
    for key in ("AutogradPrivateUse1", "PrivateUse1"):
        lib.impl(aten.scaled_dot_product_attention.default, _sdpa, key)
