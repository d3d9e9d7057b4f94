"""DeferAndFuse's host time per steady step, split, beside the whole compiled step's (issue 35).

    python bench/defer_host.py [--layers 2] [--batch 1] [--seq 16] [--small] [--rounds 4]
        [--steps 3] [--modes defer,whole] [--split] [--json out.json]

``torchtpu.testing.llama``'s training step (real widths unless ``--small``) in DeferAndFuse and as
one ``torch.compile(step, backend="tpu")`` program, each mode its own model, interleaved rounds
after a warm-up. Every step ends with ``loss.item()``, so the device is idle while the next step
records and the host figures are the host's alone. Per step: ``host_cpu_ms``, the CPU time of the
threads that record (the caller's thread and PyTorch's autograd threads, which run backward)
inside the step call; ``read_cpu_ms``, the caller's CPU inside ``.item()`` (DeferAndFuse's flush;
the wait is not CPU); wall times; recorded ops; programs loaded and run; Python's garbage
collections inside the step call (``gc_ms``, ``gc_full``: full ones), and over the timed steps
the mean host CPU and the full collections' count (a full one falls in one step of ~10-30).
Thread CPU leaves out XLA:CPU's compute threads, so it carries over to a host that drives a TPU
(where launching costs more; the recording launches nothing).

``--split`` (rounds of its own: its wrappers cost ~1 us a call) adds thread CPU inside torchtpu's
op path (``dispatch.kernel``, outermost calls), its functional and in-place handlers, the
recorder's ``record``, and the flush's parts (live outputs, inputs committed, numbers, donations,
the program's key hashed and looked up, the launch); what is left of ``host_cpu_ms`` is
PyTorch's own (autograd, modules, autocast, the optimizer's Python).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import threading
import time

import torch

import torchtpu
from torchtpu.device import launch
from torchtpu.eager import defer, dispatch, fused_program, numbers
from torchtpu.testing.llama import Llama, LlamaConfig, train_step

SPLIT: dict = {}
_depth = threading.local()


def _timed(name: str, fn):
    """fn, adding the calling thread's CPU inside its outermost calls to SPLIT[name]."""

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        if getattr(_depth, name, 0):
            return fn(*args, **kwargs)
        setattr(_depth, name, 1)
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            SPLIT[name] = SPLIT.get(name, 0.0) + time.thread_time() - start
            setattr(_depth, name, 0)

    # The eager call-site families (compile/call_sites.py) take a frame outside torchtpu for
    # the user's line: this wrapper's frame is torchtpu's own.
    timed.__code__ = timed.__code__.replace(co_filename=dispatch.__file__)
    return timed


class _TimedPrograms(dict):
    """The recorder's program cache, its lookups timed: the key's hash, then hash and compare."""

    def get(self, key, default=None):
        start = time.thread_time()
        hash(key)
        hashed = time.thread_time()
        try:
            return dict.get(self, key, default)
        finally:
            SPLIT["flush.key_hash"] = SPLIT.get("flush.key_hash", 0.0) + hashed - start
            SPLIT["flush.key_lookup"] = SPLIT.get("flush.key_lookup", 0.0) + \
                time.thread_time() - hashed


def install_split() -> None:
    """Wrap the parts; before the first tpu op (op kernels are registered then)."""
    dispatch.kernel = _timed("op_path", dispatch.kernel)
    for name in ("_functional_handler", "_mutating_handler"):
        make = getattr(dispatch, name)
        setattr(dispatch, name, functools.partial(
            lambda make, label, *a, **k: _timed(label, make(*a, **k)), make, "op_path." + name[1:]))
    R = defer.Recorder
    R.record = _timed("op_path.record", R.record)
    R.flush = _timed("flush", R.flush)
    R._alive = _timed("flush.alive", R._alive)
    fused_program.committed = _timed("flush.committed", fused_program.committed)
    fused_program.donatable = _timed("flush.donatable", fused_program.donatable)
    numbers.cached = _timed("flush.numbers", numbers.cached)
    launch.run = _timed("launch", launch.run)
    defer.RECORDER._programs = _TimedPrograms(defer.RECORDER._programs)


def _autograd_threads() -> list:
    found = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("pt_autograd"):
                    found.append(int(tid))
        except OSError:
            pass
    return found


def thread_cpu(tid: int) -> float:
    """Seconds of CPU thread ``tid`` of this process has run, from its kernel CPU clock (Linux's
    thread clock id for a thread id: CPUCLOCK_SCHED | CPUCLOCK_PERTHREAD). gVisor, which the
    chip host runs, serves these clocks (in 10 ms ticks) but has no ``/proc/<tid>/schedstat``,
    which this read before: there the autograd thread's CPU read as 0, half a step's."""
    return time.clock_gettime((~tid << 3) | 6)


def _cpu_of(tids: list) -> float:
    total = 0.0
    for tid in tids:
        try:
            total += thread_cpu(tid)
        except OSError:  # the thread ended since it was listed
            pass
    return total


