"""What torch.profiler with ProfilerActivity.TPU costs a small GPT training step, side by side.

One process, TinyGPT (2 layers, width 64, sequence 32, batch 8, AdamW with clipping), in Strict,
DeferAndFuse and torch.compile. Per mode, after warmup, rounds of: N steps unprofiled; N steps
inside ``profile(activities=[CPU])`` (PyTorch's own host recording alone); N steps inside
``profile(activities=[CPU, TPU])``; N steps inside the same with ``TpuProfilerConfig`` (an XProf
run written to a temporary directory). The step time is taken inside the window; the window's
fixed cost (start, stop, reading the device trace and exporting the Chrome trace) is given
apart. Best round of each.

    python bench/profiler_overhead.py [--steps 10] [--rounds 3] [--warmup 3] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import timeit
import warnings

import jax
import jax.numpy as jnp
import torch
from torch.profiler import ProfilerActivity, profile

import torchtpu  # noqa: F401
from torchtpu.demo.gpt import TinyGPT, batch
from torchtpu.device.hooks import HOOKS
from torchtpu.profiler import session

VOCAB, BLOCK, WIDTH, LAYERS, HEADS, BATCH = 96, 32, 64, 2, 2, 8
ACTIVITIES = [ProfilerActivity.CPU, ProfilerActivity.TPU]
VARIANTS = ("CPU only", "CPU+TPU", "+XProf")
# How steps are timed: wall clock, or (``--clock cpu``) the CPU seconds of all the process's
# threads (XLA:CPU's too), which a box loaded by other jobs disturbs far less.
CLOCK = [time.perf_counter]


def _trainer(compiled: bool):
    torch.manual_seed(0)
    data = torch.randint(VOCAB, (4096,), generator=torch.Generator().manual_seed(1))
    model = TinyGPT(VOCAB, BLOCK, n_layer=LAYERS, n_head=HEADS, n_embd=WIDTH).to("tpu")
    run = torch.compile(model, backend="tpu") if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)

    def steps(n: int) -> float:
        start = CLOCK[0]()
        for _ in range(n):
            x, y = batch(data, BATCH, BLOCK, gen)
            _, loss = run(x.to("tpu"), y.to("tpu"))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            loss.item()
        return (CLOCK[0]() - start) / n

    return steps


def _profiled(steps, n: int, activities, config, directory: str) -> tuple[float, float, float]:
    """(seconds per step inside the window, the window's fixed seconds, launches per step)."""
    start = CLOCK[0]()
    with profile(activities=activities, experimental_config=config) as prof:
        per_step = steps(n)
    prof.export_chrome_trace(os.path.join(directory, "trace.json"))
    trace = torch.tpu.profiler.device_trace(prof)
    return (per_step, CLOCK[0]() - start - per_step * n,
            len(trace.launches) / n if trace is not None else 0.0)


def _launch_costs(xprof) -> dict:
    """Microseconds one launch of a tiny program takes: called bare (no hook at all); through
    the launch hook with no profiler; inside a CPU+TPU window; inside one writing an XProf run.
    Best of many short loops, so a loaded box disturbs it little."""
    fn = jax.jit(lambda a: a + 1)
    a = jnp.ones(4)
    fn(a).block_until_ready()

    def one() -> None:
        observe = HOOKS.launch_observer
        if observe is not None:
            observe(None, fn, (a,))
        else:
            fn(a)

    def bare() -> None:
        fn(a)

    costs = {"bare": min(timeit.repeat(bare, number=200, repeat=400)) / 200 * 1e6}
    for name, config in (("off", None), ("CPU+TPU", None), ("+XProf", xprof)):
        window = session.Window(config) if name != "off" else None
        if window is not None:
            window.start()
        try:
            costs[name] = min(timeit.repeat(one, number=200, repeat=400)) / 200 * 1e6
        finally:
            if window is not None:
                window.stop()
    jax.effects_barrier()
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args()
    if args.clock == "cpu":
        CLOCK[0] = time.process_time
    warnings.simplefilter("ignore", UserWarning)
    modes = {
        "Strict": (torch.tpu.EagerMode.DEFER_NEVER, False),
        "DeferAndFuse": (torch.tpu.EagerMode.DEFER_AND_FUSE, False),
        "torch.compile": (torch.tpu.EagerMode.DEFER_NEVER, True),
    }
    print(f"TinyGPT {LAYERS} layers, width {WIDTH}, seq {BLOCK}, batch {BATCH}, AdamW; "
          f"best of {args.rounds} rounds of {args.steps} steps ({args.clock} clock); "
          f"platform {torchtpu.runtime.platform.platform()}")
    print(f"{'mode':<15}{'off ms':>8}" + "".join(f"{v + ' ms':>12}{'ratio':>7}" for v in VARIANTS)
          + "".join(f"{v + ' window s':>18}" for v in VARIANTS)
          + f"{'launches/step':>15}{'hook share':>13}")
    with tempfile.TemporaryDirectory() as directory:
        xprof = torch.tpu.profiler.TpuProfilerConfig(run_dir=os.path.join(directory, "xprof"))
        variants = {"CPU only": ([ProfilerActivity.CPU], None), "CPU+TPU": (ACTIVITIES, None),
                    "+XProf": (ACTIVITIES, xprof)}
        costs = _launch_costs(xprof)
        print("one launch of a tiny program: " + ", ".join(
            f"{k} {v:.3f} us" for k, v in costs.items()) + "; the hook costs "
            f"{(costs['off'] - costs['bare']) * 1e3:.0f} ns per launch when off, "
            f"{costs['CPU+TPU'] - costs['off']:.2f} us on, "
            f"{costs['+XProf'] - costs['off']:.2f} us with XProf")
        # The hook's share of a step with XProf: launches per step x its cost per launch.
        hook = costs["+XProf"] - costs["off"]
        for name, (mode, compiled) in modes.items():
            with torch.tpu.set_eager_mode(mode):
                steps = _trainer(compiled)
                steps(args.warmup)
                # The profiler's first start, and the launches a step makes.
                per_step = _profiled(steps, 2, ACTIVITIES, None, directory)[2]
                off = []
                on: dict = {v: [] for v in variants}
                fixed: dict = {v: [] for v in variants}
                for _ in range(args.rounds):
                    off.append(steps(args.steps))
                    for v, (activities, config) in variants.items():
                        s, f, _ = _profiled(steps, args.steps, activities, config, directory)
                        on[v].append(s)
                        fixed[v].append(f)
            base = min(off)
            print(f"{name:<15}{base * 1e3:>8.2f}"
                  + "".join(f"{min(on[v]) * 1e3:>12.2f}{min(on[v]) / base:>6.2f}x"
                            for v in variants)
                  + "".join(f"{min(fixed[v]):>18.2f}" for v in variants)
                  + f"{per_step:>15.0f}{per_step * hook / 1e3 / (base * 1e3) * 100:>12.1f}%")


if __name__ == "__main__":
    main()
