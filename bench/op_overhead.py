"""Per-op cost of Strict eager on small tensors, side by side with raw JAX dispatch and native CPU.

For each op: torchtpu Strict (device "tpu"), the same op as a raw ``jax.numpy`` call on arrays
already on the device, and native PyTorch on CPU, each timed over the same number of iterations,
waiting for the device at the end of each timed loop. Prints microseconds per op and the ratios.

    python bench/op_overhead.py [--iters N]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import torch

import torchtpu  # noqa: F401


def _time(fn, iters: int, sync) -> float:
    for _ in range(20):
        fn()
    sync()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best / iters * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000)
    iters = parser.parse_args().iters

    a_cpu, b_cpu = torch.randn(4, 4), torch.randn(4, 4)
    a, b = a_cpu.to("tpu"), b_cpu.to("tpu")
    ja, jb = jnp.asarray(a_cpu.numpy()), jnp.asarray(b_cpu.numpy())
    big = torch.zeros(64, 4, device="tpu")
    big_cpu = torch.zeros(64, 4)
    jbig = jnp.zeros((64, 4), jnp.float32)
    state = {"j": jbig}

    def jax_slice_add():
        state["j"] = state["j"].at[1:3].add(1.0)

    cases = [
        ("add", lambda: a + b, lambda: ja + jb, lambda: a_cpu + b_cpu),
        ("mul", lambda: a * b, lambda: ja * jb, lambda: a_cpu * b_cpu),
        ("matmul 4x4", lambda: a @ b, lambda: ja @ jb, lambda: a_cpu @ b_cpu),
        ("slice + add_", lambda: big[1:3].add_(1.0), jax_slice_add,
         lambda: big_cpu[1:3].add_(1.0)),
    ]

    def sync_tpu():
        torch.tpu.synchronize()

    def sync_jax():
        jax.block_until_ready((ja, state["j"]))

    print(f"{'op':<14}{'tpu µs':>10}{'jnp µs':>10}{'cpu µs':>10}{'tpu/jnp':>10}{'tpu/cpu':>10}")
    for name, dev, raw, cpu in cases:
        t_dev = _time(dev, iters, sync_tpu)
        t_raw = _time(raw, iters, sync_jax)
        t_cpu = _time(cpu, iters, lambda: None)
        print(f"{name:<14}{t_dev:>10.1f}{t_raw:>10.1f}{t_cpu:>10.1f}"
              f"{t_dev / t_raw:>10.2f}{t_dev / t_cpu:>10.1f}")


if __name__ == "__main__":
    main()
