"""Strict's host work in one Llama training step, counted and timed, trees side by side.

    python bench/strict_host.py [--layers 12] [--steps 9] [--warm 3] [--profile N]
    python bench/strict_host.py --trees /work/main . [--rounds 3] [--json F]

``torchtpu.testing.llama``'s step (``--small``'s width 64, vocab 256, 2 heads; batch 2 x 32;
autocast bf16, AdamW, clipping), after ``--warm`` steps: the step's launches
(``testing/step_census.py``), its Python calls under cProfile on the calling thread and on
autograd's device thread (from the loss's node to the end of backward: a pre-hook on the loss's
node enables a profiler there and queues its end with the engine), then ``--steps`` steps timed:
the median CPU of the calling thread (forward, clipping, AdamW), of autograd's thread (the loss's
node to backward's end: on XLA:CPU the device's programs it launches run inside it), of the
process, and every step's loss (``repr``, to compare trees to the bit); over the timed steps,
Python's garbage collections by generation, their time a step (``gc.callbacks``) and the objects
frozen at the end (Strict's loop freezes at its steady state: ``eager/frozen.py``; a full
collection comes every ~80-120 steps unfrozen: ``--steps 150`` shows one). ``--profile N``
prints each thread's N functions of most own time.

``--trees A B ...`` runs this script once per tree and round, alternating (A B A B ...), each
with ``PYTHONPATH`` at that tree, and prints every run's figures, each tree's medians and their
ratios to the first tree's, with ``/proc/loadavg`` before and after: on a shared host the medians
of interleaved runs are what can be compared. Counts (launches, Python calls) are load-free.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import time

_TIMED = ("main_cpu_ms", "backward_cpu_ms", "process_cpu_ms", "gc_ms")
_COUNTED = ("launches", "main_calls", "backward_calls")


class _Backward:
    """Around each ``torch.autograd.backward``: autograd's thread's CPU (and, when asked, a
    profiler there) from the loss's node to the end of the backward pass."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.profile: cProfile.Profile | None = None
        self.cpu: list[float] = []
        self._inner = torch.autograd.backward

    def __enter__(self) -> _Backward:
        self.torch.autograd.backward = self._wrapped
        return self

    def __exit__(self, *exc: object) -> None:
        self.torch.autograd.backward = self._inner

    def _wrapped(self, tensors, *args, **kwargs):
        engine = self.torch.autograd.Variable._execution_engine

        def start(grad_outputs):
            started = time.thread_time()
            if self.profile is not None:
                self.profile.enable()

            def end():
                if self.profile is not None:
                    self.profile.disable()
                self.cpu.append(time.thread_time() - started)

            engine.queue_callback(end)

        handle = tensors.grad_fn.register_prehook(start)
        try:
            return self._inner(tensors, *args, **kwargs)
        finally:
            handle.remove()


class _Collections:
    """Python's garbage collections while inside: how many of each generation, and seconds."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.seconds = 0.0
        self._started = 0.0

    def __enter__(self) -> _Collections:
        gc.callbacks.append(self._observe)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._observe)

    def _observe(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._started


def _calls(profile: cProfile.Profile) -> int:
    return sum(row[1] for row in profile.getstats())


def _top(profile: cProfile.Profile, n: int) -> list[str]:
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(n)
    return [line for line in text.getvalue().splitlines() if line.strip()][-n:]


def measure(layers: int, steps: int, warm: int, top: int = 0) -> dict:
    """This tree's figures (see the module's doc)."""
    import torchtpu  # noqa: F401
    from torchtpu.testing.llama import LlamaConfig, seeded_step
    from torchtpu.testing.step_census import census

    config = LlamaConfig(layers=layers, seq=32, vocab=256, dim=64, heads=2, hidden=128)
    _, step, x, y = seeded_step(config, "tpu")
    losses = []
    with _Backward() as backward:
        for _ in range(warm):
            losses.append(step(x, y).item())
        with census() as c:
            losses.append(step(x, y).item())
        # One profiler a thread, each in a step of its own.
        main = cProfile.Profile()
        main.enable()
        loss = step(x, y)
        main.disable()
        losses.append(loss.item())
        back = backward.profile = cProfile.Profile()
        losses.append(step(x, y).item())
        backward.profile = None
        backward.cpu.clear()
        thread, process = [], []
        with _Collections() as collections:
            for _ in range(steps):
                t, p = time.thread_time(), time.process_time()
                loss = step(x, y)
                thread.append(time.thread_time() - t)
                losses.append(loss.item())
                process.append(time.process_time() - p)
        cpu = list(backward.cpu)
    out = {"tree": os.path.dirname(os.path.dirname(os.path.abspath(torchtpu.__file__))),
           "launches": c.launch_count, "launches_by_program": dict(c.launches.most_common(8)),
           "main_calls": _calls(main), "backward_calls": _calls(back),
           "main_cpu_ms": statistics.median(thread) * 1e3,
           "backward_cpu_ms": statistics.median(cpu) * 1e3,
           "process_cpu_ms": statistics.median(process) * 1e3,
           "gc_collections": collections.counts, "gc_ms": collections.seconds / steps * 1e3,
           "frozen_objects": gc.get_freeze_count(),
           "losses": [repr(v) for v in losses]}
    if top:
        out["main_top"], out["backward_top"] = _top(main, top), _top(back, top)
    return out


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def side_by_side(trees: list[str], rounds: int, argv: list[str]) -> dict:
    """Each tree's run ``rounds`` times, alternating; every run and each tree's medians."""
    runs: dict[str, list] = {t: [] for t in trees}
    load = [_load()]
    for _ in range(rounds):
        for tree in trees:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), TORCHTPU_NOTICES="0")
            done = subprocess.run([sys.executable, os.path.abspath(__file__), *argv],
                                  env=env, capture_output=True, text=True, check=True)
            runs[tree].append(json.loads(done.stdout))
    load.append(_load())
    first = trees[0]
    summary = {}
    for tree in trees:
        row = {k: statistics.median(r[k] for r in runs[tree]) for k in _TIMED + _COUNTED}
        row["each"] = {k: [round(r[k], 1) for r in runs[tree]] for k in _TIMED}
        row["losses_equal_first"] = all(r["losses"] == runs[first][0]["losses"]
                                        for r in runs[tree])
        row["ratio"] = {k: row[k] / summary[first][k] for k in _TIMED + _COUNTED
                        } if tree != first else None
        summary[tree] = row
    return {"loadavg": load, "trees": summary, "losses": runs[first][0]["losses"][-3:]}


def main(argv: list | None = None) -> dict:
    p = argparse.ArgumentParser(prog="bench/strict_host.py",
                                description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--warm", type=int, default=3)
    p.add_argument("--profile", type=int, default=0, metavar="N")
    p.add_argument("--trees", nargs="+", default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.trees:
        out = side_by_side(args.trees, args.rounds,
                           ["--layers", str(args.layers), "--steps", str(args.steps),
                            "--warm", str(args.warm)])
    else:
        out = measure(args.layers, args.steps, args.warm, args.profile)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return out


if __name__ == "__main__":
    main()
