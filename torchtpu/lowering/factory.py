"""Factories: arange, linspace, logspace, eye, full, zeros, ones, scalar_tensor.

Factory lowerings have no tensor inputs. The result dtype is PyTorch's (meta inference), and the
program casts to it; layout/device/pin_memory arrive as static values and mean nothing here.
Ranges are computed in float64 or int64 and then cast, as PyTorch's CPU kernels accumulate in a
wider type than the result.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch
from jax import lax

from torchtpu.lowering import padding
from torchtpu.lowering.registry import lowers, padding_rule, size_arguments

aten = torch.ops.aten


def _range(start, end, step):
    """start + step * i for i < the length PyTorch's arange gives (float64 or int64)."""
    # A symbolic size (a dimension of an exported program's input) is an integer too.
    if all(isinstance(v, int) or jax.export.is_symbolic_dim(v) for v in (start, end, step)):
        sign = (step > 0) - (step < 0)
        n = max(0, (end - start + step - sign) // step)
        return start + step * lax.iota(jnp.int64, n)
    n = max(0, math.ceil((end - start) / step))
    return start + step * lax.iota(jnp.float64, n)


@lowers(aten.arange.default, static_scalars=True)
def arange(end, dtype=None, layout=None, device=None, pin_memory=None):
    return _range(0, end, 1)


@lowers(aten.arange.start, static_scalars=True)
def arange_start(start, end, dtype=None, layout=None, device=None, pin_memory=None):
    return _range(start, end, 1)


@lowers(aten.arange.start_step, static_scalars=True)
def arange_start_step(start, end, step=1, dtype=None, layout=None, device=None, pin_memory=None):
    return _range(start, end, step)


def _linspace(start, end, steps: int):
    # PyTorch fills the first half forward from start and the second half backward from end,
    # so both ends are exact.
    i = lax.iota(jnp.float64, steps)
    start = jnp.asarray(start, jnp.float64)
    end = jnp.asarray(end, jnp.float64)
    step = (end - start) / max(steps - 1, 1)
    return jnp.where(i < steps // 2, start + step * i, end - step * (steps - 1 - i))


@lowers(aten.linspace.default)
def linspace(start, end, steps, dtype=None, layout=None, device=None, pin_memory=None):
    return _linspace(start, end, steps)


@lowers(aten.logspace.default)
def logspace(start, end, steps, base=10.0, dtype=None, layout=None, device=None,
             pin_memory=None):
    return jnp.power(jnp.float64(base), _linspace(start, end, steps))


@lowers(aten.eye.default)
def eye(n, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.eye(n, dtype=jnp.bool_)


@lowers(aten.eye.m)
def eye_m(n, m, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.eye(n, m, dtype=jnp.bool_)


@lowers(aten.full.default, constant=lambda size, fill_value, *_: fill_value)
def full(size, fill_value, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.full(tuple(size), fill_value)


# _efficientzerotensor is what autograd uses for a known-zero gradient (sgn of a real tensor):
# an ordinary zero tensor serves.
@lowers(aten.zeros.default, aten._efficientzerotensor.default, constant=lambda *_: 0)
def zeros(size, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), jnp.bool_)


@lowers(aten.ones.default, constant=lambda *_: 1)
def ones(size, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.ones(tuple(size), jnp.bool_)


@lowers(aten.scalar_tensor.default, constant=lambda s, *_: s)
def scalar_tensor(s, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.asarray(s)


# Dynamic shapes: allocations are position-wise (the *_like ones reach a graph decomposed or not).
padding_rule(aten.full.default, aten.ones.default, aten.zeros.default, aten.scalar_tensor.default,
             aten.arange.default, aten.arange.start, aten.arange.start_step,
             aten.zeros_like.default, aten.ones_like.default)(padding.positionwise)
# A range's end only sets its size: padded to a bucket it gives the real range and then padding.
# (``arange(0, s0)``'s dim is s0, a plain symbol; one whose length is not, ``arange(2, s0)`` or a
# step of 2, has no layout.)
size_arguments(aten.arange.default, 0)
size_arguments(aten.arange.start, 1)
size_arguments(aten.arange.start_step, 1)
