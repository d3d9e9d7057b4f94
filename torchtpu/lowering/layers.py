"""The ops every transformer step runs, lowered whole: softmax and log-softmax, GELU, layer norm
and the NLL loss, forward and backward, plus ``addmm``; and group norm's forward.

PyTorch decomposes all of them, and those decompositions give the right numbers, but in eager
mode each costs a pass through PyTorch's Python references (about half a millisecond) and then a
dozen small ops; as one lowering each is one program call in Strict and one node in DeferAndFuse.
Half-precision inputs are computed in float32, as PyTorch's CPU kernels accumulate.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch

from torchtpu.lowering.linalg import _scaled_sum
from torchtpu.lowering.registry import lowers

aten = torch.ops.aten


def _wide(x):
    return x.astype(jnp.float32) if x.dtype in (jnp.float16, jnp.bfloat16) else x


@lowers(aten.addmm.default, promote="result")
def addmm(x, mat1, mat2, beta=1, alpha=1):
    return _scaled_sum(x, jnp.matmul(mat1, mat2), beta, alpha)


def _axis(x, dim):
    # PyTorch treats a 0-dim tensor as one element along dim 0 or -1.
    return dim if x.ndim else None


@lowers(aten._softmax.default)
def softmax(x, dim, half_to_float):
    return jax.nn.softmax(_wide(x), axis=_axis(x, dim))


@lowers(aten._log_softmax.default)
def log_softmax(x, dim, half_to_float):
    return jax.nn.log_softmax(_wide(x), axis=_axis(x, dim))


@lowers(aten._softmax_backward_data.default)
def softmax_backward(grad, out, dim, input_dtype):
    grad, out = _wide(grad), _wide(out)
    return out * (grad - jnp.sum(grad * out, axis=_axis(out, dim), keepdims=True))


@lowers(aten._log_softmax_backward_data.default)
def log_softmax_backward(grad, out, dim, input_dtype):
    grad, out = _wide(grad), _wide(out)
    return grad - jnp.exp(out) * jnp.sum(grad, axis=_axis(out, dim), keepdims=True)


def _gelu(x, approximate: str):
    if approximate == "tanh":
        inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)
        return 0.5 * x * (1 + jnp.tanh(inner))
    return 0.5 * x * (1 + jax.lax.erf(x * (1 / math.sqrt(2))))


@lowers(aten.gelu.default)
def gelu(x, approximate="none"):
    return _gelu(_wide(x), approximate)


@lowers(aten.gelu_backward.default)
def gelu_backward(grad, x, approximate="none"):
    _, pullback = jax.vjp(lambda v: _gelu(v, approximate), _wide(x))
    return pullback(_wide(grad))[0]


# SiLU (SwiGLU's gate in every Llama MLP), whole: its decomposition ran as five programs (casts
# to and from float32 around sigmoid and mul, a copy out). Its backward, ``silu_backward``, is
# CompositeImplicitAutograd: it reaches the device as its pieces.
@lowers(aten.silu.default)
def silu(x):
    x = _wide(x)
    return x * jax.lax.logistic(x)


def _layer_norm_axes(x, normalized_shape) -> tuple:
    return tuple(range(x.ndim - len(normalized_shape), x.ndim))


def _normalize(x, axes, eps):
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    rstd = jax.lax.rsqrt(var + eps)
    return (x - mean) * rstd, mean, rstd


def _affine(y, weight, bias):
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


@lowers(aten.native_layer_norm.default)
def native_layer_norm(x, normalized_shape, weight, bias, eps):
    axes = _layer_norm_axes(x, normalized_shape)
    y, mean, rstd = _normalize(_wide(x), axes, eps)
    return _affine(y, weight, bias), mean, rstd


@lowers(aten.native_group_norm.default)
def native_group_norm(x, weight, bias, n, c, hxw, group, eps):
    # Not PyTorch's composite kernel: it views the input as (1, N * group, -1), which a
    # channels_last input (group_norm passes one on as it is) cannot be viewed as.
    grouped = _wide(x).reshape(n, group, c // group * hxw)
    y, mean, rstd = _normalize(grouped, (2,), eps)
    per_channel = (1, c) + (1,) * (x.ndim - 2)
    y = _affine(y.reshape(x.shape), None if weight is None else weight.reshape(per_channel),
                None if bias is None else bias.reshape(per_channel))
    return y, mean.reshape(n, group), rstd.reshape(n, group)


@lowers(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(grad_out, x, normalized_shape, mean, rstd, weight, bias,
                               output_mask):
    axes = _layer_norm_axes(x, normalized_shape)
    xhat = (_wide(x) - mean) * rstd
    g = _wide(grad_out)
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        gy = g * weight if weight is not None else g
        n = math.prod(x.shape[a] for a in axes)
        grad_input = rstd * (gy - jnp.sum(gy, axis=axes, keepdims=True) / n
                             - xhat * jnp.sum(gy * xhat, axis=axes, keepdims=True) / n)
    outer = tuple(range(x.ndim - len(axes)))
    if output_mask[1] and weight is not None:
        grad_weight = jnp.sum(g * xhat, axis=outer)
    if output_mask[2] and bias is not None:
        grad_bias = jnp.sum(g, axis=outer)
    return grad_input, grad_weight, grad_bias


def _nll_weights(x, target, weight, ignore_index):
    """Per-sample class weights (0 where the target is ignore_index) and the safe targets."""
    keep = target != ignore_index
    safe = jnp.where(keep, target, 0)
    w = jnp.ones(target.shape, x.dtype) if weight is None else weight[safe]
    return jnp.where(keep, w, 0), safe


def _picked(x, safe):
    # x is (C,) or (N, C, ...): the class dim is the last of a 1-d input, else dim 1.
    class_dim = 0 if x.ndim == 1 else 1
    return jnp.squeeze(jnp.take_along_axis(x, jnp.expand_dims(safe, class_dim), class_dim),
                       class_dim)


@lowers(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_forward(x, target, weight, reduction, ignore_index):
    w, safe = _nll_weights(x, target, weight, ignore_index)
    losses = -_picked(x, safe) * w
    total = jnp.sum(w)
    if reduction == 0:
        return losses, total
    if reduction == 1:
        return jnp.sum(losses) / total, total
    return jnp.sum(losses), total


@lowers(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(grad, x, target, weight, reduction, ignore_index, total_weight):
    w, safe = _nll_weights(x, target, weight, ignore_index)
    scale = -w * grad
    if reduction == 1:
        scale = scale / total_weight
    class_dim = 0 if x.ndim == 1 else 1
    # int32 class ids: the one-hot's compare spans (samples x classes), and a TPU emulates int64
    # (a [8192, 32768] compare in pairs of 32-bit ops for a Llama step's loss).
    onehot = jax.nn.one_hot(safe.astype(jnp.int32), x.shape[class_dim], dtype=x.dtype,
                            axis=class_dim)
    return onehot * jnp.expand_dims(scale, class_dim)
