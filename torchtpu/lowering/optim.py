"""Multi-tensor ops for optimizers: the ``_foreach_*`` family and the fused optimizer steps.

A ``_foreach_*`` overload is the per-tensor ATen op mapped over lists: its lowering applies that
op's own lowering to each element (lists and ``Scalar[]`` are taken elementwise, anything else is
shared), so a foreach step computes exactly what the for-loop optimizer path computes, in one
program. The in-place ``_foreach_*_`` overloads come from these functional ones. The fused
optimizer steps (Adam, AdamW, SGD, Adagrad) follow the formulas of PyTorch's for-loop
implementations, so ``fused=True``, ``foreach=True`` and the plain loop agree. PyTorch has no
meta kernel for some fused steps (``_fused_sgd_``, ``_fused_adagrad_``, the tensor-lr
overloads); as they return nothing, an empty one is registered.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax.numpy as jnp
import torch

from torchtpu.lowering.elementwise import opmath
from torchtpu.lowering.registry import TABLE, lowers, meta_kernel

aten = torch.ops.aten


def _apply(op: torch._ops.OpOverload, *args):
    """op's lowering on one element's arguments, with the op's promotion policy applied."""
    lowering = TABLE.get(op)
    if lowering is None:
        raise NotImplementedError(f"torchtpu.unsupported: the foreach lowering needs a lowering "
                                  f"of {op}")
    if lowering.promote == "result":
        dtype = jnp.result_type(*(a for a in args if a is not None and not isinstance(a, bool)))
        args = tuple(a.astype(dtype) if hasattr(a, "astype") and a.dtype != dtype else a
                     for a in args)
    return lowering.fn(*args)


def _elementwise(fn: Callable, args: tuple) -> list:
    """fn on element i of every list argument (other arguments shared), for each i."""
    n = next((len(a) for a in args if isinstance(a, (list, tuple))), 0)
    return [fn(*(a[i] if isinstance(a, (list, tuple)) else a for a in args)) for i in range(n)]


def _foreach(target, per_tensor: torch._ops.OpOverload, static_scalars: bool = False) -> None:
    """Lower target's overload(s) as per_tensor applied elementwise."""

    def lowering(*args):
        return _elementwise(functools.partial(_apply, per_tensor), args)

    targets = target if isinstance(target, tuple) else (target,)
    lowers(*targets, static_scalars=static_scalars)(lowering)


_UNARY = ("abs acos asin atan ceil cos cosh erf erfc exp expm1 floor frac lgamma log log10 log1p "
          "log2 neg reciprocal round rsqrt sigmoid sign sin sinh sqrt tan tanh trunc").split()
for _name in _UNARY:
    _foreach(getattr(aten, f"_foreach_{_name}").default, getattr(aten, _name).default)

# The per-tensor Tensor overloads take a Python scalar in the tensor's place just as well.
for _name in ("add", "sub", "mul", "div"):
    _foreach(getattr(aten, f"_foreach_{_name}"), getattr(aten, _name).Tensor)
for _name in ("clamp_min", "clamp_max", "maximum", "minimum"):
    _foreach(getattr(aten, f"_foreach_{_name}"), getattr(aten, _name).default)
_foreach(aten._foreach_pow, aten.pow.Tensor_Tensor)
_foreach(aten._foreach_lerp, aten.lerp.Tensor)
# The .Tensor overloads (one CPU tensor of scalars) keep PyTorch's composite kernel, which turns
# them into the ScalarList form.
for _name in ("addcmul", "addcdiv"):
    _packet = getattr(aten, f"_foreach_{_name}")
    _foreach((_packet.Scalar, _packet.ScalarList), getattr(aten, _name).default)
_foreach(aten._foreach_max.default, aten.max.default)
_foreach(aten._foreach_mm.default, aten.mm.default)


@lowers(aten._foreach_norm.Scalar, static_scalars=True)
def foreach_norm(xs, ord=2, dtype=None):
    return _elementwise(
        lambda x: _apply(aten.linalg_vector_norm.default, x, ord, None, False, dtype), (xs,))


@lowers(aten._foreach_zero.default)
def foreach_zero(xs):
    return [jnp.zeros_like(x) for x in xs]


@lowers(aten._foreach_clone.default)
def foreach_clone(xs):
    return list(xs)


@lowers(aten._foreach_copy.default)
def foreach_copy(xs, src, non_blocking=False):
    return [jnp.broadcast_to(s, x.shape) for x, s in zip(xs, src, strict=True)]


# ----------------------------------------------------------------------------- fused steps

def _skip_if_inf(found_inf, new: list, old: list) -> list:
    # A step with inf/nan gradients (found by the grad scaler) leaves everything unchanged.
    if found_inf is None:
        return new
    skip = found_inf.reshape(()) != 0
    return [jnp.where(skip, o, n) for n, o in zip(new, old, strict=True)]


def _unscale(grads, grad_scale) -> list:
    return [opmath(g) if grad_scale is None else opmath(g) / grad_scale.reshape(())
            for g in grads]


