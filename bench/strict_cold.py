"""A new process's first Strict training steps, checkout against checkout (eager warm starts).

Each run is a fresh process in a checkout's root (its torchtpu imported): a small Llama
(``torchtpu.testing.llama``: vocab 256, width 64, 2 blocks, 32 tokens, fp32) trained for
``--steps`` Strict steps (AdamW, clipping) on device "tpu", every step timed to its loss on the
host; it reports the import time, each step's seconds and, around the steps, the programs JAX
traced (op programs: named ``aten_*``; all), those loaded by torchtpu's key, JAX's cache hits
and the compiles. Runs go in interleaved rounds over the checkouts, all on one persistent
cache (``--cache``, default a new directory), after one unrecorded run per checkout that fills
it: each recorded run is a warm process as a job's second start is.

``--grpo``: each run is instead TRL's GRPO with vLLM-TorchTPU colocated
(``python -m torchtpu.testing.grpo tpu STEPS DIR vllm nowatch``, run with the interpreter
running this, one with TRL and vLLM: the rl-vllm venv); per step its seconds and the programs
it built or loaded, of them by torchtpu's key (the engine's start-up is not in a step).

    python bench/strict_cold.py --repos /work/main /work/wt [--rounds 3] [--steps 2] [--grpo]
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


def child(steps: int) -> None:
    t0 = time.perf_counter()
    from jax import monitoring

    traces = {"ops": 0, "all": 0}

    def on(event: str, seconds: float, fun_name: str = "", **_) -> None:
        if event == "/jax/core/compile/jaxpr_trace_duration":
            traces["all"] += 1
            traces["ops"] += fun_name.startswith("aten_")

    monitoring.register_event_duration_secs_listener(on)
    import torch

    import torchtpu
    from torchtpu.testing import llama

    imported = time.perf_counter() - t0
    torch.manual_seed(0)
    c = llama.LlamaConfig(vocab=256, dim=64, layers=2, heads=4, hidden=128, seq=32)
    model = llama.Llama(c).to("tpu")
    step, _ = llama.train_step(model, dtype=None)
    ids = torch.randint(0, c.vocab, (2, c.seq)).to("tpu")
    before, counts = dict(traces), torchtpu.metrics.snapshot()
    seconds, losses = [], []
    for _ in range(steps):
        t = time.perf_counter()
        losses.append(step(ids, ids).item())
        seconds.append(time.perf_counter() - t)
    after = torchtpu.metrics.snapshot()
    print("STRICT_COLD " + json.dumps({
        "import": imported, "steps": seconds, "losses": losses,
        "op_traces": traces["ops"] - before["ops"], "traces": traces["all"] - before["all"],
        **{k: after.get(k, 0) - counts.get(k, 0) for k in (
            "programs_loaded_by_key", "persistent_cache_hits", "executable_compiles")}}))


def one(repo: str, steps: int, cache: str, grpo: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=repo, TORCHTPU_CACHE_DIR=cache, TORCHTPU_NOTICES="0")
    if grpo:
        env.update(TORCHTPU_VLLM="1")
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        command = ["-m", "torchtpu.testing.grpo", "tpu", str(steps),
                   cache.rstrip("/") + "-grpo", "vllm", "nowatch"]
    else:
        command = [os.path.abspath(__file__), "--child", str(steps)]
    proc = subprocess.run([sys.executable, *command], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=900)
    tag = "GRPO_RESULT " if grpo else "STRICT_COLD "
    lines = [x for x in proc.stdout.splitlines() if x.startswith(tag)]
    if proc.returncode or not lines:
        raise RuntimeError(proc.stderr[-3000:])
    out = json.loads(lines[-1][len(tag):])
    if grpo:
        return {"steps": [t["seconds"] for t in out["timings"]],
                "losses": [s["loss"] for s in out["steps"]],
                "line": ", ".join(f"{t['seconds']:.2f} s ({t['programs']} programs, "
                                  f"{t.get('by_key', '?')} by key)" for t in out["timings"])}
    out["line"] = (f"import {out['import']:.2f} s, steps "
                   f"{', '.join(f'{s:.2f}' for s in out['steps'])} s, op traces "
                   f"{out['op_traces']} (all {out['traces']}), loaded by key "
                   f"{out['programs_loaded_by_key']}, JAX hits {out['persistent_cache_hits']}, "
                   f"compiles {out['executable_compiles']}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repos", nargs="+", default=[os.getcwd()])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--cache")
    parser.add_argument("--grpo", action="store_true")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child)
        return
    cache = args.cache or tempfile.mkdtemp(prefix="strict_cold-")
    for repo in args.repos:
        print(f"{repo} (filling the cache): {one(repo, args.steps, cache, args.grpo)['line']}",
              flush=True)
    runs: dict = {repo: [] for repo in args.repos}
    for _ in range(args.rounds):
        for repo in args.repos:
            runs[repo].append(one(repo, args.steps, cache, args.grpo))
            print(f"{repo}: {runs[repo][-1]['line']}", flush=True)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"load at the end {load}; median first step:")
    for repo, rs in runs.items():
        print(f"  {repo}: {statistics.median(r['steps'][0] for r in rs):.2f} s "
              f"(losses {rs[0]['losses']})")


if __name__ == "__main__":
    main()
