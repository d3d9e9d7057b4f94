"""What torch.profiler with ProfilerActivity.TPU costs a small GPT training step, side by side.

One process, TinyGPT (2 layers, width 64, sequence 32, batch 8, AdamW with clipping), in Strict,
DeferAndFuse and torch.compile. Per mode, after warmup, rounds of: N steps unprofiled; N steps
inside ``profile(activities=[CPU, TPU])``; N steps inside the same with
``TpuProfilerConfig`` (an XProf run written to a temporary directory). The step time is taken
inside the window; the window's fixed cost (start, stop, reading the device trace and exporting
the Chrome trace) is given apart. Best round of each.

    python bench/profiler_overhead.py [--steps 10] [--rounds 3] [--warmup 3]
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


def _trainer(compiled: bool):
    torch.manual_seed(0)
    data = torch.randint(VOCAB, (4096,), generator=torch.Generator().manual_seed(1))
    model = TinyGPT(VOCAB, BLOCK, n_layer=LAYERS, n_head=HEADS, n_embd=WIDTH).to("tpu")
    run = torch.compile(model, backend="tpu") if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)

    def steps(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            x, y = batch(data, BATCH, BLOCK, gen)
            _, loss = run(x.to("tpu"), y.to("tpu"))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            loss.item()
        return (time.perf_counter() - start) / n

    return steps


def _profiled(steps, n: int, config, directory: str) -> tuple[float, float]:
    """(seconds per step inside the window, the window's fixed seconds)."""
    start = time.perf_counter()
    with profile(activities=ACTIVITIES, experimental_config=config) as prof:
        per_step = steps(n)
    prof.export_chrome_trace(os.path.join(directory, "trace.json"))
    return per_step, time.perf_counter() - start - per_step * n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    modes = {
        "Strict": (torch.tpu.EagerMode.DEFER_NEVER, False),
        "DeferAndFuse": (torch.tpu.EagerMode.DEFER_AND_FUSE, False),
        "torch.compile": (torch.tpu.EagerMode.DEFER_NEVER, True),
    }
    print(f"TinyGPT {LAYERS} layers, width {WIDTH}, seq {BLOCK}, batch {BATCH}, AdamW; "
          f"best of {args.rounds} rounds of {args.steps} steps; "
          f"platform {torchtpu.runtime.platform.platform()}")
    print(f"{'mode':<15}{'off ms':>8}{'TPU ms':>8}{'ratio':>7}{'+XProf ms':>10}{'ratio':>7}"
          f"{'window s':>10}{'+XProf s':>10}")
    with tempfile.TemporaryDirectory() as directory:
        xprof = torch.tpu.profiler.TpuProfilerConfig(run_dir=os.path.join(directory, "xprof"))
        for name, (mode, compiled) in modes.items():
            with torch.tpu.set_eager_mode(mode):
                steps = _trainer(compiled)
                steps(args.warmup)
                _profiled(steps, 1, None, directory)  # the profiler's own first start
                off, on, on_x, fixed, fixed_x = [], [], [], [], []
                for _ in range(args.rounds):
                    off.append(steps(args.steps))
                    s, f = _profiled(steps, args.steps, None, directory)
                    on.append(s)
                    fixed.append(f)
                    s, f = _profiled(steps, args.steps, xprof, directory)
                    on_x.append(s)
                    fixed_x.append(f)
            base = min(off)
            print(f"{name:<15}{base * 1e3:>8.2f}{min(on) * 1e3:>8.2f}{min(on) / base:>6.2f}x"
                  f"{min(on_x) * 1e3:>10.2f}{min(on_x) / base:>6.2f}x"
                  f"{min(fixed):>10.2f}{min(fixed_x):>10.2f}")


if __name__ == "__main__":
    main()
