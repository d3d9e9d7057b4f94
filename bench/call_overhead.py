"""What one call of a trivial program costs on the host, through each path, side by side.

A program of almost no work (``y = x * 2 + 1`` on a 4x4 float32 tensor) called through:
- ``jax.jit``: the jitted function on a JAX array (the floor every path is measured against);
- Strict: the two ops eagerly on a tpu tensor (two programs);
- compiled: ``torch.compile(f, backend="tpu")``, one of Dynamo's graphs (guards, the graph's
  call, wrapping its result);
- whole step: ``torch.compile(step, backend="tpu")`` of a step that calls ``backward()`` and
  updates its parameters (one captured program per call: ``compile/whole_step.py``);
- replay: the same step captured once with ``torch.tpu.graph`` and ``g.replay()``;
- jax step: the step's JAX twin, ``jax.jit`` of value_and_grad + the same update, donated.
The step has ``--params`` 4x4 parameters (per-input costs show at a real model's count, ~80)
and updates them by hand (``--optimizer none``: ``w -= 0.1 * w.grad``) or with
``torch.optim.SGD(momentum=0.9)`` / ``AdamW`` (the replay's AdamW is ``capturable=True``, as a
capture requires; the whole step's is the default one, as users write it); the JAX twin does
the same arithmetic. Every call ends with its result ready (``block_until_ready`` /
``torch.tpu.synchronize([result])``), so each figure is one call's full round trip. The paths
run in interleaved rounds in one process (each round times every path), and the median over
rounds is reported: the ratios hold on a loaded machine. ``--clock thread`` times the calling
thread's CPU time instead of the wall clock (XLA:CPU runs these small programs on the calling
thread): on a loaded machine that leaves out the time other processes take. ``--count-calls``
prints instead the Python function calls one call of each path makes (cProfile's count: the
same on any load; C code such as a jitted call counts once).

    python bench/call_overhead.py [--rounds N] [--calls N] [--params N]
        [--optimizer none|sgd|adamw] [--clock wall|thread] [--count-calls]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import jax
import jax.numpy as jnp
import torch

import torchtpu  # noqa: F401

LR = {"none": 0.1, "sgd": 0.1, "adamw": 1e-3}


def _torch_optimizer(kind: str, params: list, capturable: bool):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=LR[kind], momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=LR[kind], capturable=capturable)
    return None


def _torch_steps(x: torch.Tensor, n: int, kind: str) -> tuple:
    """The step as the whole step compiles it and as a graph captures it."""
    ws = [torch.zeros(4, 4, device="tpu", requires_grad=True) for _ in range(n)]
    opt = _torch_optimizer(kind, ws, capturable=False)

    def step(inp):
        loss = sum((inp * w).sum() for w in ws)
        loss.backward()
        if opt is None:
            with torch.no_grad():
                for w in ws:
                    w.sub_(LR[kind] * w.grad)
                    w.grad = None
        else:
            opt.step()
            opt.zero_grad()
        return loss

    wg = [torch.zeros(4, 4, device="tpu", requires_grad=True) for _ in range(n)]
    opt_g = _torch_optimizer(kind, wg, capturable=True)
    static_x = x.clone()

    def graph_step():
        loss = sum((static_x * w).sum() for w in wg)
        loss.backward()
        if opt_g is None:
            with torch.no_grad():
                for w in wg:
                    w.sub_(LR[kind] * w.grad)
                    w.grad.zero_()
        else:
            opt_g.step()
        return loss

    for _ in range(3):  # warm-up: AccumulateGrad's buffers and optimizer state exist first
        if opt_g is not None:
            opt_g.zero_grad()
        graph_step()
    if opt_g is not None:
        opt_g.zero_grad()  # (set_to_none: the capture's backward makes the .grad it rewrites)
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        static_loss = graph_step()

    def replay():
        g.replay()
        return static_loss

    return torch.compile(step, backend="tpu"), replay


def _jax_step(jx, n: int, kind: str):
    """The step's JAX twin: one jitted call, parameters and optimizer state donated."""
    lr = LR[kind]

    def update(state, a):
        ws = state["w"]
        loss, grads = jax.value_and_grad(lambda ps: sum((a * p).sum() for p in ps))(ws)
        if kind == "sgd":
            bufs = [0.9 * b + gr for b, gr in zip(state["m"], grads)]
            return loss, {"w": [w - lr * b for w, b in zip(ws, bufs)], "m": bufs}
        if kind == "adamw":
            t = state["t"] + 1
            ms = [0.9 * m + 0.1 * gr for m, gr in zip(state["m"], grads)]
            vs = [0.999 * v + 0.001 * gr * gr for v, gr in zip(state["v"], grads)]
            c1, c2 = 1 - 0.9 ** t, 1 - 0.999 ** t
            new = [w * (1 - lr * 0.01) - lr * (m / c1) / (jnp.sqrt(v / c2) + 1e-8)
                   for w, m, v in zip(ws, ms, vs)]
            return loss, {"w": new, "m": ms, "v": vs, "t": t}
        return loss, {"w": [w - lr * gr for w, gr in zip(ws, grads)]}

    jitted = jax.jit(update, donate_argnums=0)
    zeros = [jnp.zeros((4, 4), jnp.float32) for _ in range(n)]
    state = {"state": {"w": zeros}}
    if kind in ("sgd", "adamw"):
        state["state"]["m"] = [z + 0 for z in zeros]
    if kind == "adamw":
        state["state"]["v"] = [z + 0 for z in zeros]
        state["state"]["t"] = jnp.zeros((), jnp.float32)

    def run():
        loss, state["state"] = jitted(state["state"], jx)
        loss.block_until_ready()

    return run


