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
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

import torchtpu  # noqa: F401
from torchtpu.testing.models import TinyGPT, batch

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


def _profiled(steps, n: int, activities, config, directory: str) -> tuple[float, float]:
    """(seconds per step inside the window, the window's fixed seconds)."""
    start = CLOCK[0]()
    with profile(activities=activities, experimental_config=config) as prof:
        per_step = steps(n)
    prof.export_chrome_trace(os.path.join(directory, "trace.json"))
    return per_step, CLOCK[0]() - start - per_step * n


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
          + "".join(f"{v + ' window s':>18}" for v in VARIANTS))
    with tempfile.TemporaryDirectory() as directory:
        xprof = torch.tpu.profiler.TpuProfilerConfig(run_dir=os.path.join(directory, "xprof"))
        variants = {"CPU only": ([ProfilerActivity.CPU], None), "CPU+TPU": (ACTIVITIES, None),
                    "+XProf": (ACTIVITIES, xprof)}
        for name, (mode, compiled) in modes.items():
            with torch.tpu.set_eager_mode(mode):
                steps = _trainer(compiled)
                steps(args.warmup)
                _profiled(steps, 1, ACTIVITIES, None, directory)  # the profiler's first start
                off = []
                on: dict = {v: [] for v in variants}
                fixed: dict = {v: [] for v in variants}
                for _ in range(args.rounds):
                    off.append(steps(args.steps))
                    for v, (activities, config) in variants.items():
                        s, f = _profiled(steps, args.steps, activities, config, directory)
                        on[v].append(s)
                        fixed[v].append(f)
            base = min(off)
            print(f"{name:<15}{base * 1e3:>8.2f}"
                  + "".join(f"{min(on[v]) * 1e3:>12.2f}{min(on[v]) / base:>6.2f}x"
                            for v in variants)
                  + "".join(f"{min(fixed[v]):>18.2f}" for v in variants))


if __name__ == "__main__":
    main()
