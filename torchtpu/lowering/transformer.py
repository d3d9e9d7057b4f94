"""PyTorch's inference fast paths of ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer``:
``aten._native_multi_head_attention`` and ``aten._transformer_encoder_layer_fwd``.

PyTorch takes them on any device it supports natively, PrivateUse1 included, when a module runs
in eval mode without autograd; they have no decomposition, so without these lowerings every such
call ran on CPU. The math is PyTorch's: queries scaled by ``1/sqrt(head_dim)`` before the product,
a boolean mask drops True positions, a float mask is added, a row left with nothing to attend to
gives zeros; a key padding mask (``mask_type`` 1) is (batch, source), a source mask (0) is
(target, source).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch

from torchtpu.lowering.layers import _affine, _gelu, _normalize, _wide
from torchtpu.lowering.registry import lowers

aten = torch.ops.aten


def _linear(x, weight, bias):
    return jnp.matmul(x, weight.T) + bias


def _heads(x, num_heads: int):
    b, t, d = x.shape
    return x.reshape(b, t, num_heads, d // num_heads).transpose(0, 2, 1, 3)


def _scores_mask(mask, mask_type, scores):
    if mask.ndim == 2 and mask_type == 1:  # (batch, source): the same for every target
        mask = mask[:, None, None, :]
    return jnp.broadcast_to(mask, scores.shape)


def _attention(q, k, v, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias,
               mask, mask_type):
    """(output, weights per head) of PyTorch's native multi-head attention."""
    wq, wk, wv = jnp.split(qkv_weight, 3)
    bq, bk, bv = jnp.split(qkv_bias, 3)
    q = _heads(_linear(q, wq, bq), num_heads) / math.sqrt(embed_dim // num_heads)
    k, v = _heads(_linear(k, wk, bk), num_heads), _heads(_linear(v, wv, bv), num_heads)
    scores = jnp.matmul(q, jnp.swapaxes(k, -1, -2))
    if mask is not None:
        mask = _scores_mask(mask, mask_type, scores)
        scores = jnp.where(mask, -jnp.inf, scores) if mask.dtype == jnp.bool_ \
            else scores + mask.astype(scores.dtype)
    empty = jnp.all(scores == -jnp.inf, axis=-1, keepdims=True)
    weights = jnp.where(empty, 0, jax.nn.softmax(jnp.where(empty, 0, scores), axis=-1))
    out = jnp.matmul(weights, v).transpose(0, 2, 1, 3).reshape(q.shape[0], q.shape[2], embed_dim)
    return _linear(out, proj_weight, proj_bias), weights


@lowers(aten._native_multi_head_attention.default)
def native_multi_head_attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias,
                                proj_weight, proj_bias, mask=None, need_weights=True,
                                average_attn_weights=True, mask_type=None):
    out, weights = _attention(_wide(query), _wide(key), _wide(value), embed_dim, num_head,
                              qkv_weight, qkv_bias, proj_weight, proj_bias, mask, mask_type)
    if not need_weights:
        return out, jnp.zeros((0,), out.dtype)
    return out, weights.mean(axis=1) if average_attn_weights else weights


def _layer_norm(x, weight, bias, eps):
    return _affine(_normalize(x, (x.ndim - 1,), eps)[0], weight, bias)


@lowers(aten._transformer_encoder_layer_fwd.default)
def transformer_encoder_layer(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight,
                              proj_bias, use_gelu, norm_first, eps, norm_weight_1, norm_bias_1,
                              norm_weight_2, norm_bias_2, ffn_weight_1, ffn_bias_1, ffn_weight_2,
                              ffn_bias_2, mask=None, mask_type=None):
    x = _wide(src)
    if x.size == 0:
        return x

    def attend(h):
        return _attention(h, h, h, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight,
                          proj_bias, mask, mask_type)[0]

    def feed_forward(h):
        h = _linear(h, ffn_weight_1, ffn_bias_1)
        h = _gelu(h, "none") if use_gelu else jnp.maximum(h, 0)
        return _linear(h, ffn_weight_2, ffn_bias_2)

    if norm_first:
        x = x + attend(_layer_norm(x, norm_weight_1, norm_bias_1, eps))
        return x + feed_forward(_layer_norm(x, norm_weight_2, norm_bias_2, eps))
    x = _layer_norm(x + attend(x), norm_weight_1, norm_bias_1, eps)
    return _layer_norm(x + feed_forward(x), norm_weight_2, norm_bias_2, eps)
