"""Strict eager on the chip: where a step's time goes, host or device, and small ops against jnp.

    TORCHTPU_PLATFORM=tpu python bench/strict_chip.py [--layers 12] [--batch 8] [--steps 5]
        [--sections per_op,llama,llama_each] [--out DIR]

Writes ``strict_chip.json`` under ``--out`` (default ``$OUT``, else the working directory) after
each section, so a run cut short keeps what it measured. Sections, each on its own:

- ``per_op``: small ops (a 4x4 add, a multiply by a Python number, a 4x4 matmul, a slice's
  ``add_``, a sum, a foreach multiply of 16 tensors) through Strict against the same op in
  ``jax.numpy`` on arrays already on the chip, interleaved rounds, median µs per call with the
  device waited for at the end of each timed loop, and the calling thread's CPU µs per call
  while issuing (``strict_cpu_us``, ``jnp_cpu_us``).
- ``llama``: ``torchtpu.testing.llama``'s training step (``Llama(LlamaConfig(layers=...))`` at
  ``batch`` x 1024 tokens, autocast bf16, AdamW, clipping) in Strict, after two warm-up steps:
  ms a step with a final ``.item()`` (``wall_ms``), peak device memory (``peak_gib``) and the
  host's time to issue a step without waiting (``issue_ms``); one step under an observer of
  every launch (time spent inside the jitted calls themselves, ``in_dispatch_ms``, by program:
  a launch that blocks shows there);
  one step under the JAX profiler: the device's busy time (``device_busy_ms``, the union of its
  programs' spans on the device track), the programs that took longest, and the idle gaps
  between programs; one step under cProfile (the host's top functions); and the step's census
  (``testing/step_census.py``: launches, distinct programs, host waits, numbers crossing,
  products' dtypes). ``device_busy_ms`` near ``wall_ms`` says the chip's own work is the step;
  far below it, the host is (``in_dispatch_ms`` then says whether it waits inside launches).

- ``llama_each``: the same step's timings and launches with Strict's lazy casts and lazy
  pointwise calls off (``eager/lazy_casts.py``): every cast and pointwise call launched, as
  before session 22 (a model of its own, built after ``llama``'s).

On XLA:CPU (``tests/test_bench_strict_chip.py`` runs it small) the profile has no device track:
the programs' spans come from the host threads that run them.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import glob
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import torch

import torchtpu  # noqa: F401
from torchtpu.device.hooks import HOOKS
from torchtpu.eager import executor
from torchtpu.profiler import xplane
from torchtpu.runtime import platform
from torchtpu.testing.llama import Llama, LlamaConfig, train_step
from torchtpu.testing.step_census import census


def _cases() -> list:
    a = torch.randn(4, 4, device="tpu")
    ja = jnp.asarray(a.cpu().numpy())
    big = torch.zeros(64, 4, device="tpu")
    s = torch.randn(256, device="tpu")
    js = jnp.asarray(s.cpu().numpy())
    many = [torch.randn(32, device="tpu") for _ in range(16)]
    jmany = [jnp.asarray(t.cpu().numpy()) for t in many]
    state = {"j": jnp.zeros((64, 4), jnp.float32)}

    def jax_slice_add():
        state["j"] = state["j"].at[1:3].add(1.0)

    return [
        ("add", lambda: a + a, lambda: ja + ja),
        ("mul by 0.3", lambda: a * 0.3, lambda: ja * 0.3),
        ("matmul 4x4", lambda: a @ a, lambda: ja @ ja),
        ("slice add_", lambda: big[1:3].add_(1.0), jax_slice_add),
        ("sum", lambda: s.sum(), lambda: js.sum()),
        ("foreach mul x16", lambda: torch._foreach_mul(many, 0.9),
         lambda: [x * 0.9 for x in jmany]),
    ], (ja, js, state)


def per_op(calls: int = 200, rounds: int = 7) -> dict:
    cases, (ja, js, state) = _cases()
    for _, t, j in cases:  # compiles and first runs are not timed
        for _ in range(5):
            t(), j()
    torch.tpu.synchronize()
    # Per call: wall with the device waited for, and the calling thread's CPU while issuing
    # (whether a gap to jnp is the host's Python or the launch's wait elsewhere).
    times = {name: ([], [], [], []) for name, *_ in cases}
    for _ in range(rounds):
        for name, t, j in cases:
            start, cpu = time.perf_counter(), time.thread_time()
            for _ in range(calls):
                t()
            times[name][2].append((time.thread_time() - cpu) / calls)
            torch.tpu.synchronize()
            times[name][0].append((time.perf_counter() - start) / calls)
            start, cpu = time.perf_counter(), time.thread_time()
            for _ in range(calls):
                out = j()
            times[name][3].append((time.thread_time() - cpu) / calls)
            jax.block_until_ready((out, ja, js, state["j"]))
            times[name][1].append((time.perf_counter() - start) / calls)
    out = {}
    for name, (t, j, tc, jc) in times.items():
        tm, jm = statistics.median(t), statistics.median(j)
        out[name] = {"strict_us": tm * 1e6, "jnp_us": jm * 1e6, "ratio": tm / jm,
                     "strict_cpu_us": statistics.median(tc) * 1e6,
                     "jnp_cpu_us": statistics.median(jc) * 1e6}
    return out


def _spans(programs: list) -> tuple[float, float, list]:
    """(busy ns: the union of the programs' spans, span ns: first start to last end, gaps ns
    between consecutive busy stretches)."""
    busy, gaps, end = 0.0, [], None
    for p in sorted(programs, key=lambda p: p.start_ns):
        if end is None or p.start_ns > end:
            if end is not None:
                gaps.append(p.start_ns - end)
            busy += p.end_ns - p.start_ns
            end = p.end_ns
        elif p.end_ns > end:
            busy += p.end_ns - end
            end = p.end_ns
    span = (max(p.end_ns for p in programs) - min(p.start_ns for p in programs)) if programs \
        else 0.0
    return busy, span, gaps


def _profiled_step(run) -> dict:
    directory = tempfile.mkdtemp(prefix="strict_chip_")
    try:
        jax.profiler.start_trace(directory)
        try:
            start = time.perf_counter()
            run()
            torch.tpu.synchronize()
            wall = time.perf_counter() - start
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(f"{directory}/plugins/profile/*/*.xplane.pb")
        programs = xplane.programs(jax.profiler.ProfileData.from_file(files[0])) if files else []
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    busy, span, gaps = _spans(programs)
    by = collections.defaultdict(lambda: [0, 0.0])
    for p in programs:
        by[p.module][0] += 1
        by[p.module][1] += p.end_ns - p.start_ns
    top = sorted(by.items(), key=lambda kv: -kv[1][1])[:25]
    gaps.sort(reverse=True)
    return {"profiled_wall_ms": wall * 1e3, "device_programs": len(programs),
            "device_busy_ms": busy / 1e6, "device_span_ms": span / 1e6,
            "gaps_over_100us": sum(1 for g in gaps if g > 1e5),
            "gap_ms_total": sum(gaps) / 1e6, "largest_gaps_ms": [g / 1e6 for g in gaps[:10]],
            "top_programs": [{"module": m, "runs": n, "ms": ns / 1e6} for m, (n, ns) in top]}


def _in_dispatch(run) -> dict:
    """One step with every launch timed inside its jitted call."""
    spent = collections.defaultdict(lambda: [0, 0.0])
    previous = HOOKS.launch_observer

    def observe(label, fn, args):
        start = time.perf_counter()
        out = fn(*args) if previous is None else previous(label, fn, args)
        name = str(label) if label is not None else getattr(fn, "__name__", "?")
        spent[name][0] += 1
        spent[name][1] += time.perf_counter() - start
        return out

    HOOKS.launch_observer = observe
    try:
        start = time.perf_counter()
        run()
        issue = time.perf_counter() - start
        torch.tpu.synchronize()
        wall = time.perf_counter() - start
    finally:
        HOOKS.launch_observer = previous
    total = sum(s for _, s in spent.values())
    top = sorted(spent.items(), key=lambda kv: -kv[1][1])[:20]
    return {"observed_issue_ms": issue * 1e3, "observed_wall_ms": wall * 1e3,
            "launches": sum(n for n, _ in spent.values()), "in_dispatch_ms": total * 1e3,
            "in_dispatch_top": [{"program": k, "launches": n, "ms": s * 1e3}
                                for k, (n, s) in top]}


def _host_profile(run) -> list:
    prof = cProfile.Profile()
    prof.enable()
    run()
    torch.tpu.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    return text.getvalue().splitlines()[:60]


def _timed(layers: int, batch: int, steps: int, seq: int, dims: dict) -> tuple:
    """(the step, its inputs, its timings): the model built, two warm-up steps, then ``steps``
    timed one by one (issue and wall) and pipelined."""
    config = LlamaConfig(layers=layers, seq=seq, **dims)
    torch.manual_seed(0)
    t = time.perf_counter()
    model = Llama(config).to("tpu")
    step, _ = train_step(model)
    ids = torch.randint(config.vocab, (batch, config.seq + 1),
                        generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1].contiguous().to("tpu"), ids[:, 1:].contiguous().to("tpu")
    first = [step(x, y).item() for _ in range(2)]
    out = {"layers": layers, "batch": batch, "seq": seq, "warmup_s": time.perf_counter() - t,
           "first_losses": first}
    issue, wall = [], []
    for _ in range(steps):
        start = time.perf_counter()
        loss = step(x, y)
        issue.append(time.perf_counter() - start)
        loss.item()
        wall.append(time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(steps):
        loss = step(x, y)
    loss.item()
    out |= {"wall_ms": statistics.median(wall) * 1e3, "issue_ms": statistics.median(issue) * 1e3,
            "pipelined_ms": (time.perf_counter() - start) / steps * 1e3,
            "last_loss": loss.item(), "peak_gib": torch.tpu.max_memory_allocated() / 2**30}
    return step, x, y, out


def llama(layers: int, batch: int, steps: int, seq: int = 1024, **dims) -> dict:
    step, x, y, out = _timed(layers, batch, steps, seq, dims)
    out |= _in_dispatch(lambda: step(x, y))
    out |= _profiled_step(lambda: step(x, y))
    out["host_profile"] = _host_profile(lambda: step(x, y))
    with census() as c:
        step(x, y)
    out["census"] = c.summary()
    return out


def llama_each(layers: int, batch: int, steps: int, seq: int = 1024, **dims) -> dict:
    """``llama``'s timings with Strict launching every cast and pointwise call itself (lazy
    casts and lazy pointwise calls off, as before session 22): what they save on this chip."""
    was = executor.Strict.lazy_casts, executor.Strict.lazy_ops
    executor.Strict.lazy_casts = executor.Strict.lazy_ops = False
    executor.set_current(executor.current())  # leaves and enters: the lazy-cast hook unset
    try:
        step, x, y, out = _timed(layers, batch, steps, seq, dims)
        with census() as c:
            step(x, y)
    finally:
        executor.Strict.lazy_casts, executor.Strict.lazy_ops = was
        executor.set_current(executor.current())
    out["launches"] = c.launch_count
    return out


def main(argv: list | None = None) -> dict:
    p = argparse.ArgumentParser(prog="bench/strict_chip.py", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--sections", default="per_op,llama,llama_each")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--small", action="store_true", help="tiny dims (a check on CPU)")
    args = p.parse_args(argv)
    dims = dict(vocab=256, dim=64, heads=2, hidden=128) if args.small else {}
    seq = 32 if args.small else 1024
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    results = {"jax": jax.__version__, "torch": torch.__version__,
               "devices": [str(d) for d in jax.devices()], "platform": platform.platform(),
               "load_before": load}
    sections = {"per_op": lambda: per_op(*((20, 2) if args.small else ())),
                "llama": lambda: llama(args.layers, args.batch, args.steps, seq, **dims),
                "llama_each": lambda: llama_each(args.layers, args.batch, args.steps, seq,
                                                 **dims)}
    path = os.path.join(args.out, "strict_chip.json")
    os.makedirs(args.out, exist_ok=True)
    for name in args.sections.split(","):
        t = time.perf_counter()
        try:
            results[name] = sections[name]()
        except Exception:  # each section reports on its own
            results[name] = {"error": traceback.format_exc()}
        results[name]["section_s"] = time.perf_counter() - t
        shown = {k: v for k, v in results[name].items() if k not in ("host_profile", "census")}
        print(name, json.dumps(shown, indent=1, default=str), flush=True)
        with open(path, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return results


if __name__ == "__main__":
    sys.exit(main() and 0)
