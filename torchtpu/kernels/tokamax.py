"""Tokamax's kernels on tpu tensors: each a ``jax_op`` (``torchtpu::tokamax_<name>``).

Needs the optional extra ``pip install -e '.[tokamax]'`` (``tokamax==0.0.12``: the newest release
that installs on Python 3.11 with our JAX; an unpinned ``pip install tokamax`` resolves to an
empty placeholder). Importing this module without it raises ImportError saying so.

``implementation`` is Tokamax's: None lets it choose on TPU (its Mosaic kernels first: attention,
ragged dot, linear softmax cross-entropy), also when a TPU target compiles the program on a host
without one (``pallas_mode.for_tpu()``); on other platforms None means ``"xla"``, because Tokamax
refuses its Mosaic kernels off TPU instead of interpreting them. On TPU a call is traced as
Mosaic takes it (``pallas_mode.mosaic_ready``: 32-bit indices, one-pass matmuls on bfloat16).
Layouts are Tokamax's: attention takes (batch, length, heads, head_dim), not PyTorch's
(batch, heads, length, head_dim). Gradients come from Tokamax's own VJPs (through ``jax_op``'s
derived backward).
"""

from __future__ import annotations

import jax

from torchtpu import errors
from torchtpu.kernels import pallas_mode
from torchtpu.kernels.jax_op import jax_op

try:
    import tokamax as _tokamax
except ImportError as e:
    raise ImportError(errors.message(
        "kernel", "torchtpu.kernels.tokamax needs Tokamax: pip install -e '.[tokamax]' (pins "
        "tokamax==0.0.12; an unpinned `pip install tokamax` gets an empty placeholder)")) from e

from absl import flags as _absl_flags  # noqa: E402 (a Tokamax dependency)

# Tokamax reads its options as absl flags and, when nothing parsed them yet, parses sys.argv: in
# any program with its own command line (pytest, a training script) that raises "Unknown command
# line flag". Marking the flags parsed keeps Tokamax's defaults (and its config context managers).
if not _absl_flags.FLAGS.is_parsed():
    _absl_flags.FLAGS.mark_as_parsed()

_ACTIVATIONS = {"silu": jax.nn.silu, "gelu": jax.nn.gelu, "relu": jax.nn.relu,
                "sigmoid": jax.nn.sigmoid, "none": None}


def _implementation(requested: str | None):
    if requested is None and not pallas_mode.for_tpu():
        return "xla"
    return requested


def _run(fn, first: jax.Array, implementation: str | None, *arrays: jax.Array | None):
    """``fn(*arrays, implementation)``, traced for Mosaic when Tokamax may pick a TPU kernel.
    ``None`` arrays (an absent bias) stay out of the traced arguments."""
    chosen = _implementation(implementation)
    present = [i for i, a in enumerate(arrays) if a is not None]

    def call(*given):
        full = list(arrays)
        for i, a in zip(present, given):
            full[i] = a
        return fn(*full, implementation=chosen)

    if chosen != "xla" and pallas_mode.for_tpu():
        call = pallas_mode.mosaic_ready(call, first.dtype)
    return call(*[arrays[i] for i in present])


def _precision(x: jax.Array):
    """torch's matmul precision for x's dtype: exact float32, or one pass for narrower floats
    (exact for them; Mosaic refuses an fp32 contraction of bfloat16)."""
    return jax.lax.Precision.HIGHEST if x.dtype.itemsize >= 4 else jax.lax.Precision.DEFAULT


def _dot_product_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                           bias: jax.Array | None = None, mask: jax.Array | None = None,
                           scale: float | None = None, is_causal: bool = False,
                           implementation: str | None = None) -> jax.Array:
    return _run(lambda q, k, v, b, m, implementation: _tokamax.dot_product_attention(
        q, k, v, b, m, scale=scale, is_causal=is_causal, implementation=implementation),
        query, implementation, query, key, value, bias, mask)


def _ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                implementation: str | None = None) -> jax.Array:
    return _run(lambda a, b, g, implementation: _tokamax.ragged_dot(
        a, b, g.astype("int32"), precision=_precision(a), implementation=implementation),
        lhs, implementation, lhs, rhs, group_sizes)


def _layer_norm(x: jax.Array, scale: jax.Array | None = None,
                offset: jax.Array | None = None, epsilon: float = 1e-6,
                subtract_mean: bool = True, implementation: str | None = None) -> jax.Array:
    return _run(lambda a, s, o, implementation: _tokamax.layer_norm(
        a, s, o, epsilon=epsilon, subtract_mean=subtract_mean, implementation=implementation),
        x, implementation, x, scale, offset)


def _gated_linear_unit(x: jax.Array, weights: jax.Array, activation: str = "silu",
                       implementation: str | None = None) -> jax.Array:
    if activation not in _ACTIVATIONS:
        raise ValueError(errors.message(
            "kernel", f"tokamax gated_linear_unit: activation {activation!r} is not one of "
            f"{', '.join(_ACTIVATIONS)}"))
    return _run(lambda a, w, implementation: _tokamax.gated_linear_unit(
        a, w, activation=_ACTIVATIONS[activation], precision=_precision(a),
        implementation=implementation), x, implementation, x, weights)


def _linear_softmax_cross_entropy_loss(x: jax.Array, labels: jax.Array, weights: jax.Array,
                                       reduction: str = "sum",
                                       implementation: str | None = None) -> jax.Array:
    return _run(lambda a, lab, w, implementation: _tokamax.linear_softmax_cross_entropy_loss(
        a, lab, w, reduction=reduction, implementation=implementation),
        x, implementation, x, labels, weights)


dot_product_attention = jax_op("torchtpu::tokamax_dot_product_attention", _dot_product_attention)
ragged_dot = jax_op("torchtpu::tokamax_ragged_dot", _ragged_dot)
layer_norm = jax_op("torchtpu::tokamax_layer_norm", _layer_norm)
gated_linear_unit = jax_op("torchtpu::tokamax_gated_linear_unit", _gated_linear_unit)
linear_softmax_cross_entropy_loss = jax_op("torchtpu::tokamax_linear_softmax_cross_entropy_loss",
                                           _linear_softmax_cross_entropy_loss)

__all__ = ["dot_product_attention", "gated_linear_unit", "layer_norm",
           "linear_softmax_cross_entropy_loss", "ragged_dot"]
