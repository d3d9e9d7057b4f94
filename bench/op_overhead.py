"""Per-op cost of Strict eager on small tensors, side by side with raw JAX dispatch and native CPU.

For each op: torchtpu Strict (device "tpu"), the same op as a raw ``jax.numpy`` call on arrays
already on the device, and native PyTorch on CPU. The three run in interleaved rounds in one
process (each round times every op every way, ``--calls`` calls each, waiting for the device at
the end of each timed loop), so a loaded machine slows them alike; the median over rounds of
each time and of each round's ratio is printed. ``--clock thread`` times the calling thread's
CPU time instead of the wall clock: the host cost alone, steadier under load (a program XLA:CPU
runs on another thread is not in it).

    python bench/op_overhead.py [--rounds N] [--calls N] [--clock wall|thread]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import torch

import torchtpu  # noqa: F401


def _cases() -> list:
    a_cpu, b_cpu = torch.randn(4, 4), torch.randn(4, 4)
    a, b = a_cpu.to("tpu"), b_cpu.to("tpu")
    ja, jb = jnp.asarray(a_cpu.numpy()), jnp.asarray(b_cpu.numpy())
    big = torch.zeros(64, 4, device="tpu")
    big_cpu = torch.zeros(64, 4)
    state = {"j": jnp.zeros((64, 4), jnp.float32)}

    def jax_slice_add():
        state["j"] = state["j"].at[1:3].add(1.0)

    return [
        ("add", lambda: a + b, lambda: ja + jb, lambda: a_cpu + b_cpu),
        ("mul", lambda: a * b, lambda: ja * jb, lambda: a_cpu * b_cpu),
        ("matmul 4x4", lambda: a @ b, lambda: ja @ jb, lambda: a_cpu @ b_cpu),
        ("slice + add_", lambda: big[1:3].add_(1.0), jax_slice_add,
         lambda: big_cpu[1:3].add_(1.0)),
    ], (ja, state)


def _timed(fn, calls: int, sync, clock) -> float:
    t0 = clock()
    for _ in range(calls):
        fn()
    sync()
    return (clock() - t0) / calls / 1e3  # ns -> µs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=300, help="calls per op per way per round")
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall")
    args = parser.parse_args()
    clock = time.perf_counter_ns if args.clock == "wall" else time.thread_time_ns
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[0]
    cases, jax_state = _cases()
    ja, state = jax_state

    def sync_tpu():
        torch.tpu.synchronize()

    def sync_jax():
        jax.block_until_ready((ja, state["j"]))

    ways = (sync_tpu, sync_jax, lambda: None)
    for _, *fns in cases:  # compiles and first runs are not timed
        for fn in fns:
            for _ in range(20):
                fn()
    sync_tpu()
    times = {name: ([], [], []) for name, *_ in cases}
    for _ in range(args.rounds):
        for name, *fns in cases:
            for fn, sync, out in zip(fns, ways, times[name]):
                out.append(_timed(fn, args.calls, sync, clock))
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[0]
    print(f"{args.rounds} interleaved rounds x {args.calls} calls, {args.clock} clock; "
          f"load {load_before} before, {load_after} after")
    print("| op | tpu µs | jnp µs | cpu µs | tpu/jnp (median of rounds) | tpu/cpu |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, (dev, raw, cpu) in times.items():
        to_jnp = statistics.median(d / r for d, r in zip(dev, raw))
        to_cpu = statistics.median(d / c for d, c in zip(dev, cpu))
        print(f"| {name} | {statistics.median(dev):.1f} | {statistics.median(raw):.1f} | "
              f"{statistics.median(cpu):.1f} | {to_jnp:.2f}x | {to_cpu:.1f}x |")


if __name__ == "__main__":
    main()
