"""FBGEMM's sparse helper ops that TorchRec's ``KeyedJaggedTensor`` calls on its own device.

FBGEMM ships them as CPU and CUDA kernels only, so on tpu they would run through the CPU
fallback (a copy each way per call, and a host sync). The ops exist only once ``fbgemm_gpu`` has
loaded its libraries, so this module is imported by ``torchtpu.integrations.fbgemm`` then, not
by ``torchtpu.lowering``.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from torchtpu.lowering.registry import lowers

fbgemm = torch.ops.fbgemm


# These two run over x in memory order whatever its shape (FBGEMM's kernels do), unlike
# complete_cumsum below.
@lowers(fbgemm.asynchronous_inclusive_cumsum.default)
def inclusive_cumsum(x):
    return jnp.cumsum(x.reshape(-1), dtype=x.dtype).reshape(x.shape)


@lowers(fbgemm.asynchronous_exclusive_cumsum.default)
def exclusive_cumsum(x):
    return inclusive_cumsum(x) - x


@lowers(fbgemm.asynchronous_complete_cumsum.default)
def complete_cumsum(x):
    # Offsets from lengths: one more entry per row than x, starting at 0 (rows of a 2-D x each).
    total = jnp.cumsum(x, axis=-1, dtype=x.dtype)
    zero = jnp.zeros(x.shape[:-1] + (1,), x.dtype)
    return jnp.concatenate([zero, total], axis=-1)
