"""``cat`` along a growing dim for eager calls served by size buckets (``eager_buckets``).

``dynamic.plan`` refuses a cat along a padded dim: where each input's real elements land
depends on the real sizes before it. Here each input is padded on the host to its bucket (an
input whose size never varied keeps it), and one program per bucket pattern writes them one
after the other into a buffer at traced offsets, the real sizes before each
(``lax.dynamic_update_slice``: each input's padding is overwritten by the next input, and the
last one's lies past the real end). The buffer holds the sum of the buckets, so no write is ever
clamped; the result is the output's bucket, cut to its real size on the host.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchtpu import metrics
from torchtpu.device import dtypes
from torchtpu.eager import executor
from torchtpu.eager.program import Spec
from torchtpu.runtime import platform, transfer


def run(programs: dict, spec: Spec, values: list, ts: list, arrays: list, varying: tuple,
        bucket_of: Callable[[int], int], read: Callable) -> jax.Array | None:
    """cat(values[0], dim=values[1]) at the real sizes, given its tensors, their arrays, which
    size slots varied (each tensor's dims in turn), the bucket of a size and how a tensor is
    read on the host; None when it is no cat along the one growing dim of inputs of the
    result's dtype."""
    rank = ts[0].dim()
    dim = values[1] % rank if rank else 0
    final = spec.final
    if not rank or any(t.dim() != rank or dtypes.to_jax(t.dtype) != final for t in ts):
        return None
    slot, growing = 0, []
    for _ in ts:
        if any(varying[slot + d] for d in range(rank) if d != dim):
            return None  # another dim varies too: padded elsewhere, not handled here
        growing.append(varying[slot + dim])
        slot += rank
    lengths = [t.shape[dim] for t in ts]
    sizes = tuple(bucket_of(n) if g else n for n, g in zip(lengths, growing))
    total = sum(lengths)
    out_size = bucket_of(total)
    padded = []
    for t, array, n in zip(ts, arrays, sizes):
        host = read(t, array)
        if host is None:
            return None
        if n != host.shape[dim]:
            pad = [(0, 0)] * rank
            pad[dim] = (0, n - host.shape[dim])
            host = np.pad(host, pad)
        padded.append(transfer.put(host, platform.local_device()))
    key = ("cat", dim, tuple(t.shape[:dim] + t.shape[dim + 1:] for t in ts), final, sizes,
           out_size)
    program = programs.get(key)
    if program is None:
        program = programs[key] = _program(dim, out_size)
    def run_and_cut(arrays, lengths):  # the executor's checks (Debug's NaNs) see real sizes
        host = np.asarray(program(arrays, lengths))[(slice(None),) * dim + (slice(0, total),)]
        return transfer.put(np.ascontiguousarray(host), platform.local_device())

    metrics.count("eager_bucketed_calls")
    return executor.current().run_program(
        torch.ops.aten.cat.default, run_and_cut,
        (tuple(padded), np.asarray(lengths[:-1], np.int32)))


def _program(dim: int, out_size: int):
    def cat(arrays, lengths):
        shape = list(arrays[0].shape)
        shape[dim] = max(sum(a.shape[dim] for a in arrays), out_size)
        buf = jnp.zeros(shape, arrays[0].dtype)
        offset = jnp.int32(0)
        for i, a in enumerate(arrays):
            buf = lax.dynamic_update_slice_in_dim(buf, a, offset, dim)
            if i < len(lengths):
                offset = offset + lengths[i]
        return lax.slice_in_dim(buf, 0, out_size, axis=dim)

    return jax.jit(cat)
