"""Elementwise math: arithmetic, unary functions, comparisons, logic, ``where``, casts."""

from __future__ import annotations

import jax.numpy as jnp
import torch

from torchtpu.lowering.registry import lowers

aten = torch.ops.aten


@lowers(aten.add.Tensor, aten.add.Scalar, promote="result")
def add(x, y, alpha=1):
    return x + y * alpha


@lowers(aten.sub.Tensor, aten.sub.Scalar, promote="result")
def sub(x, y, alpha=1):
    return x - y * alpha


@lowers(aten.mul.Tensor, aten.mul.Scalar, promote="result")
def mul(x, y):
    return x * y


@lowers(aten.div.Tensor, aten.div.Scalar, promote="result")
def div(x, y):
    return x / y


@lowers(aten.neg.default, promote="result")
def neg(x):
    return -x


@lowers(aten.exp.default, promote="result")
def exp(x):
    return jnp.exp(x)
