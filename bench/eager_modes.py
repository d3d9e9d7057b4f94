"""Training-step throughput of a small GPT: Strict, Debug, DeferAndFuse and CPU eager, side by side.

One process, one model recipe (TinyGPT: 2 layers, width 64, sequence 32, batch 8, AdamW with
clipping), the same batches everywhere. Each run warms up, then times steps; the table gives
steps per second, each mode's ratio to Strict and to CPU, and the programs compiled after step 3.

    python bench/eager_modes.py [--steps 20] [--warmup 4]
"""

from __future__ import annotations

import argparse
import time

import torch

import torchtpu
from torchtpu.demo.gpt import TinyGPT, train_steps

VOCAB, BLOCK, WIDTH, LAYERS, HEADS, BATCH = 96, 32, 64, 2, 2, 8


def _measure(device: str, mode, steps: int, warmup: int) -> tuple[float, int, list]:
    """(seconds per step after warmup, compiles after step 3, losses)."""
    torch.manual_seed(0)
    data = torch.randint(VOCAB, (4096,), generator=torch.Generator().manual_seed(1))
    model = TinyGPT(VOCAB, BLOCK, n_layer=LAYERS, n_head=HEADS, n_embd=WIDTH).to(device)
    marks: dict = {}

    def on_step(step: int, loss: float) -> None:
        if step == 2:
            marks["compiles"] = torchtpu.metrics.snapshot()["executable_compiles"]
        if step == warmup - 1:
            marks["start"] = time.perf_counter()

    context = torch.tpu.set_eager_mode(mode) if mode is not None else _nothing()
    with context:
        losses = train_steps(model, data, warmup + steps, device, batch_size=BATCH,
                             on_step=on_step)
        elapsed = time.perf_counter() - marks["start"]
    compiles = torchtpu.metrics.snapshot()["executable_compiles"] - marks["compiles"]
    return elapsed / steps, compiles, losses


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args()
    runs = {
        "cpu eager": ("cpu", None),
        "tpu Strict": ("tpu", torch.tpu.EagerMode.DEFER_NEVER),
        "tpu Debug": ("tpu", torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING),
        "tpu DeferAndFuse": ("tpu", torch.tpu.EagerMode.DEFER_AND_FUSE),
    }
    results = {name: _measure(dev, mode, args.steps, args.warmup)
               for name, (dev, mode) in runs.items()}
    strict, cpu = results["tpu Strict"][0], results["cpu eager"][0]
    print(f"TinyGPT {LAYERS} layers, width {WIDTH}, seq {BLOCK}, batch {BATCH}, AdamW; "
          f"{args.steps} timed steps after {args.warmup} warmup; "
          f"platform {torchtpu.runtime.platform.platform()}")
    print(f"{'run':<18}{'ms/step':>9}{'steps/s':>9}{'vs Strict':>11}{'vs CPU':>8}"
          f"{'compiles after step 3':>23}{'last loss':>11}")
    for name, (sec, compiles, losses) in results.items():
        print(f"{name:<18}{sec * 1e3:>9.2f}{1 / sec:>9.1f}{strict / sec:>10.2f}x"
              f"{cpu / sec:>7.2f}x{compiles if name != 'cpu eager' else '-':>23}"
              f"{losses[-1]:>11.4f}")


if __name__ == "__main__":
    main()
