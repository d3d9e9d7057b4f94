"""``cat`` along a growing dim for eager calls served by size buckets (``eager_buckets``).

``dynamic.plan`` refuses a cat along a padded dim: where each input's real elements land
depends on the real sizes before it. Here each input comes at its bucket (a padded value as its
storage holds it, a real one padded on the host; an input whose size never varied keeps it),
and one program per bucket pattern writes them one after the other into a buffer at traced
offsets, the real sizes before each (``lax.dynamic_update_slice``: each input's padding is
overwritten by the next input, and the last one's lies past the real end). The buffer holds the
sum of the buckets, so no write is ever clamped; the result is the output's bucket, kept padded
(``padded_values``) or cut to its real size on the host.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from torchtpu import metrics
from torchtpu.compile import padded_values
from torchtpu.device import dtypes, ownership
from torchtpu.eager import executor
from torchtpu.eager.program import Spec
from torchtpu.runtime import platform, transfer


def run(op, programs: dict, spec: Spec, values: list, ts: list, varying: tuple,
        bucket_of: Callable[[int], int], prepare: Callable, keep: bool):
    """cat(values[0], dim=values[1]) given the op (the launch's label), its tensors, which size
    slots varied (each tensor's dims in turn), the bucket of a size and how a tensor is given to
    a program at a padded shape (``eager_buckets._prepare``); the result padded when ``keep``,
    else cut; None when it is no cat along the one growing dim of inputs of the result's
    dtype."""
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
    arrays, sources, starts = [], [], []
    for t, n in zip(ts, sizes):
        want = tuple(t.shape[:dim]) + (n,) + tuple(t.shape[dim + 1:])
        got = prepare(t, want, lambda host, want=want: _pad(host, want))
        if got is None:
            return None
        arrays.append(got[0])
        sources.append(got[1])
        starts.append(got[2])
    key = ("cat", dim, tuple(t.shape[:dim] + t.shape[dim + 1:] for t in ts), final, sizes,
           out_size, tuple(sources))
    program = programs.get(key)
    if program is None:
        program = programs[key] = _program(dim, out_size, tuple(sources))
    args = (tuple(arrays), tuple(starts), np.asarray(lengths[:-1], np.int32))
    metrics.count("eager_bucketed_calls")
    if keep:
        out = padded_values.run(program, args, op, executor.current())
        shape = list(ts[0].shape)
        real = tuple((total,) if d == dim else (n,) for d, n in enumerate(shape))
        padded = tuple((out_size,) if d == dim else (n,) for d, n in enumerate(shape))
        return padded_values.wrap_output(out, real, padded)

    def run_and_cut(*args):  # the executor's checks (Debug's NaNs) see real sizes
        metrics.count("eager_host_cuts")
        host = transfer.fetch(program(*args))[(slice(None),) * dim + (slice(0, total),)]
        return transfer.put(np.ascontiguousarray(host), platform.local_device())

    computed = tuple(a.materialize() if isinstance(a, ownership.Deferred) else a for a in arrays)
    return executor.current().run_program(op, run_and_cut, (computed,) + args[1:])


def _pad(host: np.ndarray, want: tuple) -> np.ndarray:
    out = np.zeros(want, host.dtype)
    out[tuple(slice(0, n) for n in host.shape)] = host
    return out


def _program(dim: int, out_size: int, sources: tuple):
    def cat(arrays, starts, lengths):
        arrays = [padded_values.read(a, s, src) for a, s, src in zip(arrays, starts, sources)]
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
