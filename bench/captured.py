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

The runs take turns in rounds of ``--steps`` steps, so that the load of the shared box weighs on
all of them alike; each row gives its best and its median round.

    python bench/captured.py [--rounds 6] [--steps 10] [--warmup 4]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time

import jax
import jax.numpy as jnp
import torch

import torchtpu

_spec = importlib.util.spec_from_file_location(
    "bench_compile", os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile.py"))
cb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cb)


def _optimizer(model, capturable: bool = True):
    return torch.optim.AdamW(model.parameters(), lr=cb.LR, betas=cb.BETAS, eps=cb.EPS,
                             weight_decay=cb.WD, capturable=capturable)


class _Eager:
    """A training step function run on a model and optimizer of its own."""

    def __init__(self, step, capturable: bool = True) -> None:
        self.model = cb._model().to("tpu")
        self.opt = _optimizer(self.model, capturable)
        self.step = step

    def __call__(self, x, y) -> float:
        return self.step(self.model, self.opt, x.to("tpu"), y.to("tpu")).item()


class _Graph:
    """Warm-up steps, one ``torch.tpu.graph`` capture, then ``copy_`` + ``g.replay()``."""

    def __init__(self, warmup_batches: list) -> None:
        self.model = cb._model().to("tpu")
        self.opt = _optimizer(self.model)
        self.x, self.y = (t.to("tpu") for t in warmup_batches[0])
        self.warmup = list(warmup_batches)
        self.g = None
        self.capture_seconds = 0.0

    def __call__(self, x, y) -> float:
        self.x.copy_(x)
        self.y.copy_(y)
        if self.warmup:
            self.warmup.pop()
            return cb._step(self.model, self.opt, self.x, self.y).item()
        if self.g is None:
            began = time.perf_counter()
            self.g = torch.tpu.TPUGraph()
            self.opt.zero_grad(set_to_none=True)
            with torch.tpu.graph(self.g):
                _, self.loss = self.model(self.x, self.y)
                self.loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cb.MAX_NORM)
                self.opt.step()
            self.capture_seconds = time.perf_counter() - began
        self.g.replay()
        return self.loss.item()


class _Jax:
    """The same step in one ``jax.jit`` (``bench/compile.py``)."""

    def __init__(self) -> None:
        self.p = cb._jax_params(cb._model())
        self.m = jax.tree.map(jnp.zeros_like, self.p)
        self.v = jax.tree.map(jnp.zeros_like, self.p)
        self.count = jnp.zeros((), jnp.float32)
        self.step = jax.jit(cb._jax_step, donate_argnums=(0, 1, 2))

    def __call__(self, x, y) -> float:
        self.p, self.m, self.v, self.count, loss = self.step(
            self.p, self.m, self.v, self.count, jnp.asarray(x.numpy()), jnp.asarray(y.numpy()))
        return float(loss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10, help="steps per round")
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args()
    batches = cb._batches(args.warmup + args.rounds * args.steps)
    warm, timed = batches[:args.warmup], batches[args.warmup:]
    runs = {
        "captured (TPUGraph)": _Graph(warm),
        "whole-step compile": _Eager(torch.compile(cb._step, backend="tpu")),
        "whole-step, default AdamW": _Eager(torch.compile(cb._step, backend="tpu"),
                                            capturable=False),
        "compile, Dynamo graphs": _Eager(torch.compile(cb._step, backend="tpu",
                                                       options={"whole_step": False})),
        "compile reduce-overhead": _Eager(torch.compile(cb._step, backend="tpu",
                                                        mode="reduce-overhead")),
        "tpu Strict eager": _Eager(cb._step),
        "jax.jit, same step": _Jax(),
    }
    losses = {name: [run(x, y) for x, y in warm] for name, run in runs.items()}
    seconds: dict = {name: [] for name in runs}
    # Rounds interleave the runs, so that a change of load on the shared box hits all of them.
    for r in range(args.rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            losses[name] += [run(x, y) for x, y in timed[r * args.steps:(r + 1) * args.steps]]
            seconds[name].append((time.perf_counter() - start) / args.steps)
    # The first round holds the captured runs' first replays (their compiles): not counted.
    best = {name: min(s[1:]) for name, s in seconds.items()}
    median = {name: statistics.median(s[1:]) for name, s in seconds.items()}
    strict, direct = "tpu Strict eager", "jax.jit, same step"
    print(f"TinyGPT {cb.LAYERS} layers, width {cb.WIDTH}, seq {cb.BLOCK}, batch {cb.BATCH}, "
          f"AdamW(capturable=True) + clipping; {args.rounds - 1} timed rounds of {args.steps} "
          f"steps after {args.warmup} warm-up steps and one round; platform "
          f"{torchtpu.runtime.platform.platform()}; load {os.getloadavg()[0]:.2f}")
    print(f"{'run':<28}{'best ms':>9}{'median':>8}{'vs Strict':>11}{'vs JAX':>8}"
          f"{'median vs JAX':>15}")
    for name in runs:
        print(f"{name:<28}{best[name] * 1e3:>9.2f}{median[name] * 1e3:>8.2f}"
              f"{best[strict] / best[name]:>10.2f}x{best[direct] / best[name]:>7.2f}x"
              f"{median[direct] / median[name]:>14.2f}x")
    print(f"capture took {runs['captured (TPUGraph)'].capture_seconds * 1e3:.0f} ms (recording "
          "only: nothing runs)")
    for name in runs:
        if name != direct:
            diff = max(abs(a - b) for a, b in zip(losses[name], losses[direct], strict=True))
            print(f"max |loss difference| {name} vs JAX over {len(batches)} steps: {diff:.2e}")


if __name__ == "__main__":
    main()
