"""DeferAndFuse on the chip: where a Llama step's time goes, step by step (issue 35 point 2).

    TORCHTPU_PLATFORM=tpu python bench/defer_chip.py [--layers 12] [--batch 8] [--seq 1024]
        [--warmup 3] [--steps 5] [--out DIR]
    python bench/defer_chip.py --small          # a check on CPU at tiny dims

``torchtpu.testing.llama``'s training step (autocast bf16, clipping, AdamW) under DeferAndFuse, in
the phases ``bench/on_tpu_llama.py``'s row runs, one line per step:

- ``warmup``: ``step(x, y).item()`` (the recording ends at the read);
- ``free``: steps without a read (the timed rounds': each step's first op flushes the step
  before, whose program runs while the host records), one read after the last;
- ``synced``: ``step(x, y)`` then ``torch.tpu.synchronize()`` per step: the flush and the device's
  time apart from the recording's.

Per step: ``record_ms`` (inside the step call, the previous step's flush included in ``free``),
``record_cpu_ms`` (the recording threads' CPU inside the step call: the caller's and PyTorch's
autograd threads', which run backward, from their kernel thread clocks, in 10 ms ticks on the
chip host's gVisor; what the host spends recording, apart from any wait or from another process
on its cores), ``gc_ms`` and ``gc_full`` (Python's garbage collections inside the step call: their
time, and how many were full ones) and ``us_per_op`` (that per op the step's flush ran: the
step's own in steady state), ``overlapped`` (``free`` only: whether the step before was still
running on the device when this step's recording ended, i.e. the host recorded while the device
computed),
``flush_ms`` (inside the recorder's flushes), ``launch_ms`` (inside the fused programs' jitted
calls: their trace and compile when new, else the dispatch), ``wait_ms`` (after the step: the
read or synchronize, less the flush in it), the counters' deltas (compiles, persistent-cache
hits, compile seconds, executions, recorded ops, bytes to and from the host, numbers crossing)
and, for each fused program built in the step, how its key differs from the nearest program
built before (ops, where the recorded calls first differ, outputs kept alive, donations): a
program built in a steady step is what a multi-second step on the chip would be. ``host``: the
synced steps' medians (recording CPU, per op, the device's time after the recording) and the step
they make for a loop reading each step's loss (recording + flush + device) and for one reading
none (the larger of the two, overlapped). ``clock``: the process's threads, the time to list them
(outside the step's clocks) and a busy loop's thread CPU over its wall, to read the CPU figures
by. Then one steady step profiled: the device's busy
time and its longest programs and ops. Writes ``defer_chip.json`` under ``--out`` (default
``$OUT``, else the working directory) after each phase.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import jax
import torch

import torchtpu
from torchtpu.device import tensors
from torchtpu.device.hooks import HOOKS
from torchtpu.eager import defer
from torchtpu.runtime import platform
from torchtpu.testing.llama import Llama, LlamaConfig, train_step

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import defer_host  # noqa: E402  (bench/ is no package)
import on_tpu_llama  # noqa: E402
import strict_chip  # noqa: E402

COUNTERS = ("executable_compiles", "persistent_cache_hits", "compile_seconds", "executions",
            "deferred_ops", "host_to_device_bytes", "device_to_host_bytes", "number_transfers",
            "donated_inputs", "reused_buffers")


def _counters() -> dict:
    snap = torchtpu.metrics.snapshot()
    return {k: snap.get(k, 0) for k in COUNTERS}


class Timers:
    """Time inside the recorder's flushes and inside the fused programs' launches."""

    def __init__(self) -> None:
        self.flush = self.launch = 0.0

    def __enter__(self) -> Timers:
        flush, previous = defer.RECORDER.flush, HOOKS.launch_observer

        def timed_flush() -> None:
            start = time.perf_counter()
            try:
                flush()
            finally:
                self.flush += time.perf_counter() - start

        def observe(label, fn, args):
            start = time.perf_counter()
            try:
                return fn(*args) if previous is None else previous(label, fn, args)
            finally:
                if str(label).startswith("defer_and_fuse"):
                    self.launch += time.perf_counter() - start

        self._previous = previous
        defer.RECORDER.flush = timed_flush  # the recorder calls self.flush(): this one
        HOOKS.launch_observer = observe
        return self

    def __exit__(self, *exc) -> None:
        del defer.RECORDER.flush
        HOOKS.launch_observer = self._previous

    def take(self) -> tuple[float, float]:
        out = (self.flush * 1e3, self.launch * 1e3)
        self.flush = self.launch = 0.0
        return out


def _name(fn) -> str:
    return str(getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", fn))


def key_difference(new: tuple, old: list) -> dict:
    """How a fused program's key (nodes, wanted outputs, donated inputs) differs from the nearest
    earlier one (the most recorded calls in common from the start)."""
    nodes, wanted, donate = new
    out = {"ops": len(nodes), "alive": len(wanted), "donated": len(donate)}
    if not old:
        return out | {"first": True}

    def common(k) -> int:
        n = 0
        for a, b in zip(k[0], nodes):
            if a != b:
                break
            n += 1
        return n

    best = max(old, key=common)
    same = common(best)
    out["nearest_ops"] = len(best[0])
    if same < min(len(best[0]), len(nodes)):
        a, b = best[0][same], nodes[same]
        out["first_different_call"] = {"at": same, "was": [_name(a[0]), str(a[2])[:200]],
                                       "now": [_name(b[0]), str(b[2])[:200]]}
    elif len(best[0]) != len(nodes):
        out["calls"] = f"one is a prefix of the other ({same} in common)"
    else:
        out["calls"] = "same"
        old_w, new_w = set(best[1]), set(wanted)
        out["alive_only_now"] = sorted(new_w - old_w)[:20]
        out["alive_only_before"] = sorted(old_w - new_w)[:20]
        out["donated_only_now"] = sorted(set(donate) - set(best[2]))[:20]
        out["donated_only_before"] = sorted(set(best[2]) - set(donate))[:20]
    return out


class HostClock:
    """A step's wall (``wall_ms``) and the CPU time of the threads that record it (``ms``): the
    caller's and PyTorch's autograd threads' (backward runs there), from the kernel's
    per-thread CPU clocks; and the garbage collections inside the step (``gc``: their time and
    how many were full). Finding the autograd threads reads ``/proc`` once a thread of the
    process; the TPU runtime starts many threads and the chip host's gVisor serves ``/proc``
    from its own kernel, so the listing stays outside both clocks."""

    def __enter__(self) -> HostClock:
        self._gc = defer_host.GcClock().__enter__()
        self._threads = defer_host._autograd_threads()
        self._start = time.thread_time() + defer_host._cpu_of(self._threads)
        self._wall = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter()
        cpu = time.thread_time() + defer_host._cpu_of(self._threads)
        self.wall_ms = (wall - self._wall) * 1e3
        # Autograd threads start at the first backward: one new since ran only inside the step.
        new = [t for t in defer_host._autograd_threads() if t not in self._threads]
        self.ms = (cpu + defer_host._cpu_of(new) - self._start) * 1e3
        self._gc.__exit__(*exc)
        self.gc = {"gc_ms": round(self._gc.ms, 2), "gc_full": self._gc.counts[2]}


def clock_check(busy_s: float = 0.3) -> dict:
    """What the host's clocks can be trusted with: the process's threads, one listing of them
    (``HostClock``'s, outside its clocks), and a busy loop's thread CPU against its wall (1.0
    where the thread clock counts every running moment; gVisor's counts 10 ms ticks of a
    timer re-armed after each tick)."""
    start = time.perf_counter()
    for _ in range(5):
        defer_host._autograd_threads()
    listing_ms = (time.perf_counter() - start) / 5 * 1e3
    wall, cpu = time.perf_counter(), time.thread_time()
    while time.perf_counter() - wall < busy_s:
        pass
    return {"threads": len(os.listdir("/proc/self/task")), "listing_ms": round(listing_ms, 3),
            "busy_cpu_per_wall": round((time.thread_time() - cpu) /
                                       (time.perf_counter() - wall), 3)}


def _finished(loss: torch.Tensor) -> bool | None:
    """Whether loss's computed array is ready on the device (None while still recorded)."""
    array = tensors.stored_array(loss.untyped_storage())
    return array.is_ready() if isinstance(array, jax.Array) else None


def _step_line(phase: str, i: int, record: float, flush: float, launch: float, wait: float,
               before: dict, keys: set, cpu: float = 0.0, **extra) -> dict:
    after = _counters()
    line = {"phase": phase, "step": i, "record_ms": record, "record_cpu_ms": cpu,
            "flush_ms": flush, "launch_ms": launch, "wait_ms": wait}
    line |= {k: round(after[k] - before[k], 3) for k in COUNTERS}
    if cpu and line["deferred_ops"]:
        line["us_per_op"] = round(cpu * 1e3 / line["deferred_ops"], 1)
    line |= extra
    built = [k for k in defer.RECORDER._programs if k not in keys]
    if built:
        line["programs_built"] = [key_difference(k, list(keys)) for k in built]
        keys.update(built)
    print(json.dumps(line, default=str), flush=True)
    return line


def _host_summary(synced: list) -> dict:
    """The synced steps' medians: the host's recording CPU, per op, and the device's time after
    it; what a loop reading each step's loss (recording, then the device) and one reading none
    (the two overlapped) would take a step."""
    if not synced:
        return {}

    def median(k: str) -> float:
        return round(statistics.median(s[k] for s in synced), 2)

    record, flush, wait = median("record_ms"), median("flush_ms"), median("wait_ms")
    return {"record_cpu_ms": median("record_cpu_ms"), "record_ms": record,
            "us_per_op": median("us_per_op") if all("us_per_op" in s for s in synced) else None,
            "flush_ms": flush, "device_wait_ms": wait,
            "read_each_step_ms": round(record + flush + wait, 2),
            "no_read_ms": round(max(record + flush, wait), 2)}


def run(layers: int, batch: int, seq: int, warmup: int, steps: int, profile: bool,
        **dims) -> dict:
    c = LlamaConfig(layers=layers, seq=seq, **dims)
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.device("tpu"):
        model = Llama(c)
    step, _ = train_step(model)
    ids = torch.randint(c.vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1].contiguous().to("tpu"), ids[:, 1:].contiguous().to("tpu")
    out: dict = {"layers": layers, "batch": batch, "seq": seq, "dims": dims,
                 "params": sum(p.numel() for p in model.parameters()), "steps": []}
    keys: set = set()
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE), Timers() as timers:
        for i in range(warmup):
            before = _counters()
            with HostClock() as host:
                loss = step(x, y)
            t1 = time.perf_counter()
            loss.item()
            t2 = time.perf_counter()
            flush, launch = timers.take()
            out["steps"].append(_step_line("warmup", i, host.wall_ms, flush, launch,
                                           (t2 - t1) * 1e3 - flush, before, keys, host.ms,
                                           **host.gc))
        out["warmup_s"] = time.perf_counter() - start
        inside = 0.0
        for i in range(steps):
            before, previous = _counters(), loss
            with HostClock() as host:
                loss = step(x, y)
            record = host.wall_ms
            inside += record
            flush, launch = timers.take()
            # The step before ran from this step's first op: still running now means the host
            # recorded this step while the device computed that one.
            ready = _finished(previous) if i else None
            out["steps"].append(_step_line("free", i, record, flush, launch, 0.0, before, keys,
                                           host.ms, overlapped=None if ready is None
                                           else not ready, **host.gc))
            del previous
        before = _counters()
        t0 = time.perf_counter()
        out["free_last_loss"] = loss.item()
        wait = (time.perf_counter() - t0) * 1e3
        flush, launch = timers.take()
        out["steps"].append(_step_line("free", "read", 0.0, flush, launch, wait - flush, before,
                                       keys))
        # The steps' own wall and the last read's, not the clocks' /proc listings between them
        # (two a step, ~21 ms each on the chip's host in session 27: 168 ms a step counted them)
        out["free_ms_per_step"] = (inside + wait) / steps
        for i in range(steps):
            before = _counters()
            with HostClock() as host:
                loss = step(x, y)  # kept alive as in the other phases: the same outputs wanted
            t1 = time.perf_counter()
            torch.tpu.synchronize()
            t2 = time.perf_counter()
            flush, launch = timers.take()
            out["steps"].append(_step_line("synced", i, host.wall_ms, flush, launch,
                                           (t2 - t1) * 1e3 - flush, before, keys, host.ms,
                                           **host.gc))
        out["peak_gib"] = torch.tpu.max_memory_allocated() / 2**30
        out["host"] = _host_summary([s for s in out["steps"] if s["phase"] == "synced"])
        out["clock"] = clock_check()
        if profile:
            # The loss kept as the loops keep it: a step whose loss nobody holds wants one output
            # fewer, another program (compiled inside the profile).
            kept, before = [loss], _counters()
            out["profile"] = strict_chip._profiled_step(lambda: kept.__setitem__(0, step(x, y)))
            out["top_ops"] = on_tpu_llama._profile(lambda: kept.__setitem__(0, step(x, y))
                                                   or kept[0], lambda t: t.item())
            out["profile_programs_loaded"] = sum(
                _counters()[k] - before[k]
                for k in ("executable_compiles", "persistent_cache_hits"))
    return out


