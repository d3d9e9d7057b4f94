"""The engine thread's host work per decode step of a vLLM-TorchTPU engine, by phase.

On XLA:CPU (or any platform): one in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as
``serving_chip.py`` runs it) on a random-weight model of ``serving_jax.CONFIGS``, async
scheduling, greedy requests all submitted at once. A warm-up round compiles the steps' programs
(lazy capture by default: start-up compiles nothing); then two timed rounds of the same lengths:

- **phases**: each engine step's thread CPU (``time.thread_time``: the main thread's own work;
  the device's, XLA's threads, and the waits for it are not in it), split by the methods below
  (inclusive, so the runner's rows nest inside ``execute_model``), medians over the decode steps
  (a step whose scheduled tokens equal its requests);
- **calls**: cProfile over the next round's decode steps: Python function calls a step, by
  whose code (torchtpu, vLLM, torch, JAX, NumPy, the rest: load-free), and the functions with
  the most calls and own thread CPU (the profile's clock: inflated by the profiler, but no
  wait for the device is in it); torchtpu's counters (launches, fed transfers) a step.

    python bench/serving_host.py [--model tiny] [--layers 24] [--batch 64] [--prompt 32]
        [--output 48] [--json FILE]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# (owner, method, row): "engine" is the LLM engine, "sched" its engine core's scheduler, "out"
# its output processor, "runner" the model runner; the rest torchtpu's modules and classes
METHODS = [
    ("engine", "step", "engine step"),
    ("sched", "schedule", "Scheduler.schedule"),
    ("sched", "update_from_output", "Scheduler.update_from_output"),
    ("out", "process_outputs", "OutputProcessor.process_outputs"),
    ("runner", "execute_model", "runner.execute_model"),
    ("runner", "_update_states", "- _update_states"),
    ("runner", "_prepare_inputs", "- _prepare_inputs"),
    ("runner", "_determine_batch_execution_and_padding", "- _determine_batch_..._padding"),
    ("runner", "_get_slot_mappings", "- _get_slot_mappings"),
    ("runner", "_build_attention_metadata", "- _build_attention_metadata"),
    ("runner", "_preprocess", "- _preprocess"),
    ("runner", "_model_forward", "- _model_forward (the launch)"),
    ("runner", "sample_tokens", "runner.sample_tokens"),
    ("runner", "_sample", "- _sample"),
    ("runner", "_bookkeeping_sync", "- _bookkeeping_sync"),
    # torchtpu's own, wherever they run in the step
    ("launch", "run", "torchtpu: the executable's call (launch.run)"),
    ("replay_io", "arguments", "torchtpu: ReplayIO.arguments (packed feeds included)"),
    ("replay_io", "store", "torchtpu: ReplayIO.store"),
    ("async_out", "__init__", "torchtpu: TpuAsyncOutput (the tokens' copy started)"),
    ("host_copy", "synchronize", "torchtpu: the tokens read (_HostCopy.synchronize)"),
]
GROUPS = ("torchtpu", "vllm", "torch", "jax", "numpy")


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    return [[(31 * i + 7 * j) % (vocab - 2) + 1 for j in range(length)] for i in range(batch)]


def _group(filename: str) -> str:
    """Whose code a profiled function is: the package after ``site-packages/`` (or torchtpu's
    tree, wherever it is checked out)."""
    if filename == "~":
        return "builtins"
    if "/torchtpu/" in filename and "site-packages/" not in filename:
        return "torchtpu"
    top = filename.rpartition("site-packages/")[2].split("/", 1)[0]
    return top if top in GROUPS else "other"


class StepClock:
    """Thread CPU per wrapped method, per engine step; which steps were decodes."""

    def __init__(self, owners: dict) -> None:
        self.now: collections.Counter = collections.Counter()
        self.steps: list[dict] = []
        self.decode = False
        for owner, method, row in METHODS:
            obj = owners[owner]
            fn = getattr(obj, method, None)
            if fn is not None:
                setattr(obj, method, self._timed(fn, row))
        schedule = owners["sched"].schedule

        def classify(*a, **k):
            out = schedule(*a, **k)
            reqs = len(out.num_scheduled_tokens)
            self.decode = reqs > 0 and out.total_num_scheduled_tokens == reqs
            return out

        owners["sched"].schedule = classify

    def _timed(self, fn, row: str):
        def timed(*a, **k):
            start = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                self.now[row] += time.thread_time() - start
                if row == "engine step":
                    self.steps.append({"decode": self.decode, **self.now})
                    self.now.clear()

        return timed

    def medians(self, first: int) -> dict:
        rows = [s for s in self.steps[first:] if s["decode"]]
        names = [row for _, _, row in METHODS]
        return {"decode_steps": len(rows),
                **{n: round(1e3 * statistics.median(r.get(n, 0.0) for r in rows), 4)
                   for n in names if any(n in r for r in rows)}}


class _ReadClock:
    """The tokens' reads (``_HostCopy.synchronize``) split by whether the step's program had
    finished when the read began: a read of a finished program is the host's own work; one of
    a running program holds the wait (on XLA:CPU a blocked wait may spin, and count as CPU)."""

    def __init__(self, cls) -> None:
        self.cpu: dict = {True: [], False: []}
        sync = cls.synchronize

        def timed(copy):
            ready = copy._array is None or copy._array.is_ready()
            start = time.thread_time()
            try:
                return sync(copy)
            finally:
                self.cpu[ready].append(time.thread_time() - start)

        cls.synchronize = timed

    def take(self) -> dict:
        out = {("done" if k else "running"): (len(v), round(1e3 * statistics.median(v), 4)
                                              if v else None) for k, v in self.cpu.items()}
        self.cpu = {True: [], False: []}
        return out


class _GcClock:
    """Python's garbage collections inside the engine's steps: how many of each generation a
    step, and their thread CPU (``gc.callbacks``), summed over the steps run while counting."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.cpu = 0.0
        self._start = 0.0
        gc.callbacks.append(self._event)

    def _event(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.thread_time()
        else:
            self.counts[info["generation"]] += 1
            self.cpu += time.thread_time() - self._start

    def take(self, steps: int) -> dict:
        out = {"collections_a_step_by_generation": [round(c / max(steps, 1), 3)
                                                    for c in self.counts],
               "cpu_ms_a_step": round(1e3 * self.cpu / max(steps, 1), 4),
               "frozen_objects": gc.get_freeze_count(), "thresholds": gc.get_threshold()}
        self.counts, self.cpu = [0, 0, 0], 0.0
        return out


def _calls(profile: cProfile.Profile, steps: int, top: int = 25) -> dict:
    stats = pstats.Stats(profile).stats
    by_group: collections.Counter = collections.Counter()
    for (filename, _, _), (_, calls, _, _, _) in stats.items():
        by_group[_group(filename)] += calls
    rows = sorted(stats.items(), key=lambda kv: -kv[1][1])
    own = sorted(stats.items(), key=lambda kv: -kv[1][2])

    def name(key):
        filename, line, fn = key
        return f"{_group(filename)}:{Path(filename).name}:{line}({fn})"

    return {"steps": steps,
            "calls_a_step": round(sum(by_group.values()) / max(steps, 1), 1),
            "by_code": {g: round(n / max(steps, 1), 1) for g, n in by_group.most_common()},
            "most_calls": [(name(k), round(v[1] / steps, 2)) for k, v in rows[:top]],
            "most_own_ms": [(name(k), round(1e3 * v[2] / steps, 4)) for k, v in own[:top]],
            "torchtpu_cumulative_ms": [
                (name(k), round(v[1] / steps, 2), round(1e3 * v[3] / steps, 4))
                for k, v in sorted(stats.items(), key=lambda kv: -kv[1][3])
                if _group(k[0]) == "torchtpu"][:top]}


def run(args) -> dict:
    os.environ.setdefault("TORCHTPU_VLLM", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TORCHTPU_VLLM_CAPTURE", "lazy")
    import vllm

    from torchtpu import metrics

    start = time.process_time(), time.perf_counter()
    llm = vllm.LLM(model=args.model_dir, max_model_len=args.prompt + args.output + 16,
                   max_num_seqs=args.batch, seed=0, enable_prefix_caching=False)
    startup = {"cpu_s": round(time.process_time() - start[0], 1),
               "wall_s": round(time.perf_counter() - start[1], 1)}
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    from torchtpu.device import launch
    from torchtpu.eager.replay_io import ReplayIO
    from torchtpu.integrations.vllm import async_output

    clock = StepClock({"engine": engine, "sched": core.scheduler,
                       "out": engine.output_processor, "runner": runner, "launch": launch,
                       "replay_io": ReplayIO, "async_out": async_output.TpuAsyncOutput,
                       "host_copy": async_output._HostCopy})
    reads = _ReadClock(async_output._HostCopy)
    vocab = engine.model_config.get_vocab_size()
    params = vllm.SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts(args.batch, args.prompt, vocab)]
    warm = time.process_time()
    llm.generate([{"prompt_token_ids": p["prompt_token_ids"][::-1]} for p in prompts], params,
                 use_tqdm=False)
    startup["warm_round_cpu_s"] = round(time.process_time() - warm, 1)
    first = len(clock.steps)
    before = metrics.snapshot()
    collections_ = _GcClock()
    outs = llm.generate(prompts, params, use_tqdm=False)
    phases = clock.medians(first)
    collected = collections_.take(len(clock.steps) - first)
    gc.callbacks.remove(collections_._event)
    phases["tokens read: program done / not done at the read (n, median ms)"] = reads.take()
    after = metrics.snapshot()
    steps = len(clock.steps) - first
    counters = {k: round((after[k] - before.get(k, 0)) / steps, 3) for k in after
                if isinstance(after[k], (int, float)) and after[k] != before.get(k, 0)}
    # the cProfile round: its decode steps only (the prefill step's calls differ)
    # thread CPU as the profile's clock: a wait for the device (a token read) costs none
    profile = cProfile.Profile(time.thread_time)
    engine_step = engine.step
    profiled = [0]

    def step_profiled(*a, **k):
        if not clock.decode:
            return engine_step(*a, **k)
        profiled[0] += 1
        profile.enable()
        try:
            return engine_step(*a, **k)
        finally:
            profile.disable()

    engine.step = step_profiled
    again = llm.generate(prompts, params, use_tqdm=False)
    engine.step = engine_step
    if args.profile_out:
        profile.dump_stats(args.profile_out)
    return {"model": args.model, "layers": args.layers, "batch": args.batch,
            "prompt": args.prompt, "output": args.output, "startup": startup,
            "load": os.getloadavg(), "engine_steps": steps,
            "thread_cpu_ms_a_decode_step": phases, "counters_a_step": counters,
            "gc_in_the_timed_round": collected,
            "calls": _calls(profile, profiled[0]),
            "tokens_equal_across_rounds": [o.outputs[0].token_ids for o in outs]
            == [o.outputs[0].token_ids for o in again],
            "tokens_head": [list(o.outputs[0].token_ids[:8]) for o in outs[:2]]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--output", type=int, default=48)
    ap.add_argument("--model-dir", help="a model made before (else made in a temporary folder)")
    ap.add_argument("--json")
    ap.add_argument("--profile-out", help="write the cProfile round's stats here (pstats)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if not args.model_dir:
            import serving_chip

            args.model_dir = str(serving_chip.make_model(args.model, Path(tmp) / args.model,
                                                         layers=args.layers))
        result = run(args)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
