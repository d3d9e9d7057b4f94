"""Per-op cost of Strict eager on small tensors, side by side with raw JAX dispatch and native CPU.

For each op: torchtpu Strict (device "tpu"), the same op as a raw ``jax.numpy`` call on arrays
already on the device, the same op as one ``jax.jit`` function called directly (the program call
Strict's launch makes: the floor of any eager launch) and native PyTorch on CPU. The ops are the
common ones of a Llama step: elementwise (add, multiply by a tensor and by a Python number), a
product (plain, and under bf16 autocast: two casts folded into the product), views (transpose,
reshape: no program), reductions, a slice's in-place add, and a sum over a fresh autocast-style
cast beside the same cast with a sum of another tensor (what reading a pending cast adds). The four
ways run in interleaved rounds in one process (each round times every op every way, ``--calls``
calls each, waiting for the device at the end of each timed loop), so a loaded machine slows them
alike; the median over rounds of each time and of each round's ratio is printed. ``--clock thread``
times the calling thread's CPU time instead of the wall clock: the host cost alone, steadier under
load (a program XLA:CPU runs on another thread is not in it). The table's last two columns count
the Python function calls (cProfile's, builtins included) one call of the op makes, Strict's and
raw JAX's: a load-free figure of each way's host path.

    python bench/op_overhead.py [--rounds N] [--calls N] [--clock wall|thread] [--ops a,b]
"""

from __future__ import annotations

import argparse
import cProfile
import statistics
import time

import jax
import jax.numpy as jnp
import torch

import torchtpu  # noqa: F401


def _cases() -> tuple:
    a_cpu, b_cpu = torch.randn(4, 4), torch.randn(4, 4)
    a, b = a_cpu.to("tpu"), b_cpu.to("tpu")
    ja, jb = jnp.asarray(a_cpu.numpy()), jnp.asarray(b_cpu.numpy())
    big = torch.zeros(64, 4, device="tpu")
    big_cpu = torch.zeros(64, 4)
    state = {"j": jnp.zeros((64, 4), jnp.float32), "k": jnp.zeros((64, 4), jnp.float32)}
    bf16 = jnp.bfloat16
    # A computed bfloat16 tensor (sent from the host, no lazy cast), beside a fresh cast of a.
    w_cpu = torch.randn(4, 4, dtype=torch.bfloat16)
    w, jw = w_cpu.to("tpu"), jnp.asarray(w_cpu.float().numpy()).astype(bf16)

    def jax_slice_add():
        state["j"] = state["j"].at[1:3].add(1.0)

    def jit_slice_add():
        state["k"] = _slice_add(state["k"])

    def autocast(fn):
        def run():
            with torch.autocast("tpu", torch.bfloat16):
                return fn()
        return run

    def cpu_autocast(fn):
        def run():
            with torch.autocast("cpu", torch.bfloat16):
                return fn()
        return run

    return [
        ("add", lambda: a + b, lambda: ja + jb, lambda: _add(ja, jb), lambda: a_cpu + b_cpu),
        ("mul", lambda: a * b, lambda: ja * jb, lambda: _mul(ja, jb), lambda: a_cpu * b_cpu),
        ("mul 0.3", lambda: a * 0.3, lambda: ja * 0.3, lambda: _mul(ja, 0.3),
         lambda: a_cpu * 0.3),
        ("matmul 4x4", lambda: a @ b, lambda: ja @ jb, lambda: _mm(ja, jb), lambda: a_cpu @ b_cpu),
        ("matmul autocast", autocast(lambda: a @ b),
         lambda: ja.astype(bf16) @ jb.astype(bf16), lambda: _mm_bf16(ja, jb),
         cpu_autocast(lambda: a_cpu @ b_cpu)),
        ("sum(-1)", lambda: a.sum(-1), lambda: ja.sum(-1), lambda: _sum(ja),
         lambda: a_cpu.sum(-1)),
        # A sum over a fresh (kept, lazy) cast, then the same cast beside a sum of another
        # tensor: what reading the pending cast adds is their difference (strict14).
        ("cast + its sum", lambda: a.to(torch.bfloat16).sum(-1),
         lambda: ja.astype(bf16).sum(-1), lambda: _cast_sum(ja),
         lambda: a_cpu.to(torch.bfloat16).sum(-1)),
        ("cast + other sum", lambda: (a.to(torch.bfloat16), w.sum(-1)),
         lambda: (ja.astype(bf16), jw.sum(-1)), lambda: (_cast(ja), _sum(jw)),
         lambda: (a_cpu.to(torch.bfloat16), w_cpu.sum(-1))),
        ("mean(-1, keepdim)", lambda: a.mean(-1, keepdim=True),
         lambda: ja.mean(-1, keepdims=True), lambda: _mean(ja),
         lambda: a_cpu.mean(-1, keepdim=True)),
        ("t()", lambda: a.t(), lambda: ja.T, lambda: _t(ja), lambda: a_cpu.t()),
        ("view(2, 8)", lambda: a.view(2, 8), lambda: ja.reshape(2, 8), lambda: _view(ja),
         lambda: a_cpu.view(2, 8)),
        ("slice + add_", lambda: big[1:3].add_(1.0), jax_slice_add, jit_slice_add,
         lambda: big_cpu[1:3].add_(1.0)),
    ], (ja, state)


