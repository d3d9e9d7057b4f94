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

``--modes defer,defer-op-path --rounds 30 --steps 1``: DeferAndFuse's steps with calls replayed
(``eager/defer_replay.py``) and without, alternating in one process (each its own model).

``--modes defer-split,defer-one``: DeferAndFuse's steps split at backward's start (two
programs a step: ``Recorder._split``, the default's; ``defer`` is the process's setting) and
not (one, ``TORCHTPU_DEFER_SPLIT=0``'s), alternating in one process; ``fwd_cpu`` is the
caller's CPU (ms) from the step's start to the split (the forward's recording: the host time
the device cannot overlap), ``split_cpu`` the split's flush (on the autograd thread).

``--calls N`` (after the timed rounds, one more steady step of the first mode): the Python
calls (functions and builtins: ``sys.setprofile``'s call and c_call events, deterministic) of
the step on the caller's thread and backward's (profiled from the loss's node to backward's
end), each charged to the outermost tpu entry it runs under: the dispatcher's entry
(``dispatch.kernel``) or autocast's kernel, by op; ``calls`` holds the totals, the replayed
calls (``eager/defer_replay.py``) and the N entries of most calls (calls, entries, per entry).

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
from torchtpu.device.hooks import HOOKS
from torchtpu.eager import defer, dispatch, fused_program, numbers
from torchtpu.testing.llama import Llama, LlamaConfig, train_step

SPLIT: dict = {}
_STEP_START = [0.0]
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


def _timed_split(main: int, start: list):
    """``Recorder._split`` that notes the caller's CPU at the split (thread ``main``) and the
    split's own CPU, as ``fwd_cpu_ms`` and ``split_cpu_ms``."""
    split = defer.RECORDER._split

    def timed() -> None:
        SPLIT["fwd_cpu"] = _cpu_of([main]) - start[0]
        t = time.thread_time()
        try:
            split()
        finally:
            SPLIT["split_cpu"] = time.thread_time() - t
    return timed


def count_calls(fn, x, y, top: int) -> dict:
    """fn(x, y)'s Python calls on the recording threads, by outermost tpu entry (``--calls``)."""
    import collections
    import sys

    from torchtpu.device import autocast
    from torchtpu.eager import defer_replay

    autocast_run = autocast._kernel(torch.ops.aten.mm.default, "lower").__code__
    entries = {dispatch.kernel.__code__: "kernel ", autocast_run: "autocast "}
    # Autocast's kernel holds the op's bound call (``OpOverload._op``), not the op.
    names = {}
    for name in autocast.LOWER_PRECISION + autocast.FLOAT32 + autocast.WIDEST:
        packet = getattr(torch.ops.aten, name, None)
        for overload in packet.overloads() if packet is not None else ():
            op = getattr(packet, overload)
            names[id(op._op)] = op
    calls, entered = collections.Counter(), collections.Counter()
    state = threading.local()

    def profile(frame, event, arg) -> None:
        if event == "return":
            if getattr(state, "frame", None) is frame:
                state.frame = state.label = None
            return
        label = getattr(state, "label", None)
        if label is None and event == "call" and frame.f_code in entries:
            local = frame.f_locals
            label = state.label = entries[frame.f_code] + str(
                local.get("op") or names.get(id(local.get("call"))))
            state.frame = frame
            entered[label] += 1
        if event in ("call", "c_call"):
            calls[label or "outside tpu entries"] += 1

    backward = torch.autograd.backward

    def traced(tensors, *args, **kwargs):  # backward's thread, from the loss's node on
        engine = torch.autograd.Variable._execution_engine

        def start(_):
            sys.setprofile(profile)
            engine.queue_callback(lambda: sys.setprofile(None))
        handle = tensors.grad_fn.register_prehook(start)
        try:
            return backward(tensors, *args, **kwargs)
        finally:
            handle.remove()

    torch.autograd.backward, replayed = traced, defer_replay.REPLAY.replayed
    sys.setprofile(profile)
    try:
        loss = fn(x, y)
    finally:
        sys.setprofile(None)
        torch.autograd.backward = backward
    out = {"total": sum(calls.values()), "in_tpu_entries": sum(entered.values()),
           "replayed": defer_replay.REPLAY.replayed - replayed, "loss": loss.item()}
    out["top"] = [[n, entered[k], round(n / max(entered[k], 1), 1), k]
                  for k, n in calls.most_common(top)]
    return out


def _step(fn, x, y) -> dict:
    tids = _autograd_threads()
    before = torchtpu.metrics.snapshot()
    SPLIT.clear()
    _STEP_START[0] = _cpu_of([threading.get_native_id()])
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
    p.add_argument("--calls", type=int, default=0, metavar="N")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.split:
        install_split()
    defer.RECORDER._split = _timed_split(threading.get_native_id(), _STEP_START)
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
        calls[mode] = (torch.tpu.EagerMode.DEFER_AND_FUSE if mode.startswith("defer")
                       else torch.tpu.EagerMode.DEFER_NEVER,
                       torch.compile(step, backend="tpu") if mode == "whole" else step)

    def rows(mode: str, n: int) -> list:
        eager, fn = calls[mode]
        with torch.tpu.set_eager_mode(eager):
            replay = HOOKS.replay
            if mode == "defer-op-path":  # every call through the op path, none replayed
                HOOKS.replay = None
            if mode in ("defer-one", "defer-split"):  # split at backward's start or not
                defer.RECORDER.split_min_ops = float("inf") if mode == "defer-one" \
                    else defer.SPLIT_CALLS
            try:
                return [_step(fn, x, y) for _ in range(n)]
            finally:
                HOOKS.replay = replay
                defer.RECORDER.split_min_ops = defer.SPLIT_MIN_OPS

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
    if a.calls:
        eager, fn = calls[modes[0]]
        with torch.tpu.set_eager_mode(eager):
            out["calls"] = count_calls(fn, x, y, a.calls)
        print("calls", json.dumps(out["calls"]), flush=True)
    print("load", out["load_before"], "->", out["load_after"], flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
