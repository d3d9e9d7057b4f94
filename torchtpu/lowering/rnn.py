"""The fused LSTM and GRU cells, forward and backward.

``nn.LSTM``, ``nn.GRU``, ``nn.LSTMCell`` and ``nn.GRUCell`` on any device but CPU compute the
gate matmuls as ordinary ops and hand the pointwise rest of each step to
``_thnn_fused_lstm_cell`` / ``_thnn_fused_gru_cell``, which PyTorch implements for CUDA only.
Autograd differentiates them with ``_thnn_fused_*_cell_backward`` (and with the composite
``_thnn_differentiable_*`` ops, which need nothing from us, when a double backward is wanted).

The ``workspace`` output carries what the backward needs from the forward; its layout is ours
(the backward here is its only reader): the activated gates, and for the GRU the previous hidden
state and the hidden candidate's pre-activation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from torchtpu.lowering.registry import lowers, meta_kernel

aten = torch.ops.aten


def _gates(input_gates, hidden_gates, input_bias, hidden_bias, n: int):
    """Both gate projections split into n chunks along dim 1, biases added."""
    if input_bias is not None:
        input_gates = input_gates + input_bias
    if hidden_bias is not None:
        hidden_gates = hidden_gates + hidden_bias
    return jnp.split(input_gates, n, axis=1), jnp.split(hidden_gates, n, axis=1)


@lowers(aten._thnn_fused_lstm_cell.default)
def lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    # One sum: PyTorch adds the gates and both biases before the activations.
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias
    if hidden_bias is not None:
        gates = gates + hidden_bias
    i, f, g, o = jnp.split(gates, 4, axis=1)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    cy = f * cx + i * g
    hy = o * jnp.tanh(cy)
    return hy, cy, jnp.concatenate([i, f, g, o], axis=1)


@lowers(aten._thnn_fused_lstm_cell_backward_impl.default)
def lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    if grad_hy is None and grad_cy is None:
        return None, None, None
    i, f, g, o = jnp.split(workspace, 4, axis=1)
    tanh_cy = jnp.tanh(cy)
    # An undefined output gradient is zero.
    grad_hy = jnp.zeros_like(cy) if grad_hy is None else grad_hy
    grad_c = grad_hy * o * (1 - tanh_cy * tanh_cy)
    if grad_cy is not None:
        grad_c = grad_c + grad_cy
    grad_gates = jnp.concatenate([
        grad_c * g * i * (1 - i),
        grad_c * cx * f * (1 - f),
        grad_c * i * (1 - g * g),
        grad_hy * tanh_cy * o * (1 - o),
    ], axis=1)
    grad_bias = jnp.sum(grad_gates, axis=0) if has_bias else None
    return grad_gates, grad_c * f, grad_bias


@lowers(aten._thnn_fused_gru_cell.default)
def gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    (ir, iz, i_n), (hr, hz, hn) = _gates(input_gates, hidden_gates, input_bias, hidden_bias, 3)
    r = jax.nn.sigmoid(ir + hr)
    z = jax.nn.sigmoid(iz + hz)
    n = jnp.tanh(i_n + r * hn)
    hy = n + z * (hx - n)
    return hy, jnp.concatenate([r, z, n, hx, hn], axis=1)


@lowers(aten._thnn_fused_gru_cell_backward.default)
def gru_cell_backward(grad_hy, workspace, has_bias):
    r, z, n, hx, hn = jnp.split(workspace, 5, axis=1)
    grad_n = grad_hy * (1 - z) * (1 - n * n)
    grad_z = grad_hy * (hx - n) * z * (1 - z)
    grad_r = grad_n * hn * r * (1 - r)
    grad_input = jnp.concatenate([grad_r, grad_z, grad_n], axis=1)
    grad_hidden = jnp.concatenate([grad_r, grad_z, grad_n * r], axis=1)
    if not has_bias:
        return grad_input, grad_hidden, grad_hy * z, None, None
    return (grad_input, grad_hidden, grad_hy * z, jnp.sum(grad_input, axis=0),
            jnp.sum(grad_hidden, axis=0))


# Result shapes come from meta kernels: PyTorch has none for the GRU cell, and its LSTM cell's
# fails on the bias-free call that nn.LSTM(bias=False) makes. These check what a size mismatch
# would break, in the op's terms.
def _check_sizes(op: str, input_gates, hidden_gates, input_bias, hidden_bias, factor, hx):
    torch._check(input_gates.ndim == 2 and input_gates.shape == hidden_gates.shape,
                 lambda: f"{op}: input_gates {tuple(input_gates.shape)} and hidden_gates "
                         f"{tuple(hidden_gates.shape)} must be the same 2-d shape")
    batch, size = input_gates.shape
    torch._check(hx.shape == (batch, size // factor) and size % factor == 0,
                 lambda: f"{op}: the hidden state {tuple(hx.shape)} must be (batch, gates/"
                         f"{factor}) = ({batch}, {size // factor})")
    for bias in (input_bias, hidden_bias):
        if bias is not None and bias.shape != (size,):
            raise RuntimeError(f"torchtpu.argument: {op}: a bias must have shape ({size},), not "
                               f"{tuple(bias.shape)}")


@meta_kernel(aten._thnn_fused_lstm_cell.default)
def _lstm_cell_meta(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    _check_sizes("_thnn_fused_lstm_cell", input_gates, hidden_gates, input_bias, hidden_bias,
                 4, cx)
    return torch.empty_like(cx), torch.empty_like(cx), torch.empty_like(input_gates)


@meta_kernel(aten._thnn_fused_gru_cell.default)
def _gru_cell_meta(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    _check_sizes("_thnn_fused_gru_cell", input_gates, hidden_gates, input_bias, hidden_bias, 3,
                 hx)
    return torch.empty_like(hx), hx.new_empty((hx.shape[0], 5 * hx.shape[1]))


@meta_kernel(aten._thnn_fused_gru_cell_backward.default)
def _gru_cell_backward_meta(grad_hy, workspace, has_bias):
    batch, hidden = grad_hy.shape
    gates = grad_hy.new_empty((batch, 3 * hidden))
    bias = grad_hy.new_empty((3 * hidden,)) if has_bias else None
    other_bias = None if bias is None else torch.empty_like(bias)
    return gates, torch.empty_like(gates), torch.empty_like(grad_hy), bias, other_bias
