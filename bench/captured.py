"""Captured steps (torch.tpu.TPUGraph) against Strict eager, torch.compile and jax.jit.

The TinyGPT training step of ``bench/compile.py`` (2 layers, width 64, sequence 32, batch 8,
AdamW with clipping; same weights and batches), run seven ways in one process: Strict eager, the
whole step under ``torch.compile(backend="tpu")`` (one captured program per call,
``compile/whole_step.py``) with ``AdamW(capturable=True)`` and with the default AdamW, the same
compile as Dynamo's graphs (``options={"whole_step": False}``) and in
``mode="reduce-overhead"``, the step captured once with ``torch.tpu.graph`` and replayed
(``static_x.copy_(x)``, ``g.replay()``, read ``static_loss``: the pattern of PyTorch's CUDA Graphs
notes), and the same step in one ``jax.jit``. The torch runs use ``AdamW(capturable=True)``
unless said otherwise, so that they run the same optimizer.

    python bench/captured.py [--steps 20] [--warmup 4]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time

import torch

import torchtpu

_spec = importlib.util.spec_from_file_location(
    "bench_compile", os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile.py"))
cb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cb)


def _optimizer(model, capturable: bool = True):
    return torch.optim.AdamW(model.parameters(), lr=cb.LR, betas=cb.BETAS, eps=cb.EPS,
                             weight_decay=cb.WD, capturable=capturable)


def _eager_run(step, batches, warmup: int, capturable: bool = True) -> tuple[float, list]:
    model = cb._model().to("tpu")
    opt = _optimizer(model, capturable)
    losses = []
    for i, (x, y) in enumerate(batches):
        if i == warmup:
            start = time.perf_counter()
        losses.append(step(model, opt, x.to("tpu"), y.to("tpu")).item())
    return (time.perf_counter() - start) / (len(batches) - warmup), losses


def _captured_run(batches, warmup: int) -> tuple[float, list, float]:
    """(seconds per replayed step, losses, capture seconds)."""
    model = cb._model().to("tpu")
    opt = _optimizer(model)
    static_x, static_y = (t.to("tpu") for t in batches[0])
    losses = []
    for x, y in batches[:warmup]:
        static_x.copy_(x)
        static_y.copy_(y)
        losses.append(cb._step(model, opt, static_x, static_y).item())
    began = time.perf_counter()
    g = torch.tpu.TPUGraph()
    opt.zero_grad(set_to_none=True)
    with torch.tpu.graph(g):
        _, static_loss = model(static_x, static_y)
        static_loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cb.MAX_NORM)
        opt.step()
    capture = time.perf_counter() - began
    for i, (x, y) in enumerate(batches[warmup:]):
        if i == 1:  # the first replay compiles the program
            start = time.perf_counter()
        static_x.copy_(x)
        static_y.copy_(y)
        g.replay()
        losses.append(static_loss.item())
    return (time.perf_counter() - start) / (len(batches) - warmup - 1), losses, capture


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args()
    batches = cb._batches(args.warmup + args.steps + 1)
    captured, g_losses, capture = _captured_run(batches, args.warmup)
    whole, w_losses = _eager_run(torch.compile(cb._step, backend="tpu"), batches, args.warmup)
    default, d_losses = _eager_run(torch.compile(cb._step, backend="tpu"), batches, args.warmup,
                                   capturable=False)
    compiled, c_losses = _eager_run(
        torch.compile(cb._step, backend="tpu", options={"whole_step": False}), batches,
        args.warmup)
    torch._dynamo.reset()
    reduced, r_losses = _eager_run(torch.compile(cb._step, backend="tpu", mode="reduce-overhead"),
                                   batches, args.warmup)
    strict, s_losses = _eager_run(cb._step, batches, args.warmup)
    direct, j_losses = cb._jax_run(batches, args.warmup)
    print(f"TinyGPT {cb.LAYERS} layers, width {cb.WIDTH}, seq {cb.BLOCK}, batch {cb.BATCH}, "
          f"AdamW(capturable=True) + clipping; {args.steps} timed steps after {args.warmup} "
          f"warmup; platform {torchtpu.runtime.platform.platform()}; load "
          f"{os.getloadavg()[0]:.2f}")
    print(f"{'run':<28}{'ms/step':>9}{'vs Strict':>11}{'vs JAX':>8}{'last loss':>11}")
    for name, sec, losses in (("captured (TPUGraph)", captured, g_losses),
                              ("whole-step compile", whole, w_losses),
                              ("whole-step, default AdamW", default, d_losses),
                              ("compile, Dynamo graphs", compiled, c_losses),
                              ("compile reduce-overhead", reduced, r_losses),
                              ("tpu Strict eager", strict, s_losses),
                              ("jax.jit, same step", direct, j_losses)):
        print(f"{name:<28}{sec * 1e3:>9.2f}{strict / sec:>10.2f}x{direct / sec:>7.2f}x"
              f"{losses[-1]:>11.4f}")
    print(f"capture took {capture * 1e3:.0f} ms (recording only: nothing runs)")
    for name, losses in (("captured", g_losses), ("whole-step", w_losses),
                         ("whole-step default AdamW", d_losses), ("reduce-overhead", r_losses),
                         ("Strict", s_losses)):
        diff = max(abs(a - b) for a, b in zip(losses, j_losses, strict=True))
        print(f"max |loss difference| {name} vs JAX over {len(batches)} steps: {diff:.2e}")


if __name__ == "__main__":
    main()
