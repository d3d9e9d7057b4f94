"""Numbers XLA should see: ``x.pow(2)`` against ``x * x``, and a hand-written RMSNorm
(``x.pow(2).mean(-1, keepdim=True)``, as Hugging Face's LlamaRMSNorm), on a 4096x1024 float32
tensor: Strict and DeferAndFuse eager, native CPU eager and ``jax.jit``, side by side.

    python bench/constants.py [--iters 20]
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import torch

SHAPE = (4096, 1024)


def _rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _timed(fn, iters: int, sync) -> float:
    sync(fn())
    start = time.perf_counter()
    for _ in range(iters):
        out = fn()
    sync(out)
    return (time.perf_counter() - start) / iters


def _tpu_sync(t):
    t.cpu()  # a host read waits for (and, in DeferAndFuse, runs) the work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    xc, wc = torch.randn(SHAPE), torch.randn(SHAPE[1])
    x, w = xc.to("tpu"), wc.to("tpu")
    rows = []
    for mode in (torch.tpu.EagerMode.DEFER_NEVER, torch.tpu.EagerMode.DEFER_AND_FUSE):
        with torch.tpu.set_eager_mode(mode):
            name = "Strict" if mode is torch.tpu.EagerMode.DEFER_NEVER else "DeferAndFuse"
            rows.append((f"tpu {name}: x.pow(2)",
                         _timed(lambda: x.pow(2), args.iters, _tpu_sync)))
            rows.append((f"tpu {name}: x * x", _timed(lambda: x * x, args.iters, _tpu_sync)))
            rows.append((f"tpu {name}: RMSNorm",
                         _timed(lambda: _rms_norm(x, w), args.iters, _tpu_sync)))
    rows.append(("cpu eager: RMSNorm", _timed(lambda: _rms_norm(xc, wc), args.iters,
                                              lambda t: None)))
    xj, wj = jnp.asarray(xc.numpy()), jnp.asarray(wc.numpy())
    rms = jax.jit(lambda x, w: x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w)
    rows.append(("jax.jit: RMSNorm", _timed(lambda: rms(xj, wj), args.iters,
                                            jax.block_until_ready)))
    print(f"{SHAPE[0]}x{SHAPE[1]} float32, {args.iters} iterations; load "
          f"{os.getloadavg()[0]:.2f}")
    jit_time = rows[-1][1]
    for name, sec in rows:
        print(f"{name:<32}{sec * 1e3:>9.2f} ms{jit_time / sec:>8.2f}x of jax.jit")


if __name__ == "__main__":
    main()
