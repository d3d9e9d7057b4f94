"""Neural-network ops that need their own lowering: distances (cdist, pdist), embedding_bag and
the CTC loss, forward and backward; the backwards of softshrink/hardshrink and of the
multi-class margin losses.

Most of the family needs none: every other op of it that reaches the device has a
``torch._decomp`` decomposition whose pieces are lowered elsewhere, and tests/test_nn_ops.py checks
each against CPU, forward and backward: silu/relu/leaky_relu/elu/hardtanh/softplus/mish/
hardswish/hardsigmoid and their backwards, ``native_batch_norm`` (its decomposition writes the
running stats back with ``copy_``, which lands in the device storage), the group norm backward,
``_fused_rms_norm``, the mse/bce/smooth_l1/huber losses. The ops every transformer step runs
(softmax, GELU, layer norm, NLL loss) are lowered whole in ``layers`` for speed.
``scaled_dot_product_attention`` on a tpu tensor runs as one fused op forward and one backward
(``attention``), except dropout and GQA, which take PyTorch's math path as bmm/softmax pieces.

Lower an op here only when it has no decomposition, or its decomposition is wrong or measurably
too slow. Backward lowerings follow PyTorch's formulas where they differ from the gradient of the
forward (zero gradient at zero distance, ties of the inf-norm).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchtpu.lowering.checks import first_bad, fixed, outside, outside_unit
from torchtpu.lowering.registry import check, lowers, meta_kernel

aten = torch.ops.aten


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
        cross = jnp.matmul(x1, jnp.swapaxes(x2, -1, -2))
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


# ----------------------------------------------------------------------------- embedding_bag

_SUM, _MEAN, _MAX = 0, 1, 2


def _bag_of(indices, offsets, include_last_offset: bool):
    """(bag of each index position (the bag count past the last bag), number of bags)."""
    starts = offsets[:-1] if include_last_offset else offsets
    position = jnp.arange(indices.shape[0])
    bag = (starts[None, :] <= position[:, None]).sum(1) - 1
    if include_last_offset:
        bag = jnp.where(position < offsets[-1], bag, starts.shape[0])
    return bag, starts.shape[0]


@lowers(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    bag, bags = _bag_of(indices, offsets, include_last_offset)
    keep = (indices != padding_idx)[:, None]
    rows = jnp.take(weight, indices, axis=0)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None].astype(rows.dtype)
    size = jax.ops.segment_sum(keep[:, 0].astype(jnp.int64), bag, bags)
    if mode == _MAX:
        low = jnp.asarray(-jnp.inf, rows.dtype)
        best = jax.ops.segment_max(jnp.where(keep, rows, low), bag, bags)
        best = jnp.where(size[:, None] > 0, best, 0)
        # The first position holding each bag's maximum, per column.
        hit = keep & (rows == best[jnp.clip(bag, 0, bags - 1)])
        first = jax.ops.segment_min(jnp.where(hit, jnp.arange(indices.shape[0])[:, None],
                                              indices.shape[0]), bag, bags)
        picked = jnp.take(indices, jnp.clip(first, 0, indices.shape[0] - 1))
        return best, bag, _per_offset(size, offsets), jnp.where(size[:, None] > 0, picked, 0)
    total = jax.ops.segment_sum(jnp.where(keep, rows, 0), bag, bags)
    if mode == _MEAN:
        total = total / jnp.maximum(size, 1)[:, None].astype(total.dtype)
    # CPU reports bag sizes for mean and max only.
    size = size if mode == _MEAN else jnp.zeros_like(size)
    return total, bag, _per_offset(size, offsets), jnp.zeros((0,), jnp.int64)


def _per_offset(size, offsets):
    """Bag sizes shaped as PyTorch's meta kernel (CUDA's) shapes them, one per offset: with
    ``include_last_offset`` a trailing 0 for the last offset, which ends the last bag. Results
    must have meta's shapes (``results.check_shape``); CPU's one per bag does not."""
    return jnp.pad(size, (0, offsets.shape[0] - size.shape[0]))


@check(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def _embedding_bag_check(weight, indices, offsets, scale_grad_by_freq=False, mode=0,
                         sparse=False, per_sample_weights=None, include_last_offset=False,
                         padding_idx=-1):
    rows = weight.shape[0]
    error = first_bad(indices, outside(0, rows), functools.partial(_bag_index_error, rows))
    if error is not None or indices.ndim != 1 or offsets is None or not offsets.shape[0]:
        return error
    return (first_bad(offsets, _first_not_zero, _bag_start_error)
            or first_bad(offsets, _last_after(indices.shape[0]),
                         functools.partial(_bag_end_error, indices.shape[0])))


def _first_not_zero(xp, v):
    return (xp.arange(v.shape[0]) == 0) & (v != 0)


@functools.cache
def _last_after(length: int) -> Callable:
    return functools.partial(_last_offset_after, length)


def _last_offset_after(length: int, xp, v):
    return (xp.arange(v.shape[0]) == v.shape[0] - 1) & (v > length)


def _bag_index_error(rows: int, value: int) -> RuntimeError:
    return RuntimeError(f"embedding_bag: index {value} is not in the valid range [0, {rows})")


def _bag_start_error(value: int) -> RuntimeError:
    return RuntimeError("offsets[0] has to be 0, i.e., the first sequence in the mini-batch has "
                        f"to start from position 0. However, got {value}")


def _bag_end_error(length: int, value: int) -> RuntimeError:
    return RuntimeError(f"offsets[-1] can not be greater than input's length {length} but got "
                        f"offsets[-1] of {value}")


@lowers(aten._embedding_bag_backward.default)
def embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices,
                           num_weights, scale_grad_by_freq, mode, sparse, per_sample_weights,
                           padding_idx=-1):
    return embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices,
                                        num_weights, scale_grad_by_freq, mode,
                                        per_sample_weights, padding_idx)


@lowers(aten._embedding_bag_dense_backward.default)
def embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices,
                                 num_weights, scale_grad_by_freq, mode, per_sample_weights,
                                 padding_idx=-1):
    out = jnp.zeros((num_weights, grad.shape[1]), grad.dtype)
    bags = grad.shape[0]
    if mode == _MAX:
        columns = jnp.arange(grad.shape[1])[None, :]
        # One bag size per offset (``_per_offset``): the bags' are the leading ones.
        g = jnp.where(bag_size[:bags, None] > 0, grad, 0)
        return out.at[maximum_indices, columns].add(g)
    valid = (offset2bag < bags) & (indices != padding_idx)
    rows = jnp.take(grad, jnp.clip(offset2bag, 0, bags - 1), axis=0)
    if mode == _MEAN:
        rows = rows / jnp.maximum(bag_size[jnp.clip(offset2bag, 0, bags - 1)], 1)[:, None]
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None].astype(rows.dtype)
    if scale_grad_by_freq:
        counts = jnp.zeros(num_weights, grad.dtype).at[indices].add(1)
        rows = rows / counts[indices][:, None]
    return out.at[indices].add(jnp.where(valid[:, None], rows, 0))


@lowers(aten._embedding_bag_per_sample_weights_backward.default)
def embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode,
                                              padding_idx=-1):
    bags = grad.shape[0]
    rows = jnp.take(grad, jnp.clip(offset2bag, 0, bags - 1), axis=0)
    dot = (rows * jnp.take(weight, indices, axis=0)).sum(1)
    return jnp.where((offset2bag < bags) & (indices != padding_idx), dot, 0)


# ----------------------------------------------------------------------------- CTC loss

def _ctc_labels(targets, target_lengths, blank: int):
    """Per batch, the blank-interleaved label sequence l' (N, 2S+1), padded with blank."""
    if targets.ndim == 1:  # concatenated targets: cut them into padded rows
        starts = np.cumsum([0] + list(target_lengths[:-1]))
        width = max(max(target_lengths, default=0), 1)
        where = np.minimum(starts[:, None] + np.arange(width), max(targets.shape[0] - 1, 0))
        targets = targets[where] if targets.shape[0] else jnp.zeros(where.shape, jnp.int64)
    width = max(target_lengths, default=0)
    labels = jnp.full((targets.shape[0], 2 * width + 1), blank, jnp.int64)
    return labels.at[:, 1::2].set(targets[:, :width].astype(jnp.int64))


