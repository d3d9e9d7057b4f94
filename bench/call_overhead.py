"""What one call of a trivial program costs on the host, through each path, side by side.

A program of almost no work (``y = x * 2 + 1`` on a 4x4 float32 tensor) called through:
- ``jax.jit``: the jitted function on a JAX array (the floor every path is measured against);
- Strict: the two ops eagerly on a tpu tensor (two programs);
- compiled: ``torch.compile(f, backend="tpu")``, one of Dynamo's graphs (guards, the graph's
  call, wrapping its result);
- whole step: ``torch.compile(step, backend="tpu")`` of a step that calls ``backward()`` and
  updates the parameter (one captured program per call: ``compile/whole_step.py``);
- replay: the same step captured once with ``torch.tpu.graph`` and ``g.replay()``;
- jax step: the whole step's JAX twin, ``jax.jit`` of value_and_grad + the update, donated.
Every call ends with its result ready (``block_until_ready`` /
``torch.tpu.synchronize([result])``), so each figure is one call's full round trip. The paths
run in interleaved rounds in one process (each round times every path), and the median over
rounds is reported: the ratios hold on a loaded machine.

    python bench/call_overhead.py [--rounds N] [--calls N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import torch

import torchtpu  # noqa: F401


def _paths() -> dict:
    x_cpu = torch.randn(4, 4)
    x = x_cpu.to("tpu")
    jx = jnp.asarray(x_cpu.numpy())
    sync = torch.tpu.synchronize  # given tensors: waits for their values only

    jitted = jax.jit(lambda a: a * 2 + 1)

    def f(a):
        return a * 2 + 1

    compiled = torch.compile(f, backend="tpu")

    w = torch.zeros(4, 4, device="tpu", requires_grad=True)

    def step(inp):
        loss = (inp * w).sum()
        loss.backward()
        with torch.no_grad():
            w.sub_(0.1 * w.grad)
            w.grad = None
        return loss

    whole = torch.compile(step, backend="tpu")

    wg = torch.zeros(4, 4, device="tpu", requires_grad=True)
    static_x = x.clone()

    def graph_step():
        loss = (static_x * wg).sum()
        loss.backward()
        with torch.no_grad():
            wg.sub_(0.1 * wg.grad)
        wg.grad.zero_()
        return loss

    for _ in range(3):  # warm-up: AccumulateGrad's buffers exist before the capture
        graph_step()
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        static_loss = graph_step()

    def jax_update(jw, a):
        loss, grad = jax.value_and_grad(lambda p: (a * p).sum())(jw)
        return loss, jw - 0.1 * grad

    jax_step = jax.jit(jax_update, donate_argnums=0)
    state = {"w": jnp.zeros((4, 4), jnp.float32)}

    def run_jax_step():
        loss, state["w"] = jax_step(state["w"], jx)
        loss.block_until_ready()

    def replay():
        g.replay()
        return static_loss

    return {
        "jax.jit": lambda: jitted(jx).block_until_ready(),
        "Strict (2 ops)": lambda: sync([f(x)]),
        "compiled": lambda: sync([compiled(x)]),
        "jax step": run_jax_step,
        "whole step": lambda: sync([whole(x)]),
        "replay": lambda: sync([replay()]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200, help="calls per path per round")
    args = parser.parse_args()
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[0]
    paths = _paths()
    for fn in paths.values():  # compiles, captures and first runs are not timed
        for _ in range(5):
            fn()
    per_call = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, fn in paths.items():
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            per_call[name].append((time.perf_counter() - t0) / args.calls * 1e6)
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[0]
    floor = {"forward": statistics.median(per_call["jax.jit"]),
             "step": statistics.median(per_call["jax step"])}
    print(f"platform {jax.devices()[0].platform}; {args.rounds} interleaved rounds x "
          f"{args.calls} calls; load {load_before} before, {load_after} after")
    print("| path | µs per call (median) | fastest round | vs its jax.jit |")
    print("| --- | ---: | ---: | ---: |")
    for name, times in per_call.items():
        kind = "step" if name in ("jax step", "whole step", "replay") else "forward"
        med = statistics.median(times)
        print(f"| {name} | {med:.1f} | {min(times):.1f} | {med / floor[kind]:.2f}x |")


if __name__ == "__main__":
    main()
