"""Scaled low-precision products: ``torch._scaled_mm`` on float8 operands.

vLLM's FP8 linear layers (``quantization="fp8"``) call ``torch._scaled_mm`` with float8_e4m3fn
activations and weights and float32 scales. The float8 operands stay float8 in the program (a
TPU with float8 matrix units multiplies them as they are; XLA:CPU widens them) and accumulate in
float32, as PyTorch's CPU kernel does; the scales, the bias and the cast to ``out_dtype`` follow
it too: ``(a @ b) * scale_a * scale_b + bias``, then ``/ scale_result`` for a float8 result.
Scales of one element (per tensor) or rowwise ones (``scale_a`` (M, 1), ``scale_b`` (1, N))
broadcast alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from torchtpu.device import dtypes
from torchtpu.lowering.registry import lowers

aten = torch.ops.aten

_FLOAT8 = tuple(dtypes.to_jax(d) for d in (
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz))


@lowers(aten._scaled_mm.default)
def scaled_mm(a: jax.Array, b: jax.Array, scale_a: jax.Array, scale_b: jax.Array,
              bias: jax.Array | None = None, scale_result: jax.Array | None = None,
              out_dtype: torch.dtype | None = None, use_fast_accum: bool = False) -> jax.Array:
    # use_fast_accum is a CUDA accumulation mode; float32 accumulation is what CPU gives
    out = jnp.matmul(a, b, preferred_element_type=jnp.float32)
    out = out * scale_a.astype(jnp.float32) * scale_b.astype(jnp.float32)
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    target = a.dtype if out_dtype is None else dtypes.to_jax(out_dtype)
    if scale_result is not None and target in _FLOAT8:
        out = out / scale_result.astype(jnp.float32)
    return dtypes.cast(out, target)
