"""Float32 transcendentals on a TPU as accurate as PyTorch's: what HIGHEST precision asks for.

XLA:TPU computes ``exp``, ``log``, ``tanh``, ``logistic``, ``sin``, ``rsqrt``... with fast
approximations unless a program asks otherwise. Measured on a v5e chip (bench/RESULTS.md,
"torchtpu on a real TPU"): float32 ``log`` 6e-5 from CPU's, ``lgamma`` 2e-3, ``logaddexp`` 3e-4
relative, where CPU and CUDA are within an ulp or two (1e-7); enough to turn every float32
comparison against CPU in the test suite into a failure and to move a small GPT's loss by 1e-3
in 5 steps. StableHLO's ``result_accuracy`` attribute (``lax.AccuracyMode.HIGHEST``) asks XLA
for the accurate implementation. ``asinh``, ``acosh``, ``atanh``, ``lgamma`` and ``digamma``, which
XLA expands into its fast logs whatever they ask for, are lowered from ``tpu_composites``' forms.

torchtpu ties it to the float32 precision users already set: ``torch.tpu.Precision.HIGHEST``
(torchtpu's default, what ``torch.set_float32_matmul_precision("highest")`` means) makes the
TPU lowering of these ops ask for it on float32 and float64 values; ``HIGH`` and ``DEFAULT``
leave XLA's fast forms, as they leave its single-pass bf16 matmuls. The choice reads JAX's
``default_matmul_precision`` at lowering time, which is part of every program's cache key, so
programs built under one setting are never reused under the other. Other platforms keep
JAX's own lowering: XLA:CPU and CUDA are accurate already. bf16 and f16 values keep the fast
forms (their rounding is far coarser than the approximation), and so may float32 math whose value
is rounded to half precision right after (a bf16 SiLU computed in float32, as PyTorch's kernels
compute it): a lowering asks for ``FAST`` there (an accuracy given explicitly is kept). That
matters beyond accuracy: XLA fuses such math into the products that read it, and the accurate
``exp`` of a bf16 SiLU recomputed inside a Llama MLP's products made the TPU compiler retry
those fusions six times (bench/RESULTS.md, "compile1": the whole step at 4 x 2048 compiled 5x
slower than its JAX twin's, whose bf16 SiLU has the fast form).

A lowering cannot see whether its own float32 result is rounded right after: a recorded program
can (``eager/rounded_reads.py``). An op that declares it (``registry.rounded_fast``) passes
``rounded()`` as its transcendentals' accuracy, which is ``FAST`` while the recording traces its
call for a reader that casts the result to half precision (``rounded_to_half``) and None (this
rule) otherwise: the log-softmax backward's ``exp`` in a bf16 step's loss, recomputed inside the
head's two gradient products, whose accurate form made them 1.5 and 0.6 ms slower than the JAX
twin's on a v5e chip (bench/RESULTS.md, whole12).

This is the TPU rule for JAX's primitives in this process, so a user's own JAX code lowered for a
TPU here follows the same precision setting, as it follows ``jax_default_matmul_precision``.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import numpy as np
from jax import lax
from jax._src import config
from jax._src.interpreters import mlir

from torchtpu.runtime import tpu_composites

# The primitives whose lowering takes ``accuracy`` (JAX 0.10-0.11).
_PRIMITIVES = ("exp", "exp2", "expm1", "log", "log1p", "tanh", "logistic", "sin", "cos", "tan",
               "sqrt", "rsqrt", "cbrt")
_ACCURATE = ("highest", "float32")
_WIDE = (np.dtype(np.float32), np.dtype(np.float64))

# What a lowering passes as ``accuracy`` for float32 math rounded to half precision right after:
# XLA's default (fast) form, whose error (a few float32 ulps) is far below a half-precision ulp.
FAST = lax.AccuracyMode.DEFAULT

_installed: list = []
_scope = threading.local()


@contextlib.contextmanager
def rounded_to_half():
    """While tracing: what the ops traced here compute is rounded to half precision right after
    (a recording's reader casts it), so ``rounded()`` is ``FAST``."""
    depth = getattr(_scope, "depth", 0)
    _scope.depth = depth + 1
    try:
        yield
    finally:
        _scope.depth = depth


def rounded():
    """The accuracy a float32 transcendental of a ``registry.rounded_fast`` op asks for while
    traced: ``FAST`` inside ``rounded_to_half``, else None (the platform's rule)."""
    return FAST if getattr(_scope, "depth", 0) else None


def wants_accuracy(dtype) -> bool:
    """Whether a value of dtype lowered now asks the TPU for its accurate transcendentals."""
    return (str(config.default_matmul_precision.value) in _ACCURATE
            and np.dtype(dtype) in _WIDE)


def _rule(default, ctx, *args, accuracy=None, **params):
    if accuracy is None and wants_accuracy(ctx.avals_out[0].dtype):
        accuracy = lax.AccuracyMode.HIGHEST
    return default(ctx, *args, accuracy=accuracy, **params)


def _composite_rule(default, composite, ctx, *args, **params):
    # XLA expands these into its fast logs whatever the op asks for; tpu_composites' forms are
    # built from the primitives above, whose own rule then makes each log accurate.
    if wants_accuracy(ctx.avals_out[0].dtype):
        return mlir.lower_fun(composite, multiple_results=False)(ctx, *args)
    return default(ctx, *args, **params)


def install() -> None:
    """Register the TPU rules (once): each wraps JAX's own rule for the primitive."""
    if _installed:
        return
    for name, composite in tpu_composites.COMPOSITES.items():
        primitive = getattr(lax, f"{name}_p")
        entry = mlir._lowerings[primitive]
        mlir.register_lowering(
            primitive, functools.partial(_composite_rule, entry.rule, composite), platform="tpu")
        _installed.append(name)
    for name in _PRIMITIVES:
        primitive = getattr(lax, f"{name}_p", None)
        entry = mlir._lowerings.get(primitive)
        if entry is None:  # a JAX without this primitive or its generic rule
            continue
        mlir.register_lowering(primitive, functools.partial(_rule, entry.rule),
                               platform="tpu")
        _installed.append(name)
