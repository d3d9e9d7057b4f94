"""Where a vLLM-TorchTPU engine step's time goes: phases, a host profile, the device's programs.

``serving_chip.py``'s vllm part uses this to say, from one chip call, whether a step's time is
host Python, program launches or device work:

- :class:`Phases`: wall time per step in the model runner's phases (``prepare``: the host-fed
  inputs; ``forward``: the captured program's launch, or the eager forward; ``sample``: the
  sampler; ``to_list``: the copy of the sampled tokens to the host, which waits for the device),
  and the rest of ``engine.step()`` (vLLM's scheduler and output processing) as ``other``.
- :func:`host_profile`: cProfile of a few steps, the functions with the most own time.
- :func:`device_programs`: a JAX profiler trace of a few steps, read back with torchtpu's own
  XSpace reader (``torchtpu.profiler.xplane``): each program's runs and device time, and the HLO
  ops with the most device time.
- :func:`replay_time`: the last captured step program replayed alone, launch and device time,
  and its launch split into Python, the executable's call and the host-fed values' transfers
  (:func:`launch_split`).
- :class:`CompileCounter`: the XLA compiles in this process (JAX's monitoring events).
- :func:`floors`: what one ``torch.tpu.synchronize()`` and one tiny eager op read back cost.

Each returns plain JSON data; a failure is reported in the result, never raised, so that a
diagnostic cannot cost the figures of the chip call around it.
"""

from __future__ import annotations

import collections
import cProfile
import glob
import io
import pstats
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable


class CompileCounter:
    """XLA compiles in this process, from JAX's monitoring events."""

    def __init__(self) -> None:
        import jax

        self.count = 0

        def listen(event: str, duration: float, **kwargs) -> None:
            if event == "/jax/core/compile/backend_compile_duration":
                self.count += 1

        jax.monitoring.register_event_duration_secs_listener(listen)


PHASES = {"_prepare_inputs": "prepare", "_model_forward": "forward", "_sample": "sample",
          "_to_list": "to_list"}


def runner_of(llm):
    """The model runner of an ``LLM`` whose engine runs in this process."""
    core = llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner


class Phases:
    """Per-step seconds in the runner's phases (wraps its methods on the instance)."""

    def __init__(self, runner) -> None:
        self.now: collections.Counter = collections.Counter()
        for method, phase in PHASES.items():
            setattr(runner, method, self._timed(getattr(runner, method), phase))

    def _timed(self, fn: Callable, phase: str) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.now[phase] += time.perf_counter() - start

        return timed

    def take(self, step_s: float) -> dict:
        """This step's phases (and ``other``: the rest of its ``step_s``); starts the next."""
        out = dict(self.now)
        out["other"] = step_s - sum(out.values())
        self.now.clear()
        return out


def phase_medians(steps: list[dict]) -> dict:
    """Median seconds per phase over steps that recorded phases."""
    rows = [s["phases"] for s in steps if s.get("phases")]
    names = sorted({k for r in rows for k in r})
    return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in names} if rows else {}


def _guarded(fn: Callable) -> Callable:
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 (a diagnostic reports its failure, never raises)
            return {"error": traceback.format_exc()[-1500:]}

    return run


@_guarded
def host_profile(step: Callable[[], object], steps: int = 3, top: int = 25) -> dict:
    """cProfile of ``steps`` calls of step: the functions with the most own time."""
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    try:
        for _ in range(steps):
            step()
    finally:  # (a failing step must not leave the profiler on for what runs after)
        profile.disable()
    wall = time.perf_counter() - start
    stats = pstats.Stats(profile, stream=io.StringIO())
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    return {"steps": steps, "wall_s": wall,
            "by_own_time": [{"function": f"{f}:{line}({name})", "calls": nc,
                             "own_s": round(tt, 6), "cumulative_s": round(ct, 6)}
                            for (f, line, name), (cc, nc, tt, ct, _) in rows]}


