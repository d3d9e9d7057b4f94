"""vLLM-TorchTPU's async scheduling against its sync path, in alternating runs of one workload.

Each run is a process of its own (vLLM fixes a process's scheduling mode when its engine
starts): sync (``TORCHTPU_VLLM_ASYNC=0``) and async (``=1``) alternate, the first mode swapped
each round, so that both meet the same load of a shared machine. A run builds ``LLM`` on a
random-weight model of ``serving_jax.CONFIGS`` (``serving_chip.make_model``), warms up with the
timed round's own lengths, then generates ``--output`` greedy tokens for each ``--batch`` of
prompts of ``--prompt`` tokens, all submitted at once. Per engine step (a model execution) it
reports the wall time, the main thread's CPU time (the host path: scheduling, input
preparation, the program's launch, output processing), the wall the host spends reading the
step's tokens and how often their program had finished when the read began (async: after the
next step's launch), the program launches and host-fed transfers; and the tokens, which must
be equal across modes.

    python bench/serving_async.py [--model tiny] [--layers 24] [--batch 1 8] [--prompt 32]
        [--output 64] [--rounds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODES = {"sync": "0", "async": "1"}


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    return [[(31 * i + 7 * j) % (vocab - 2) + 1 for j in range(length)] for i in range(batch)]


def child(args) -> dict:
    """One run: every batch's timed round, in this process."""
    import vllm

    from torchtpu import metrics
    from torchtpu.device import launch

    # no prefix caching: the timed round's prompts would hit the warm-up's and meet other steps
    llm = vllm.LLM(model=args.model_dir, max_model_len=args.prompt + args.output + 16,
                   max_num_seqs=max(args.batch), seed=0, enable_prefix_caching=False)
    engine = llm.llm_engine
    runner = engine.model_executor.driver_worker.worker.model_runner
    vocab = engine.model_config.get_vocab_size()
    steps, launches, run, execute = [0], [0], launch.run, runner.execute_model

    def counted_run(label, fn, a):
        launches[0] += 1
        return run(label, fn, a)

    def counted_execute(*a, **k):
        steps[0] += 1
        return execute(*a, **k)

    launch.run, runner.execute_model = counted_run, counted_execute
    reads = {"s": 0.0, "n": 0, "ready": 0}  # the step's tokens read on the host: wait, readiness
    _time_reads(runner, reads)
    params = vllm.SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True)
    out = {"async": engine.vllm_config.scheduler_config.async_scheduling, "batches": []}
    for batch in args.batch:
        warm = [{"prompt_token_ids": p[::-1]} for p in _prompts(batch, args.prompt, vocab)]
        llm.generate(warm, params, use_tqdm=False)  # warm-up: the same lengths
        prompts = [{"prompt_token_ids": p} for p in _prompts(batch, args.prompt, vocab)]
        steps[0] = launches[0] = 0
        reads.update(s=0.0, n=0, ready=0)
        fed = metrics.snapshot().get("fed_transfers", 0)
        wall, cpu = time.perf_counter(), time.thread_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        n = max(steps[0], 1)
        out["batches"].append({
            "batch": batch, "steps": steps[0], "wall_ms_a_step": 1e3 * wall / n,
            "host_cpu_ms_a_step": 1e3 * cpu / n, "launches_a_step": launches[0] / n,
            "fed_transfers_a_step": (metrics.snapshot().get("fed_transfers", 0) - fed) / n,
            "read_wait_ms_a_step": 1e3 * reads["s"] / n,
            "ready_at_read": reads["ready"] / max(reads["n"], 1),
            "tokens": [list(o.outputs[0].token_ids) for o in outs]})
    return out


def _time_reads(runner, reads: dict) -> None:
    """Time the host's read of each step's tokens (sync: the runner's ``_to_list``; async: the
    copy's event, waited on after the next step's launch) and count the reads whose program
    had finished before the read began (the overlap)."""
    from torchtpu.eager.capture import storage_of
    from torchtpu.integrations.vllm import async_output

    def timed(fn, ready):
        def read(*a, **k):
            reads["ready"] += bool(ready(*a))
            reads["n"] += 1
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                reads["s"] += time.perf_counter() - start
        return read

    to_list = runner._to_list
    runner._to_list = timed(to_list, lambda ids: runner._sampled is not None
                            and storage_of(runner._sampled.padded)._tpu_array.is_ready())
    copy = async_output._HostCopy
    copy.synchronize = timed(copy.synchronize,
                             lambda self: self._array is None or self._array.is_ready())


def _run(mode: str, args, model_dir: Path) -> dict:
    env = {**os.environ, "TORCHTPU_VLLM": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "TORCHTPU_VLLM_ASYNC": MODES[mode]}
    cmd = [sys.executable, __file__, "--child", "--model-dir", str(model_dir),
           "--batch", *map(str, args.batch), "--prompt", str(args.prompt),
           "--output", str(args.output)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{mode} run failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=1200)
    ap.add_argument("--json")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--model-dir")
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return {}
    import serving_chip

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = serving_chip.make_model(args.model, Path(tmp) / args.model, layers=args.layers)
        runs = {m: [] for m in MODES}
        for r in range(args.rounds):
            for mode in (("sync", "async") if r % 2 == 0 else ("async", "sync")):
                runs[mode].append(_run(mode, args, model_dir))
                print(mode, json.dumps([{k: v for k, v in b.items() if k != "tokens"}
                                        for b in runs[mode][-1]["batches"]]), flush=True)
    table = []
    for i, batch in enumerate(args.batch):
        row = {"batch": batch}
        for mode in MODES:
            rows = [run["batches"][i] for run in runs[mode]]
            for k in ("wall_ms_a_step", "host_cpu_ms_a_step", "read_wait_ms_a_step",
                      "ready_at_read", "launches_a_step", "fed_transfers_a_step", "steps"):
                row[f"{mode}_{k}"] = statistics.median(b[k] for b in rows)
        first = runs["sync"][0]["batches"][i]["tokens"]
        row["tokens_equal"] = all(run["batches"][i]["tokens"] == first
                                  for m in MODES for run in runs[m])
        table.append(row)
    result = {"model": args.model, "layers": args.layers, "prompt": args.prompt,
              "output": args.output, "rounds": args.rounds, "load": os.getloadavg(),
              "table": table}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
