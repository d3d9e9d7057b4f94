"""A KV-cache row update through ``jax_op``, with the cache donated and without, side by side.

The same JAX function (``dynamic_update_slice`` of a few rows into a large cache) as two ops:
one with ``donate_argnums=(0,)``, whose program writes the rows into the cache's own buffer, and
one without, whose program writes a new cache (a copy of the whole buffer). Each call is
``cache = op(cache, rows, at)`` and waits for the device, in Strict and DeferAndFuse. Prints
milliseconds per call, best of the rounds, and the ratio undonated / donated.

    python bench/jax_op_donation.py [--rows 4096] [--width 1024] [--calls 50] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

import jax
import torch

import torchtpu  # noqa: F401
from torchtpu.kernels.jax_op import jax_op


def _update(cache: jax.Array, rows: jax.Array, at: int) -> jax.Array:
    return jax.lax.dynamic_update_slice(cache, rows, (at, 0))


OPS = {"donated": jax_op("bench_donation::donated", _update, donate_argnums=(0,)),
       "copied": jax_op("bench_donation::copied", _update)}


def _per_call(op, shape: tuple, calls: int, rounds: int) -> float:
    cache = torch.zeros(shape, device="tpu")
    rows = torch.ones(8, shape[1], device="tpu")
    for i in range(3):  # compiles
        cache = op(cache, rows, i)
    torch.tpu.synchronize()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for i in range(calls):
            cache = op(cache, rows, (i * 8) % shape[0])
            torch.tpu.synchronize()
        best = min(best, time.perf_counter() - start)
    expected = torch.zeros(shape)
    expected[:min(calls * 8, shape[0])] = 1
    assert torch.equal(cache.cpu(), expected)
    return best / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    shape = (args.rows, args.width)
    print(f"cache float32{list(shape)} ({args.rows * args.width * 4 / 2**20:.0f} MiB), 8 rows "
          f"written per call, best of {args.rounds} rounds of {args.calls} calls; platform "
          f"{jax.devices()[0].platform}")
    print(f"{'mode':<14}{'donated ms':>12}{'copied ms':>12}{'ratio':>8}")
    for mode in (torch.tpu.EagerMode.DEFER_NEVER, torch.tpu.EagerMode.DEFER_AND_FUSE):
        with torch.tpu.set_eager_mode(mode):
            donated, copied = (_per_call(OPS[k], shape, args.calls, args.rounds)
                               for k in ("donated", "copied"))
        name = "Strict" if mode == torch.tpu.EagerMode.DEFER_NEVER else "DeferAndFuse"
        print(f"{name:<14}{donated:>12.3f}{copied:>12.3f}{copied / donated:>7.1f}x")


if __name__ == "__main__":
    main()