def _logsumexp(*xs):
    stacked = jnp.stack(xs)
    top = stacked.max(0)
    safe = jnp.where(jnp.isneginf(top), 0, top)
    return jnp.log(jnp.exp(stacked - safe).sum(0)) + safe


def _ctc_tables(log_probs, targets, input_lengths, target_lengths, blank: int):
    """(log_alpha (N, T, 2S+1), log_beta, per-position label log-probs, l', nll)."""
    n = log_probs.shape[1]
    labels = _ctc_labels(targets, target_lengths, blank)
    positions = labels.shape[1]
    lp = jnp.swapaxes(log_probs, 0, 1)  # (N, T, C)
    emit = jnp.take_along_axis(lp, jnp.broadcast_to(labels[:, None, :], (n, lp.shape[1],
                                                                          positions)), 2)
    s = jnp.arange(positions)
    valid = s[None, :] <= 2 * jnp.asarray(target_lengths, jnp.int64)[:, None]
    # Shifts keep the width: with every target empty, l' is one blank wide.
    shifted = jnp.concatenate([jnp.full((n, 2), blank, jnp.int64), labels], 1)[:, :positions]
    skip = (labels != blank) & (labels != shifted)  # may come from s - 2
    neg = jnp.asarray(-jnp.inf, log_probs.dtype)
    t_len = jnp.asarray(input_lengths, jnp.int64)[:, None]

    def shift(a, k):
        return jnp.concatenate([jnp.full((n, k), neg), a], 1)[:, :positions]

    def forward(alpha, t):
        new = _logsumexp(alpha, shift(alpha, 1), jnp.where(skip, shift(alpha, 2), neg))
        new = jnp.where(valid, new + emit[:, t], neg)
        alpha = jnp.where(t < t_len, new, alpha)
        return alpha, new

    start = jnp.where((s[None, :] < 2) & valid, emit[:, 0], neg)
    last, rest = jax.lax.scan(forward, start, jnp.arange(1, lp.shape[1]))
    alpha = jnp.concatenate([start[:, None], jnp.swapaxes(rest, 0, 1)], 1)
    end = 2 * jnp.asarray(target_lengths, jnp.int64)
    final = _logsumexp(jnp.take_along_axis(last, end[:, None], 1)[:, 0],
                       jnp.where(end > 0, jnp.take_along_axis(
                           last, jnp.maximum(end - 1, 0)[:, None], 1)[:, 0], neg))
    nll = -final

    skip_back = jnp.concatenate([skip, jnp.zeros((n, 2), bool)], 1)[:, 2:]  # s + 2 -> s

    def unshift(b, k):
        return jnp.concatenate([b, jnp.full((n, k), neg)], 1)[:, k:]

    def backward(beta, t):
        rec = _logsumexp(beta, unshift(beta, 1), jnp.where(skip_back, unshift(beta, 2), neg))
        init = jnp.where((s[None, :] >= end[:, None] - 1) & valid, 0.0, neg)
        new = jnp.where(t == t_len - 1, init, rec)
        new = jnp.where(valid & (t <= t_len - 1), new + emit[:, t], neg)
        return new, new

    _, betas = jax.lax.scan(backward, jnp.full((n, positions), neg),
                            jnp.arange(lp.shape[1] - 1, -1, -1))
    beta = jnp.flip(jnp.swapaxes(betas, 0, 1), 1)
    return alpha, beta, labels, nll


