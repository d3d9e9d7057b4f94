"""nanoGPT's sample.py, unchanged, with a cold compile cache: tpu against CPU, side by side.

Needs a nanoGPT checkout (github.com/karpathy/nanoGPT; not part of this repository): it is
copied into a work folder, where its own ``data/shakespeare_char/prepare.py`` encodes a text
made here (Shakespeare-like lines of a small vocabulary: no download), its own ``train.py``
trains a small model for a few iterations on CPU (``config/train_shakespeare_char.py`` with
smaller sizes) and saves ``ckpt.pt``, and ``sample.py --init_from=resume`` then samples in
interleaved rounds on ``--device=tpu`` (each run with a fresh ``TORCHTPU_CACHE_DIR``) and
``--device=cpu``. sample.py imports tiktoken but uses the dataset's ``meta.pkl``, prepare.py
imports requests but finds its input: where either is missing an empty stand-in is on the path.
Each run is a new process, timed whole (wall, and user+system CPU seconds of the child); a
wrapper that runs sample.py with ``runpy`` reports torchtpu's compile counts at exit.

    python bench/nanogpt_sample.py NANOGPT_DIR [--rounds 2] [--json out.json]
        [--samples 1] [--tokens 100] [--layers 2] [--embd 64] [--block 64] [--checkout DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time

_WRAP = r"""
import atexit, json, runpy, sys
def _report():
    if "torchtpu" in sys.modules:
        from torchtpu import metrics
        s = metrics.snapshot()
        print("NANOGPT_METRICS " + json.dumps({k: s.get(k, 0) for k in (
            "executable_compiles", "compile_seconds", "persistent_cache_hits", "executions",
            "eager_bucketed_calls")}), file=sys.stderr)
atexit.register(_report)
sys.argv = ["sample.py", *sys.argv[1:]]
runpy.run_path("sample.py", run_name="__main__")
"""

_WORDS = ("the king queen lord my good sir thou art thee what shall love heart night day come "
          "go death life speak hear sweet fair noble blood crown sword honour grace heaven "
          "earth").split()
_NAMES = ["ROMEO", "JULIET", "KING HENRY", "GLOUCESTER", "LADY ANNE", "MERCUTIO"]


def _text(chars: int) -> str:
    rng, out, n = random.Random(0), [], 0
    while n < chars:
        lines = [rng.choice(_NAMES) + ":\n"]
        for _ in range(rng.randint(1, 4)):
            words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 10)))
            lines.append(words.capitalize() + rng.choice(",.!?;") + "\n")
        lines.append("\n")
        out += lines
        n += sum(map(len, lines))
    return "".join(out)


_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_STUBBED = ("tiktoken", "requests")  # imported by sample.py / prepare.py, used only to download


def _child_env(work: str, checkout: str = _HERE, **extra) -> dict:
    path = [os.path.join(work, "stub"), checkout, os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p), **extra)


def _run(cmd: list, work: str, env: dict) -> tuple[subprocess.CompletedProcess, float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode:
        raise RuntimeError(f"{cmd} failed:\n{proc.stderr[-3000:]}")
    return proc, wall, cpu


def prepare(nanogpt: str, work: str, args) -> None:
    """nanoGPT copied into work, the data encoded and a checkpoint trained (nanoGPT's scripts)."""
    shutil.copytree(nanogpt, work, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".git"))
    os.makedirs(os.path.join(work, "stub"), exist_ok=True)
    for name in _STUBBED:
        if importlib.util.find_spec(name) is None:
            with open(os.path.join(work, "stub", f"{name}.py"), "w") as f:
                f.write('"""Stand-in: imported, never used here (meta.pkl, no download)."""\n')
    data = os.path.join(work, "data", "shakespeare_char")
    with open(os.path.join(data, "input.txt"), "w") as f:
        f.write(_text(300_000))
    env = _child_env(work)
    _run([sys.executable, "prepare.py"], data, env)
    _run([sys.executable, "train.py", "config/train_shakespeare_char.py", "--device=cpu",
          "--compile=False", "--eval_iters=2", "--log_interval=1", f"--block_size={args.block}",
          "--batch_size=8", f"--n_layer={args.layers}", "--n_head=2", f"--n_embd={args.embd}",
          "--max_iters=10", "--lr_decay_iters=10", "--dropout=0.0", "--eval_interval=10",
          "--always_save_checkpoint=True", "--out_dir=out-bench"], work, env)


def sample(work: str, device: str, args) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = _child_env(work, args.checkout, TORCHTPU_CACHE_DIR=cache)
        proc, wall, cpu = _run(
            [sys.executable, "-c", _WRAP, "--init_from=resume", "--out_dir=out-bench",
             f"--device={device}", f"--num_samples={args.samples}",
             f"--max_new_tokens={args.tokens}"], work, env)
    found = [x for x in proc.stderr.splitlines() if x.startswith("NANOGPT_METRICS ")]
    metrics = json.loads(found[-1].split(" ", 1)[1]) if found and device == "tpu" else {}
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), **metrics}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("nanogpt")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--checkout", default=_HERE, help="the torchtpu checkout sampled with")
    parser.add_argument("--json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        prepare(args.nanogpt, work, args)
        rows: dict = {"tpu": [], "cpu": []}
        for r in range(args.rounds):
            for device in rows:
                rows[device].append(sample(work, device, args))
                print(f"round {r} {device}: {rows[device][-1]}", flush=True)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    best = {d: min(v, key=lambda x: x["wall_s"]) for d, v in rows.items()}
    out = {"config": vars(args), "load": load, "rows": rows,
           "ratio_wall": round(best["tpu"]["wall_s"] / best["cpu"]["wall_s"], 2),
           "ratio_cpu_s": round(min(x["cpu_s"] for x in rows["tpu"])
                                / min(x["cpu_s"] for x in rows["cpu"]), 2)}
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