def main(argv: list | None = None) -> dict:
    p = argparse.ArgumentParser(prog="bench/defer_chip.py", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--small", action="store_true", help="tiny dims (a check on CPU)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    dims = dict(vocab=256, dim=64, heads=2, hidden=128) if args.small else {}
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    results = {"jax": jax.__version__, "torch": torch.__version__,
               "devices": [str(d) for d in jax.devices()], "platform": platform.platform(),
               "load_before": load}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "defer_chip.json")
    try:
        results["llama"] = run(args.layers, args.batch, args.seq, args.warmup, args.steps,
                               not args.no_profile, **dims)
    except Exception:  # what was measured before the failure is kept
        results["error"] = traceback.format_exc()
        print(results["error"], flush=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=str)
    llama = results.get("llama", {})
    for k in ("warmup_s", "free_ms_per_step", "host", "clock", "peak_gib", "profile"):
        if k in llama:
            shown = {m: v for m, v in llama[k].items() if m != "top_programs"} \
                if isinstance(llama[k], dict) else llama[k]
            print(k, json.dumps(shown, default=str), flush=True)
    for op in llama.get("top_ops") or []:
        print(f"{op['ms']:8.2f} ms {op['runs']:4d}x {op['op']} [{op['category']}] "
              f"{op['hlo'][:110]}", flush=True)
    return results


if __name__ == "__main__":
    sys.exit(main() and 0)