_add = jax.jit(lambda x, y: x + y)
_mul = jax.jit(lambda x, y: x * y)
_mm = jax.jit(lambda x, y: x @ y)
_mm_bf16 = jax.jit(lambda x, y: x.astype(jnp.bfloat16) @ y.astype(jnp.bfloat16))
_sum = jax.jit(lambda x: x.sum(-1))
_cast = jax.jit(lambda x: x.astype(jnp.bfloat16))
_cast_sum = jax.jit(lambda x: x.astype(jnp.bfloat16).sum(-1))
_mean = jax.jit(lambda x: x.mean(-1, keepdims=True))
_t = jax.jit(lambda x: x.T)
_view = jax.jit(lambda x: x.reshape(2, 8))
_slice_add = jax.jit(lambda x: x.at[1:3].add(1.0), donate_argnums=0)


def _timed(fn, calls: int, sync, clock) -> float:
    t0 = clock()
    for _ in range(calls):
        fn()
    sync()
    return (clock() - t0) / calls / 1e3  # ns -> µs


def python_calls(fn, calls: int = 50) -> float:
    """Python function calls (cProfile's count, builtins included) per call of fn, warm."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    return sum(row[1] for row in profile.getstats()) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=300, help="calls per op per way per round")
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall")
    parser.add_argument("--ops", default=None, help="comma-separated op names (default: all)")
    args = parser.parse_args()
    clock = time.perf_counter_ns if args.clock == "wall" else time.thread_time_ns
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[0]
    cases, jax_state = _cases()
    if args.ops:
        cases = [c for c in cases if c[0] in args.ops.split(",")]
    ja, state = jax_state

    def sync_tpu():
        torch.tpu.synchronize()

    def sync_jax():
        jax.block_until_ready((ja, state["j"], state["k"]))

    ways = (sync_tpu, sync_jax, sync_jax, lambda: None)
    for _, *fns in cases:  # compiles and first runs are not timed
        for fn in fns:
            for _ in range(20):
                fn()
    sync_tpu()
    times = {name: ([], [], [], []) for name, *_ in cases}
    for _ in range(args.rounds):
        for name, *fns in cases:
            for fn, sync, out in zip(fns, ways, times[name]):
                out.append(_timed(fn, args.calls, sync, clock))
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[0]
    counted = {name: (python_calls(fns[0]), python_calls(fns[1])) for name, *fns in cases}
    sync_tpu()
    print(f"{args.rounds} interleaved rounds x {args.calls} calls, {args.clock} clock; "
          f"load {load_before} before, {load_after} after")
    print("| op | tpu µs | jnp µs | jit µs | cpu µs | tpu/jnp | tpu/jit | tpu/cpu "
          "| tpu py calls | jnp py calls |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, (dev, raw, jit, cpu) in times.items():
        ratios = [statistics.median(d / r for d, r in zip(dev, other)) for other in (raw, jit, cpu)]
        print(f"| {name} | {statistics.median(dev):.1f} | {statistics.median(raw):.1f} | "
              f"{statistics.median(jit):.1f} | {statistics.median(cpu):.1f} | "
              f"{ratios[0]:.2f}x | {ratios[1]:.2f}x | {ratios[2]:.1f}x | "
              f"{counted[name][0]:.0f} | {counted[name][1]:.0f} |")


if __name__ == "__main__":
    main()