@_guarded
def device_programs(step: Callable[[], object], steps: int = 3, top: int = 20) -> dict:
    """A JAX profiler trace of ``steps`` calls of step: device time per program and per op."""
    import jax
    from jax.profiler import ProfileData

    from torchtpu.profiler import xplane

    with tempfile.TemporaryDirectory() as directory:
        jax.profiler.start_trace(directory)
        start = time.perf_counter()
        try:
            for _ in range(steps):
                step()
        finally:
            jax.profiler.stop_trace()
        wall = time.perf_counter() - start
        files = glob.glob(f"{directory}/**/*.xplane.pb", recursive=True)
        runs = xplane.programs(ProfileData.from_file(files[0])) if files else []
    by_program: dict = collections.defaultdict(lambda: [0, 0.0])
    by_op: collections.Counter = collections.Counter()
    for run in runs:
        by_program[run.module][0] += 1
        by_program[run.module][1] += (run.end_ns - run.start_ns) / 1e6
        for name, s, e in run.ops:
            by_op[name] += (e - s) / 1e6
    programs = sorted(by_program.items(), key=lambda kv: -kv[1][1])
    return {"steps": steps, "wall_s": wall,
            "device_ms": round(sum(v[1] for _, v in programs), 3),
            "programs": [{"module": m, "runs": n, "device_ms": round(ms, 3)}
                         for m, (n, ms) in programs[:top]],
            "ops": [{"op": n, "device_ms": round(ms, 3)} for n, ms in by_op.most_common(top)]}


@_guarded
def replay_time(runner, repeats: int = 10) -> dict:
    """The runner's most recently used captured step, replayed alone: launch and wall time to
    its outputs' readiness (the last step's host inputs are fed again: the same KV is
    rewritten into the same slots), and the launch split (``launch_split``)."""
    import jax
    import torch

    from torchtpu.eager.capture import storage_of

    graphs = runner.step_graphs._graphs
    if not graphs:
        return {"error": "no captured step"}
    key, (graph, output) = next(reversed(graphs.items()))
    outputs = output if isinstance(output, tuple) else (output,)
    launch, total = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        graph.replay()
        launched = time.perf_counter()
        jax.block_until_ready([storage_of(t)._tpu_array for t in outputs
                               if isinstance(t, torch.Tensor)])
        done = time.perf_counter()
        launch.append(launched - start)
        total.append(done - start)
    return {"key": repr(key)[:300], "ops": graph.captured.ops, "repeats": repeats,
            "launch_median_s": statistics.median(launch),
            "total_median_s": statistics.median(total),
            "launch_split": launch_split(graph.captured, repeats)}


def launch_split(captured, repeats: int = 10) -> dict:
    """Where a captured program's launch goes: ``arguments_s`` (the Python gathering of its
    arguments, the host-fed values' copies included), ``call_s`` (the executable's call: JAX's
    C++ path, the host-fed NumPy values' transfers, PJRT's enqueue), ``store_s`` (rebinding the
    written storages); ``call_device_fed_s``, the call with the fed values on the device
    already (what their transfers cost inside it); ``trivial_same_args_s``, a program that
    reads one argument, called with the same arrays (the cost per argument of a launch). Each
    waits for the program's results after the timed part."""
    import jax
    import numpy as np

    io, fn = captured._io, captured._fn
    sample = io.arguments()
    fed = [i for i, a in enumerate(sample) if isinstance(a, np.ndarray)]
    rows: dict = collections.defaultdict(list)
    for device_fed in (False, True):
        for _ in range(repeats):
            t0 = time.perf_counter()
            args = io.arguments()
            t1 = time.perf_counter()
            if device_fed:
                for i in fed:
                    args[i] = jax.device_put(args[i])
                jax.block_until_ready([args[i] for i in fed])
                t1 = time.perf_counter()
            results = fn(*args)
            t2 = time.perf_counter()
            io.store(args, results)
            t3 = time.perf_counter()
            jax.block_until_ready(results)
            if device_fed:
                rows["call_device_fed_s"].append(t2 - t1)
            else:
                rows["arguments_s"].append(t1 - t0)
                rows["call_s"].append(t2 - t1)
                rows["store_s"].append(t3 - t2)
    args = [jax.device_put(a) if isinstance(a, np.ndarray) else a for a in io.arguments()]
    first = jax.jit(lambda *a: a[0])
    jax.block_until_ready(first(*args))
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = first(*args)
        rows["trivial_same_args_s"].append(time.perf_counter() - t0)
        jax.block_until_ready(out)
    return {"arguments": len(sample), "host_fed": len(fed),
            **{k: statistics.median(v) for k, v in rows.items()}}


@_guarded
def floors(repeats: int = 10) -> dict:
    """Median seconds of ``torch.tpu.synchronize()`` (vLLM's events wait through it) and of a
    one-element eager op read to the host: the floor under any step."""
    import torch

    def median(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    x = torch.ones(1, device="tpu")
    return {"synchronize_s": median(torch.tpu.synchronize),
            "tiny_op_to_host_s": median(lambda: (x + 1).cpu())}
