"""Is persisting tiny eager programs worth it? Compile vs load from the persistent cache.

Runs the same eager workload (many distinct small per-op programs, as eager code over varied
shapes makes them) in fresh processes, side by side in one run:
- ``off``: no persistent cache (every program compiles; nothing written);
- ``cold``: an empty cache (every program compiles and is written);
- ``warm``: the cache ``cold`` filled (every program loads).
Prints wall seconds of the workload in each, the per-program figures (compile, write, load, entry
size) and the ratios ``off / warm`` (what persisting saves) and ``cold / off`` (what writing costs).

    python bench/compile_cache.py [--shapes N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_WORKLOAD = """
import json, sys, time, torch, torchtpu
shapes = [(n, 3) for n in range(1, int(sys.argv[1]) + 1)]
t0 = time.perf_counter()
for shape in shapes:
    x = torch.randn(shape).to("tpu")
    y = (x.exp() * 2 + x.sin()).sum(0).relu()
    y.cpu()
seconds = time.perf_counter() - t0
m = torchtpu.metrics.snapshot()
print(json.dumps({"seconds": seconds, "compiles": m["executable_compiles"],
                  "hits": m["persistent_cache_hits"]}))
"""


def _run(cache: str, shapes: int) -> dict:
    env = {**os.environ, "TORCHTPU_CACHE_DIR": cache, "TORCHTPU_CPU_FALLBACK": "error"}
    out = subprocess.run([sys.executable, "-c", _WORKLOAD, str(shapes)], env=env, check=True,
                         capture_output=True, text=True, timeout=900).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        off = _run("off", args.shapes)
        cold = _run(cache, args.shapes)
        warm = _run(cache, args.shapes)
        entries = list(Path(cache).glob("*.ttpu"))
        size = sum(p.stat().st_size for p in entries)
    programs = max(cold["compiles"], 1)
    print(f"{args.shapes} shapes, {cold['compiles']} programs compiled cold, "
          f"{warm['hits']} loaded warm, {warm['compiles']} compiled warm")
    print(f"{'run':<6}{'seconds':>9}{'ms/program':>12}")
    for name, r in (("off", off), ("cold", cold), ("warm", warm)):
        print(f"{name:<6}{r['seconds']:>9.2f}{1e3 * r['seconds'] / programs:>12.2f}")
    print(f"entries {len(entries)}, {size / max(len(entries), 1) / 1024:.1f} KiB each")
    print(f"off / warm (persisting saves): {off['seconds'] / warm['seconds']:.2f}x")
    print(f"cold / off (writing costs):    {cold['seconds'] / off['seconds']:.2f}x")


if __name__ == "__main__":
    main()
