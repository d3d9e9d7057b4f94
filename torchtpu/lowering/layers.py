"""The ops every transformer step runs, lowered whole: softmax and log-softmax, GELU, layer norm
and the NLL loss, forward and backward, plus ``addmm``; and group norm's forward.

PyTorch decomposes all of them, and those decompositions give the right numbers, but in eager
mode each costs a pass through PyTorch's Python references (about half a millisecond) and then a
dozen small ops; as one lowering each is one program call in Strict and one node in DeferAndFuse.
Half-precision inputs are computed in float32, as PyTorch's CPU kernels accumulate.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import torch
import torch.fx as fx

from torchtpu.lowering import padding
from torchtpu.lowering.checks import first_bad
from torchtpu.lowering.linalg import _scaled_sum
from torchtpu.lowering.padding import Mask, Refused, first, padded, reduced_dims, same
from torchtpu.lowering.registry import (
    check,
    lowers,
    padding_rule,
    producer_form,
    rounded_fast,
    row_parts,
    saved_statistics,
)
from torchtpu.runtime.tpu_accuracy import FAST, rounded

aten = torch.ops.aten


_HALF = (jnp.float16, jnp.bfloat16)


def _wide(x):
    return x.astype(jnp.float32) if x.dtype in _HALF else x


@lowers(aten.addmm.default, promote="result")
def addmm(x, mat1, mat2, beta=1, alpha=1):
    return _scaled_sum(x, jnp.matmul(mat1, mat2), beta, alpha)


padding_rule(aten.addmm.default)(padding.contraction(1, 1, 2, 0))  # dynamic shapes


def _axis(x, dim):
    # PyTorch treats a 0-dim tensor as one element along dim 0 or -1.
    return dim if x.ndim else None


@lowers(aten._softmax.default)
def softmax(x, dim, half_to_float):
    return jax.nn.softmax(_wide(x), axis=_axis(x, dim))


def _log_softmax_parts(x, axis):
    """(max, log of the sum of exp(x - max)) along axis, kept as dims: x - max - the second is
    log_softmax(x). One function for the log-softmax and the NLL's pick from its input
    (``_nll_loss_of_log_softmax``), so that in one program XLA computes the row reductions
    once (the same instructions are one)."""
    top = jnp.max(x, axis, keepdims=True, initial=-jnp.inf)
    return top, jnp.log(jnp.sum(jnp.exp(x - top), axis, keepdims=True))


@lowers(aten._log_softmax.default)
def log_softmax(x, dim, half_to_float):
    x, axis = _wide(x), _axis(x, dim)
    top, log_sum = _log_softmax_parts(x, axis)
    return (x - top) - log_sum


padding_rule(aten._softmax.default, aten._log_softmax.default)(padding.reduction(1, "lowest"))


def _log_softmax_of_rows(x, dim, half_to_float, top, log_sum):
    return (_wide(x) - top) - log_sum


# A split step's backward recomputes the float32 log-probabilities from the logits and these
# two numbers a row, not from two passes over the logits (bench/RESULTS.md, split1).
@row_parts(aten._log_softmax.default, combine=_log_softmax_of_rows)
def _log_softmax_rows(x, dim, half_to_float):
    return _log_softmax_parts(_wide(x), _axis(x, dim))


@lowers(aten._softmax_backward_data.default)
def softmax_backward(grad, out, dim, input_dtype):
    grad, out = _wide(grad), _wide(out)
    return out * (grad - jnp.sum(grad * out, axis=_axis(out, dim), keepdims=True))


@lowers(aten._log_softmax_backward_data.default)
def log_softmax_backward(grad, out, dim, input_dtype):
    grad, out = _wide(grad), _wide(out)
    return grad - _exp(out) * jnp.sum(grad, axis=_axis(out, dim), keepdims=True)


def _exp(x):
    # A bf16 step's loss gradient is rounded to bf16 for the head's products right after, which
    # recompute it inside both: the fast exp there (bench/RESULTS.md, whole12).
    return jax.lax.exp(x, accuracy=rounded())


rounded_fast(aten._log_softmax_backward_data.default)


@padding_rule(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def _softmax_backward_padding(node: fx.Node, layouts: dict) -> list:
    lay = first(node, layouts)
    dims = padded(lay, reduced_dims(node, 2, len(lay)))
    both = node.target is aten._softmax_backward_data.default
    return [Mask(i, dims, "zero") for i in ((0, 1) if both else (0,))] if dims else []


_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
_KAPPA = 0.044715


def _gelu_tanh(x, half: bool):
    return jax.lax.tanh(_SQRT_2_OVER_PI * (x + _KAPPA * x * x * x),
                        accuracy=FAST if half else None)


def _gelu(x, approximate: str, half: bool = False):
    """GELU of float32 x; half: its value is rounded to half precision right after."""
    if approximate == "tanh":
        return 0.5 * x * (1 + _gelu_tanh(x, half))
    return 0.5 * x * (1 + jax.lax.erf(x * (1 / math.sqrt(2))))


@lowers(aten.gelu.default)
def gelu(x, approximate="none"):
    return _gelu(_wide(x), approximate, x.dtype in _HALF)


# Written out as CPU's kernel computes it, not JAX's vjp of the forward: the vjp's exp (erf's
# derivative) takes no accuracy, so a bf16 GELU's would be the TPU's accurate form (see _sigmoid).
@lowers(aten.gelu_backward.default)
def gelu_backward(grad, x, approximate="none"):
    half = grad.dtype in _HALF and x.dtype in _HALF
    grad, x = _wide(grad), _wide(x)
    if approximate == "tanh":
        t = _gelu_tanh(x, half)
        slope = _SQRT_2_OVER_PI * (1 + 3 * _KAPPA * x * x)
        return grad * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * slope)
    cdf = 0.5 * (1 + jax.lax.erf(x * (1 / math.sqrt(2))))
    pdf = jax.lax.exp(-0.5 * x * x, accuracy=FAST if half else None) / math.sqrt(2 * math.pi)
    return grad * (cdf + x * pdf)


# SiLU (SwiGLU's gate in every Llama MLP), whole: its decomposition ran as five programs (casts
# to and from float32 around sigmoid and mul, a copy out).
@lowers(aten.silu.default)
def silu(x):
    return _wide(x) * _sigmoid(x)


# Its backward whole, in float32 as CPU's kernel computes it: its composite ran as six programs
# a layer (``1 - sigmoid`` as an empty tensor filled, then a subtraction; three products).
@lowers(aten.silu_backward.default)
def silu_backward(grad, x):
    s = _sigmoid(x, grad)
    x = _wide(x)
    return _wide(grad) * s * (1 + x * (1 - s))


def _sigmoid(x, *others):
    """sigmoid(x) in float32. When x (and others) are half precision, the float32 value is
    rounded to their dtype right after: its exp is the TPU's fast form (``tpu_accuracy.FAST``;
    ``lax.logistic`` drops an accuracy it is given)."""
    half = all(v.dtype in _HALF for v in (x, *others))
    return 1 / (1 + jax.lax.exp(-_wide(x), accuracy=FAST if half else None))


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


@padding_rule(aten.native_layer_norm.default)
def _layer_norm_padding(node: fx.Node, layouts: dict) -> list:
    lay = first(node, layouts)
    if padded(lay, range(len(lay) - len(node.args[1]), len(lay))):
        raise Refused(f"{node.target} normalizes over a symbolic dim")
    return []


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


# The forward's mean and rstd (float32 for a half input, as the meta kernel makes them); batch
# norm's backward (PyTorch's decomposition serves it) takes its save_mean and save_invstd so too.
saved_statistics(aten.native_layer_norm_backward.default, 3, 4)
saved_statistics(aten.native_batch_norm_backward.default, 5, 6)


@padding_rule(aten.native_layer_norm_backward.default)
def _layer_norm_backward_padding(node: fx.Node, layouts: dict) -> list:
    lay, normalized = first(node, layouts), len(node.args[2])
    if padded(lay, range(len(lay) - normalized, len(lay))):
        raise Refused(f"{node.target} normalizes over a symbolic dim")
    lead = padded(lay, range(len(lay) - normalized))
    return [Mask(i, lead, "zero") for i in (0, 1, 3, 4)] if lead else []


def _nll_weights(x, target, weight, ignore_index):
    """(per-sample class weights, 0 where the target is ignore_index; the safe targets; which
    samples count). CPU's kernels skip an ignored sample: its loss and its gradient are 0 also
    where 0 x its value is not (a non-finite pick or output gradient, a total weight of 0)."""
    keep = target != ignore_index
    safe = jnp.where(keep, target, 0)
    w = jnp.ones(target.shape, x.dtype) if weight is None else weight[safe]
    return jnp.where(keep, w, 0), safe, keep


def _picked(x, safe):
    # x is (C,) or (N, C, ...): the class dim is the last of a 1-d input, else dim 1.
    # A masked sum over the classes, not a gather: in a program, XLA fuses the log-softmax that
    # x comes from into it (and the backward's sum of the one-hot with it), where a gather made
    # it write the float32 log-probabilities out first: at a Llama step's 8192 x 32768 logits
    # that pass and the one-hot's were a third of the head and loss's estimated cycles on v5e
    # (bench/head_loss.py). Run alone (Strict) it reads x whole instead of 8,192 of its values.
    class_dim = 0 if x.ndim == 1 else 1
    classes = jax.lax.broadcasted_iota(jnp.int32, x.shape, class_dim)
    hit = classes == jnp.expand_dims(safe.astype(jnp.int32), class_dim)
    return jnp.sum(jnp.where(hit, x, 0), axis=class_dim)


@lowers(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_forward(x, target, weight, reduction, ignore_index):
    w, safe, keep = _nll_weights(x, target, weight, ignore_index)
    return _nll_reduced(jnp.where(keep, -_picked(x, safe) * w, 0), w, reduction)


def _nll_reduced(losses, w, reduction):
    total = jnp.sum(w)
    if reduction == 0:
        return losses, total
    if reduction == 1:
        return jnp.sum(losses) / total, total
    return jnp.sum(losses), total


@check(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def _nll_loss_check(self, target, weight, reduction=1, ignore_index=-100):
    # CPU's kernel wants the class weights in the input's dtype; the meta kernel does not check.
    if weight is not None and weight.dtype != self.dtype:
        return RuntimeError(f"expected scalar type {self.dtype} but found {weight.dtype}")
    # Its class indices must name a class (but ignore_index); a device would gather a clamped or
    # undefined value (cross_entropy would return nan).
    classes = self.shape[0] if self.ndim == 1 else self.shape[1]
    return first_bad(target, _target_outside(classes, ignore_index), _target_out_of_bounds)


@functools.cache
def _target_outside(classes: int, ignore_index: int) -> Callable:
    return functools.partial(_outside_classes, classes, ignore_index)


def _outside_classes(classes: int, ignore_index: int, xp, v):
    return ((v < 0) | (v >= classes)) & (v != ignore_index)


def _target_out_of_bounds(value: int) -> IndexError:
    return IndexError(f"Target {value} is out of bounds.")


@padding_rule(aten.nll_loss_forward.default)
def _nll_loss_padding(node: fx.Node, layouts: dict) -> list:
    # Padded rows are ignored through ignore_index.
    lay, args = first(node, layouts), node.args
    if padded(lay, [len(lay) - 1]):
        raise Refused(f"{node.target} over a symbolic number of classes")
    if args[3] == 0 or not padded(lay, [0]):
        return []
    same([lay[0], layouts[args[1]][0]], f"{node.target} reduces")
    return [Mask(0, (0,), "zero"), Mask(1, (0,), args[4])]


def _nll_scale(grad, x, target, weight, reduction, ignore_index, total_weight):
    """(each sample's gradient: its picked class's, the safe targets, the class dim)."""
    w, safe, keep = _nll_weights(x, target, weight, ignore_index)
    scale = -w * grad
    if reduction == 1:
        scale = scale / total_weight
    return jnp.where(keep, scale, 0), safe, 0 if x.ndim == 1 else 1


@lowers(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(grad, x, target, weight, reduction, ignore_index, total_weight):
    scale, safe, class_dim = _nll_scale(grad, x, target, weight, reduction, ignore_index,
                                        total_weight)
    # int32 class ids: the one-hot's compare spans (samples x classes), and a TPU emulates int64
    # (a [8192, 32768] compare in pairs of 32-bit ops for a Llama step's loss).
    onehot = jax.nn.one_hot(safe.astype(jnp.int32), x.shape[class_dim], dtype=x.dtype,
                            axis=class_dim)
    return onehot * jnp.expand_dims(scale, class_dim)


# The NLL of a log-softmax and the log-softmax's backward of an NLL's gradient, in a recorded
# program (``registry.producer_form``). Alone, the pick is a masked sum of the log-probabilities
# (``_picked``), which needs the log-softmax's row sums first, so it is a pass of its own over
# the [tokens, vocab] logits, and the backward's sum of the one-hot gradient joins it: 3.7 M
# estimated cycles of a Llama step's ~50 M at 2 blocks on v5e, for two numbers a row. Given
# the producers, the pick is a masked sum of the log-softmax's input (the TPU compiler makes it
# one pass with the sum of exponentials: -3.9 M), and the backward's row sum is the NLL's own
# scale (bench/RESULTS.md, loss1). A gather instead of the masked sum saved the same cycles but
# wrote the float32 logits out for it (+0.9 GiB of temporaries).
@producer_form(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default, position=0,
               producers=(aten._log_softmax.default,))
def _nll_loss_of_log_softmax(args: list, producer: list):
    x, target, weight, reduction, ignore_index = args
    z, dim, _ = producer
    class_dim = 0 if x.ndim == 1 else 1
    if z.shape != x.shape or dim % z.ndim != class_dim:
        return nll_loss_forward(*args)
    w, safe, keep = _nll_weights(x, target, weight, ignore_index)
    # Each row's class of the log-softmax's input less the row's reductions as log_softmax
    # computes them (one with them in a program): x's values at the targets, rounded to x's
    # dtype as x's were.
    top, log_sum = _log_softmax_parts(_wide(z), class_dim)
    at = jnp.expand_dims(_picked(_wide(z), safe), class_dim)
    picked = ((at - top) - log_sum).squeeze(class_dim).astype(x.dtype)
    return _nll_reduced(jnp.where(keep, -picked * w, 0), w, reduction)


@producer_form(aten._log_softmax_backward_data.default, position=0,
               producers=(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default))
def _log_softmax_backward_of_nll(args: list, producer: list):
    grad, out, dim, _ = args
    x = producer[1]
    scale, _, class_dim = _nll_scale(*producer)
    if grad.shape != x.shape or out.shape != x.shape or dim % x.ndim != class_dim:
        return log_softmax_backward(*args)
    # grad is one-hot * scale along the class dim, so its sum there is scale, as
    # nll_loss_backward's program returned it (in the one-hot's dtype, then grad's).
    rows = scale.astype(jnp.result_type(x.dtype, scale.dtype)).astype(grad.dtype)
    return _wide(grad) - _exp(_wide(out)) * jnp.expand_dims(_wide(rows), class_dim)


@padding_rule(aten.nll_loss_backward.default)
def _nll_loss_backward_padding(node: fx.Node, layouts: dict) -> list:
    target = layouts[node.args[1]]
    if padded(target, [len(target) - 1]):
        raise Refused(f"{node.target} over a symbolic number of classes")
    return []