def _adam(decoupled: bool, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr,
          beta1, beta2, weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):
    unscaled = _unscale(grads, grad_scale)
    new_p, new_m, new_v, new_max = [], [], [], []
    for i, (p, g, m, v, step) in enumerate(
            zip(params, unscaled, exp_avgs, exp_avg_sqs, steps, strict=True)):
        p, m, v = opmath(p), opmath(m), opmath(v)
        d = -g if maximize else g
        if weight_decay != 0:
            if decoupled:
                p = p * (1 - lr * weight_decay)
            else:
                d = d + weight_decay * p
        m = m + (1 - beta1) * (d - m)
        v = v * beta2 + (1 - beta2) * d * d
        # Bias corrections in float64, like the for-loop path's Python floats.
        step = step.astype(jnp.float64)
        step_size = (lr / (1 - beta1 ** step)).astype(p.dtype)
        bias_correction2_sqrt = jnp.sqrt(1 - beta2 ** step).astype(v.dtype)
        if amsgrad:
            new_max.append(jnp.maximum(opmath(max_exp_avg_sqs[i]), v))
        denom = jnp.sqrt(new_max[-1] if amsgrad else v) / bias_correction2_sqrt + eps
        new_p.append(p - step_size * (m / denom))
        new_m.append(m)
        new_v.append(v)
    return (_skip_if_inf(found_inf, new_p, params), _skip_if_inf(found_inf, unscaled, grads),
            _skip_if_inf(found_inf, new_m, exp_avgs), _skip_if_inf(found_inf, new_v, exp_avg_sqs),
            _skip_if_inf(found_inf, new_max, max_exp_avg_sqs) if amsgrad else max_exp_avg_sqs)


# lr is traced so that a learning-rate schedule does not recompile the step every iteration.
lowers(aten._fused_adam.default, aten._fused_adam.tensor_lr, traced=("lr",))(
    functools.partial(_adam, False))
lowers(aten._fused_adamw.default, aten._fused_adamw.tensor_lr, traced=("lr",))(
    functools.partial(_adam, True))



@lowers(aten._fused_sgd.default, aten._fused_sgd.tensor_lr, traced=("lr",))
def fused_sgd(params, grads, momentum_buffers, weight_decay, momentum, lr, dampening, nesterov,
              maximize, is_first_step, grad_scale=None, found_inf=None):
    unscaled = _unscale(grads, grad_scale)
    new_p, new_bufs = [], []
    for i, (p, g) in enumerate(zip(params, unscaled, strict=True)):
        p = opmath(p)
        d = -g if maximize else g
        if weight_decay != 0:
            d = d + weight_decay * p
        if momentum != 0:
            buf = d if is_first_step else (
                opmath(momentum_buffers[i]) * momentum + (1 - dampening) * d)
            new_bufs.append(buf)
            d = d + momentum * buf if nesterov else buf
        new_p.append(p - lr * d)
    return (_skip_if_inf(found_inf, new_p, params), _skip_if_inf(found_inf, unscaled, grads),
            _skip_if_inf(found_inf, new_bufs, momentum_buffers) if momentum != 0
            else momentum_buffers)


def _adagrad(params, grads, state_sums, state_steps, lr, lr_decay, weight_decay, eps, maximize,
             grad_scale=None, found_inf=None):
    # The optimizer counts the step before calling, and takes it back if found_inf is set.
    unscaled = _unscale(grads, grad_scale)
    new_p, new_sums = [], []
    for p, g, state_sum, step in zip(params, unscaled, state_sums, state_steps, strict=True):
        p, state_sum = opmath(p), opmath(state_sum)
        d = -g if maximize else g
        if weight_decay != 0:
            d = d + weight_decay * p
        # The decayed rate in float64, like the for-loop path's Python floats.
        clr = (lr / (1 + (step.astype(jnp.float64) - 1) * lr_decay)).astype(p.dtype)
        state_sum = state_sum + d * d
        new_p.append(p - clr * (d / (jnp.sqrt(state_sum) + eps)))
        new_sums.append(state_sum)
    return (_skip_if_inf(found_inf, new_p, params), _skip_if_inf(found_inf, unscaled, grads),
            _skip_if_inf(found_inf, new_sums, state_sums))


@lowers(aten._fused_adagrad.default, traced=("lr",))
def fused_adagrad(params, grads, state_sums, state_steps, lr, lr_decay, weight_decay, eps,
                  maximize, grad_scale=None, found_inf=None):
    # This overload lists the steps among its outputs, unchanged.
    return (*_adagrad(params, grads, state_sums, state_steps, lr, lr_decay, weight_decay, eps,
                      maximize, grad_scale, found_inf), state_steps)


lowers(aten._fused_adagrad.tensor_lr, traced=("lr",))(_adagrad)


meta_kernel(aten._fused_adam_.tensor_lr, aten._fused_adamw_.tensor_lr, aten._fused_sgd_.default,
            aten._fused_sgd_.tensor_lr, aten._fused_adagrad_.default,
            aten._fused_adagrad_.tensor_lr)(lambda *args, **kwargs: None)
