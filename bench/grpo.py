"""TRL's GRPO step on tpu against CPU, side by side: ``torchtpu/testing/grpo.py`` in fresh
processes, in interleaved rounds: CPU, tpu (TRL's "auto" padding: 16 on tpu), and tpu without
padding (how it ran before ``integrations/trl.py``). Each process starts with the persistent
compile cache its predecessors filled (warm); a step is timed by a Trainer callback, from its
start to its end, and counts the programs it built or loaded.

    python bench/grpo.py [--steps 4] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def one(kind: str, steps: int, folder: str) -> dict:
    device = "cpu" if kind == "cpu" else "tpu"
    extra = ["nopad"] if kind == "tpu-nopad" else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-m", "torchtpu.testing.grpo", device, str(steps),
                           folder, *extra], env=env, capture_output=True, text=True, timeout=900)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("GRPO_RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(lines[-1][len("GRPO_RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    kinds = ("cpu", "tpu", "tpu-nopad")
    rows: dict = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.rounds):
            for kind in kinds:
                out = one(kind, args.steps, folder)
                rows[kind].append([(t["seconds"], t["programs"]) for t in out["timings"]])
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"load {' '.join(load)}; seconds (programs) per step, each round a fresh process")
    print("| run | round | " + " | ".join(f"step {i + 1}" for i in range(args.steps)) + " |")
    print("| --- | --- |" + " ---: |" * args.steps)
    for kind in kinds:
        for r, steps in enumerate(rows[kind]):
            cells = " | ".join(f"{s:.2f} ({n})" for s, n in steps)
            print(f"| {kind} | {r + 1} | {cells} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load": load, "rows": rows}, f)


if __name__ == "__main__":
    main()
