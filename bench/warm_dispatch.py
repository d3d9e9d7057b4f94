"""Per-call cost of an op program loaded by key (``warm.dispatched``) against jit's own dispatch.

Three ways to call one small op program on arrays already on the device: ``jax.jit`` (what
Strict called before), ``warm.dispatched`` with its executable loaded by key from a private
cache directory (what a new process's Strict calls now), and the loaded ``Compiled`` called
directly (``warm.Program``'s way: one Python frame more). Interleaved rounds in one process
(each round times every op every way), the calling thread's CPU time by default (the host cost
alone); the median over rounds of each time and of each round's ratio to jit is printed.

    python bench/warm_dispatch.py [--rounds N] [--calls N] [--clock thread|wall]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp

os.environ["TORCHTPU_CACHE_DIR"] = tempfile.mkdtemp(prefix="warm_dispatch-")

from torchtpu import metrics  # noqa: E402 (the cache directory is read at import)
from torchtpu.cache import warm, warm_keys  # noqa: E402


def _add(a, b):
    return a + b


def _matmul(a, b):
    return a @ b


def _addmm(c, a, b):
    return c + a @ b


def _ways(fn, args: tuple) -> dict:
    jitted = jax.jit(fn)
    named = warm_keys.named(jax.jit(fn), "bench", fn.__name__)
    warm.dispatched(named)(*args)  # compiles and writes the index entry
    before = metrics.snapshot().get("programs_loaded_by_key", 0)
    loaded = warm.dispatched(warm_keys.named(jax.jit(fn), "bench", fn.__name__))  # a new process's
    loaded(*args)
    assert metrics.snapshot()["programs_loaded_by_key"] == before + 1, "not loaded by key"
    program = warm.Program(warm_keys.named(jax.jit(fn), "bench", fn.__name__),
                           warm_keys.key_of("bench", fn.__name__))
    program(*args)
    return {"jit": jitted, "dispatched (loaded)": loaded, "Compiled (Program)": program}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--clock", choices=("thread", "wall"), default="thread")
    args = parser.parse_args()
    clock = time.thread_time_ns if args.clock == "thread" else time.perf_counter_ns
    a = jnp.ones((4, 4), jnp.float32)
    cases = {"add 4x4": (_add, (a, a)), "matmul 4x4": (_matmul, (a, a)),
             "addmm 4x4": (_addmm, (a, a, a))}
    ways = {name: _ways(fn, xs) for name, (fn, xs) in cases.items()}
    times = {(c, w): [] for c in cases for w in ways[c]}
    for _ in range(args.rounds):
        for case, (_, xs) in cases.items():
            for way, fn in ways[case].items():
                fn(*xs).block_until_ready()
                t0 = clock()
                for _ in range(args.calls):
                    out = fn(*xs)
                out.block_until_ready()
                times[(case, way)].append((clock() - t0) / args.calls / 1e3)
    print(f"{args.clock} clock, {args.rounds} rounds x {args.calls} calls; us per call "
          "(median), ratio to jit (median of each round's)")
    for case in cases:
        base = times[(case, "jit")]
        for way in ways[case]:
            t = times[(case, way)]
            ratio = statistics.median(x / y for x, y in zip(t, base))
            print(f"{case:12s} {way:22s} {statistics.median(t):7.2f} us  {ratio:5.2f}x")


if __name__ == "__main__":
    main()