def _paths(n: int = 1, kind: str = "none") -> dict:
    x_cpu = torch.randn(4, 4)
    x = x_cpu.to("tpu")
    jx = jnp.asarray(x_cpu.numpy())
    sync = torch.tpu.synchronize  # given tensors: waits for their values only

    jitted = jax.jit(lambda a: a * 2 + 1)

    def f(a):
        return a * 2 + 1

    compiled = torch.compile(f, backend="tpu")
    whole, replay = _torch_steps(x, n, kind)
    return {
        "jax.jit": lambda: jitted(jx).block_until_ready(),
        "Strict (2 ops)": lambda: sync([f(x)]),
        "compiled": lambda: sync([compiled(x)]),
        "jax step": _jax_step(jx, n, kind),
        "whole step": lambda: sync([whole(x)]),
        "replay": lambda: sync([replay()]),
    }


def interleaved(fns: dict, rounds: int, calls: int, clock, warmup: int) -> dict:
    """{name: µs per call of each round}: every function called ``warmup`` times untimed
    (compiles, captures, first runs), then rounds of ``calls`` calls of each in turn."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    per_call = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = clock()
            for _ in range(calls):
                fn()
            per_call[name].append((clock() - t0) / calls / 1e3)
    return per_call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200, help="calls per path per round")
    parser.add_argument("--params", type=int, default=1, help="4x4 parameters of the step")
    parser.add_argument("--optimizer", choices=sorted(LR), default="none")
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall")
    parser.add_argument("--count-calls", action="store_true",
                        help="Python function calls per call of each path, not times")
    args = parser.parse_args()
    if args.count_calls:
        _count_calls(args)
        return
    clock = time.perf_counter_ns if args.clock == "wall" else time.thread_time_ns
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[0]
    per_call = interleaved(_paths(args.params, args.optimizer), args.rounds, args.calls, clock,
                           warmup=5)
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[0]
    floor = {"forward": statistics.median(per_call["jax.jit"]),
             "step": statistics.median(per_call["jax step"])}
    print(f"platform {jax.devices()[0].platform}; {args.rounds} interleaved rounds x "
          f"{args.calls} calls; {args.clock} clock; step of {args.params} parameter(s), "
          f"optimizer {args.optimizer}; load {load_before} before, {load_after} after")
    print("| path | µs per call (median) | fastest round | vs its jax.jit |")
    print("| --- | ---: | ---: | ---: |")
    for name, times in per_call.items():
        kind = "step" if name in ("jax step", "whole step", "replay") else "forward"
        med = statistics.median(times)
        print(f"| {name} | {med:.1f} | {min(times):.1f} | {med / floor[kind]:.2f}x |")


def _count_calls(args) -> None:
    from torchtpu.device import memory

    # synchronize's peak-memory walk on XLA:CPU runs every 50 ms, not per call: left out.
    memory.SAMPLE_INTERVAL_S = float("inf")
    paths = _paths(args.params, args.optimizer)
    print(f"Python calls per call; step of {args.params} parameter(s), optimizer "
          f"{args.optimizer}")
    for name, fn in paths.items():
        for _ in range(5):
            fn()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            fn()
        profile.disable()
        print(f"| {name} | {pstats.Stats(profile).total_calls / args.calls:.0f} |")


if __name__ == "__main__":
    main()