class GcClock:
    """Python's garbage collections inside a block: how many of each generation and their time.
    A full (generation 2) collection walks every object the process holds (~500k after a
    step compiled): ~0.15-0.25 s, once in ~10-20 DeferAndFuse steps, in whichever step it
    falls."""

    def __enter__(self) -> GcClock:
        self.counts, self.ms, self._start = [0, 0, 0], 0.0, None
        gc.callbacks.append(self._observe)
        return self

    def _observe(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.counts[info["generation"]] += 1
            self.ms += (time.perf_counter() - self._start) * 1e3

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._observe)


def _step(fn, x, y) -> dict:
    tids = _autograd_threads()
    before = torchtpu.metrics.snapshot()
    SPLIT.clear()
    with GcClock() as collected:
        w0, c0, a0 = time.perf_counter(), time.thread_time(), _cpu_of(tids)
        loss = fn(x, y)
        w1, c1, a1 = time.perf_counter(), time.thread_time(), _cpu_of(_autograd_threads())
    loss.item()
    w2, c2 = time.perf_counter(), time.thread_time()
    after = torchtpu.metrics.snapshot()
    row = {"host_cpu_ms": (c1 - c0 + a1 - a0) * 1e3, "main_cpu_ms": (c1 - c0) * 1e3,
           "autograd_cpu_ms": (a1 - a0) * 1e3, "call_ms": (w1 - w0) * 1e3,
           "read_cpu_ms": (c2 - c1) * 1e3, "read_ms": (w2 - w1) * 1e3,
           "gc_ms": collected.ms, "gc_full": collected.counts[2]}
    for k in ("deferred_ops", "executions"):
        row[k] = after.get(k, 0) - before.get(k, 0)
    row["loads"] = sum(after.get(k, 0) - before.get(k, 0)
                       for k in ("executable_compiles", "persistent_cache_hits"))
    return row | {k: v * 1e3 for k, v in SPLIT.items()}


def main(argv: list | None = None) -> dict:
    p = argparse.ArgumentParser(prog="bench/defer_host.py", description=__doc__.splitlines()[0])
    for name, default in (("layers", 2), ("batch", 1), ("seq", 16), ("rounds", 4),
                          ("steps", 3), ("warmup", 3)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--small", action="store_true", help="width 64, vocab 256 (host cost alone)")
    p.add_argument("--modes", default="defer,whole")
    p.add_argument("--split", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.split:
        install_split()
    dims = dict(vocab=256, dim=64, heads=2, hidden=128) if a.small else {}
    c = LlamaConfig(layers=a.layers, seq=a.seq, **dims)
    ids = torch.randint(c.vocab, (a.batch, a.seq + 1), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1].contiguous().to("tpu"), ids[:, 1:].contiguous().to("tpu")
    modes, calls = a.modes.split(","), {}
    for mode in modes:
        torch.manual_seed(0)
        with torch.device("tpu"):
            model = Llama(c)
        step, _ = train_step(model)
        calls[mode] = (torch.tpu.EagerMode.DEFER_AND_FUSE if mode == "defer"
                       else torch.tpu.EagerMode.DEFER_NEVER,
                       torch.compile(step, backend="tpu") if mode == "whole" else step)

    def rows(mode: str, n: int) -> list:
        eager, fn = calls[mode]
        with torch.tpu.set_eager_mode(eager):
            return [_step(fn, x, y) for _ in range(n)]

    out: dict = {"config": vars(a), "load_before": os.getloadavg()}
    for mode in modes:
        start = time.perf_counter()
        out[mode] = {"warmup": rows(mode, a.warmup), "warmup_s": time.perf_counter() - start}
    timed: dict = {m: [] for m in modes}
    for _ in range(a.rounds):
        for mode in modes:
            timed[mode] += rows(mode, a.steps)
    out["load_after"] = os.getloadavg()
    for mode in modes:
        keys = sorted({k for r in timed[mode] for k in r})
        med = {k: round(statistics.median(r.get(k, 0.0) for r in timed[mode]), 3) for k in keys}
        if med.get("deferred_ops"):
            med["host_us_per_op"] = round(med["host_cpu_ms"] * 1e3 / med["deferred_ops"], 1)
            med["with_flush_us_per_op"] = round(
                (med["host_cpu_ms"] + med["read_cpu_ms"]) * 1e3 / med["deferred_ops"], 1)
        # A full garbage collection falls in one step of many: the mean carries its share.
        med["mean_host_cpu_ms"] = round(statistics.mean(r["host_cpu_ms"] for r in timed[mode]), 3)
        med["gc_full_total"] = sum(r["gc_full"] for r in timed[mode])
        out[mode]["median"], out[mode]["steps"] = med, timed[mode]
        print(mode, json.dumps(med), flush=True)
    print("load", out["load_before"], "->", out["load_after"], flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