@lowers(aten._ctc_loss.default)
def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    alpha, _, _, nll = _ctc_tables(log_probs, targets, input_lengths, target_lengths, blank)
    if zero_infinity:
        nll = jnp.where(jnp.isinf(nll), 0, nll)
    return nll, alpha


@lowers(aten._ctc_loss_backward.default)
def ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths,
                      neg_log_likelihood, log_alpha, blank, zero_infinity=False):
    # PyTorch's formula treats log_probs as a log_softmax output: exp(lp) minus the posterior
    # of each class at each step, so it is not the vjp of the forward above.
    alpha, beta, labels, nll = _ctc_tables(log_probs, targets, input_lengths, target_lengths,
                                           blank)
    n, t_max, c = log_probs.shape[1], log_probs.shape[0], log_probs.shape[2]
    both = alpha + beta  # (N, T, 2S+1)
    onehot = labels[:, None, :, None] == jnp.arange(c)  # (N, 1, 2S+1, C)
    per_class = jnp.where(onehot, both[..., None], -jnp.inf)
    top = per_class.max(2)
    safe = jnp.where(jnp.isneginf(top), 0, top)
    lcab = jnp.log(jnp.exp(per_class - safe[:, :, None]).sum(2)) + safe  # (N, T, C)
    lp = jnp.swapaxes(log_probs, 0, 1)
    g = jnp.exp(lp) - jnp.exp(lcab + nll[:, None, None] - lp)
    g = g * grad.reshape(n, 1, 1)
    inside = jnp.arange(t_max)[None, :, None] < jnp.asarray(input_lengths)[:, None, None]
    g = jnp.where(inside, g, 0)
    if zero_infinity:
        g = jnp.where(jnp.isinf(nll)[:, None, None], 0, g)
    return jnp.swapaxes(g, 0, 1)


# ----------------------------------------------------------------------------- activations

@lowers(aten.softshrink_backward.default, aten.hardshrink_backward.default, promote="result")
def shrink_backward(grad, x, lambd):
    # Both pass the gradient where |x| > lambd; PyTorch has no decomposition of either.
    return jnp.where((x > lambd) | (x < -lambd), grad, 0)


