"""An eager sampling loop over a growing context: tpu against CPU, cold and warm cache.

A 2-layer TinyGPT (``torchtpu.demo.gpt``) samples greedily, fed its whole context each
step and cropped at its block size, as a user's ``generate`` loop is. Each measurement runs in
a child process with its own ``TORCHTPU_CACHE_DIR``: "cold" is the first child on an empty cache
directory, "warm" a second child on the directory the first filled. In each child, CPU and tpu
loops alternate (cpu, tpu, cpu, tpu): the first tpu round is the cold or warm-cache one, the
second runs with every program in memory. Tokens are checked equal to CPU's.
``--no-buckets`` turns off ``compile/eager_buckets.py`` (one program per op per length).

    python bench/eager_growing.py [--tokens 200] [--block 128] [--no-buckets]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _child(tokens: int, block: int, buckets: bool) -> dict:
    import torch

    import torchtpu  # noqa: F401
    from torchtpu import metrics
    from torchtpu.compile import eager_buckets
    from torchtpu.demo.gpt import TinyGPT

    eager_buckets.set_enabled(buckets)

    def sample(model, idx):
        with torch.no_grad():
            for _ in range(tokens):
                logits, _ = model(idx[:, -model.block:])
                nxt = logits[:, -1, :].argmax(-1, keepdim=True)
                idx = torch.cat([idx, nxt], dim=1)
        return idx.cpu()

    torch.manual_seed(0)
    cpu = TinyGPT(65, block, n_layer=2, n_head=4, n_embd=64).eval()
    tpu = TinyGPT(65, block, n_layer=2, n_head=4, n_embd=64).eval()
    tpu.load_state_dict(cpu.state_dict())
    tpu = tpu.to("tpu")
    prompt = torch.tensor([[1]])
    out: dict = {"cpu_s": [], "tpu_s": []}
    expected = None
    for _ in range(2):
        t0 = time.perf_counter()
        expected = sample(cpu, prompt)
        out["cpu_s"].append(time.perf_counter() - t0)
        before = metrics.snapshot()
        t0 = time.perf_counter()
        got = sample(tpu, prompt.to("tpu"))
        out["tpu_s"].append(time.perf_counter() - t0)
        after = metrics.snapshot()
        out.setdefault("programs", []).append(
            sum(after.get(k, 0) - before.get(k, 0)
                for k in ("executable_compiles", "persistent_cache_hits")))
        out["equal"] = bool(torch.equal(got, expected))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--no-buckets", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.tokens, args.block, not args.no_buckets)))
        return
    print(f"loadavg before: {_loadavg()}")
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHTPU_CACHE_DIR=cache)
        cmd = [sys.executable, __file__, "--child", "--tokens", str(args.tokens),
               "--block", str(args.block)] + (["--no-buckets"] if args.no_buckets else [])
        for name in ("cold", "warm"):
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
            if run.returncode:
                sys.exit(f"{name} child failed:\n{run.stderr[-3000:]}")
            r = json.loads(run.stdout.strip().splitlines()[-1])
            cpu = min(r["cpu_s"])
            print(f"{name}: tpu {r['tpu_s'][0]:.2f} s ({r['programs'][0]} programs built or "
                  f"loaded) = {r['tpu_s'][0] / cpu:.2f}x CPU eager {cpu:.2f} s; in memory "
                  f"tpu {r['tpu_s'][1]:.2f} s = {r['tpu_s'][1] / cpu:.2f}x; tokens equal: "
                  f"{r['equal']}")
    print(f"loadavg after: {_loadavg()}")


if __name__ == "__main__":
    main()