@lowers(aten.threshold.default)
def threshold(x, threshold, value):
    # Lowered rather than decomposed: the decomposition's in-place form ends in a copy_ into the
    # target, which refuses an expand-ed one, where CPU's threshold_ writes it (no overlap
    # checks: threshold is idempotent). Both scalars are cast to x's dtype first, and NaN stays
    # NaN (NaN <= threshold is false), as on CPU.
    return jnp.where(x <= jnp.asarray(threshold, x.dtype), jnp.asarray(value, x.dtype), x)


# ----------------------------------------------------------------------------- margin losses

def _per_sample(grad, reduction: int, n: int, ndim: int):
    """The gradient of each sample's loss: mean divides by the sample count."""
    if reduction == 0:
        return grad.reshape(grad.shape + (1,) * (ndim - grad.ndim))
    return grad / n if reduction == 1 else grad


@lowers(aten.multi_margin_loss_backward.default)
def multi_margin_loss_backward(grad, x, target, p, margin, weight=None, reduction=1):
    x2 = x.reshape((-1, x.shape[-1] if x.ndim else 1))
    n, c = x2.shape
    target = target.reshape(-1)
    picked = jnp.take_along_axis(x2, target[:, None], 1)
    z = margin - picked + x2
    others = jnp.arange(c)[None, :] != target[:, None]
    g = jnp.where((z > 0) & others, p * z ** (p - 1), 0) / c  # p is 1 or 2
    if weight is not None:
        g = g * weight[target][:, None]
    g = g.at[jnp.arange(n), target].add(-g.sum(1))
    per = _per_sample(grad.reshape(-1) if reduction == 0 else grad, reduction, n, 2)
    return (g * per).reshape(x.shape)


def _multilabel_hinge(x, target):
    """(x as rows, labels, label-vs-class margins z, which z count, is_target) of
    multilabel_margin_loss: each row's labels are its targets before the first -1."""
    x2 = x.reshape((-1, x.shape[-1] if x.ndim else 1))
    c = x2.shape[1]
    target = target.reshape(x2.shape)
    valid = jnp.cumprod(target >= 0, axis=1).astype(bool)
    labels = jnp.where(valid, target, 0)
    is_target = ((labels[:, :, None] == jnp.arange(c)) & valid[:, :, None]).any(1)
    z = 1 - jnp.take_along_axis(x2, labels, 1)[:, :, None] + x2[:, None, :]
    active = (z > 0) & valid[:, :, None] & ~is_target[:, None, :]
    return x2, labels, z, active, is_target


@lowers(aten.multilabel_margin_loss_forward.default)
def multilabel_margin_loss_forward(x, target, reduction):
    # Lowered: PyTorch's decomposition also counts the label slots after the first -1.
    x2, _, z, active, is_target = _multilabel_hinge(x, target)
    loss = jnp.where(active, z, 0).sum((1, 2)) / x2.shape[1]
    loss = loss.mean() if reduction == 1 else loss.sum() if reduction == 2 else loss
    return loss.reshape(x.shape[:-1]) if reduction == 0 else loss, is_target.reshape(x.shape)


@check(aten.multilabel_margin_loss_forward.default)
def _multilabel_margin_loss_check(self, target, reduction):
    classes = self.shape[-1] if self.ndim else 1
    return first_bad(target, outside(-1, classes),
                     fixed(RuntimeError, "argument #2 'target' is out of range"))


# binary_cross_entropy has no lowering (its decomposition's pieces have); CPU checks its input.
@check(aten.binary_cross_entropy.default)
def _binary_cross_entropy_check(self, target, weight=None, reduction=1):
    return first_bad(self, outside_unit,
                     fixed(RuntimeError, "all elements of input should be between 0 and 1"))


@lowers(aten.multilabel_margin_loss_backward.default)
def multilabel_margin_loss_backward(grad, x, target, reduction, is_target):
    x2, labels, _, active, _ = _multilabel_hinge(x, target)
    n, c = x2.shape
    active = active.astype(x.dtype) / c
    g = active.sum(1)
    g = g.at[jnp.arange(n)[:, None], labels].add(-active.sum(2))
    per = _per_sample(grad.reshape(-1) if reduction == 0 else grad, reduction, n, 2)
    return (g * per).reshape(x.shape)


# These backwards have no meta kernel in PyTorch; result shapes come from meta kernels, and each
# gradient has the shape of the op's second argument (the forward's input).
@meta_kernel(aten.multi_margin_loss_backward.default,
             aten.multilabel_margin_loss_backward.default, aten._ctc_loss_backward.default)
def _like_second(grad, x, *args, **kwargs):
    return torch.empty_like(x)
