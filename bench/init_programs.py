"""The programs a Llama run compiles before its first whole step, counted per user line.

bench/on_tpu_llama.py's ``whole`` mode with ``--tiny``'s dims (vocab 512, width 128, 2 heads,
MLP 256, sequence 64): the model built on the device, ``train_step``'s step under
``torch.compile(backend="tpu")``, then steps. Each stage prints how many XLA programs JAX
compiled during it (``jax_log_compiles``), by name, its wall seconds and the part of them
JAX spent tracing, lowering and compiling (``torchtpu.metrics``). On a chip each costs ~0.5-1 s
of warm-up (compile2's count, bench/RESULTS.md); the names say which line made which.

    python bench/init_programs.py [--layers 2] [--steps 2] [--real]

Run in a fresh process with an empty ``TORCHTPU_CACHE_DIR`` (made here unless set), so that no
program loads from an earlier run's cache. To compare with another checkout, run this file with
``PYTHONPATH`` at that checkout's root.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import re
import sys
import tempfile
import time

os.environ.setdefault("TORCHTPU_CACHE_DIR", tempfile.mkdtemp(prefix="init_programs_"))

import jax  # noqa: E402
import torch  # noqa: E402

import torchtpu  # noqa: E402
from torchtpu.testing.llama import Llama, LlamaConfig, train_step  # noqa: E402

_FINISHED = re.compile(r"Finished XLA compilation of (.*?) in [0-9.e-]+ sec")


class _Names(logging.Handler):
    """The names of the programs JAX compiles, in order."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        found = _FINISHED.match(record.getMessage())
        if found:
            self.names.append(found.group(1))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--real", action="store_true",
                   help="the chip row's dims (vocab 32768, width 1024, 8 heads, MLP 2816, "
                        "sequence 1024): programs made per shape past a size bound show here")
    args = p.parse_args(argv)
    names = _Names()
    for logger in ("jax._src.dispatch", "jax._src.interpreters.pxla", "jax._src.compiler"):
        logging.getLogger(logger).setLevel(logging.DEBUG)
    logging.getLogger("jax").addHandler(names)
    jax.config.update("jax_log_compiles", True)
    # Silence the handler's echo on stderr: only the counts are printed.
    logging.getLogger("jax").propagate = False
    print(f"torchtpu {torchtpu.__file__}, jax {jax.__version__}, {jax.devices()[0].platform}",
          flush=True)
    counts, seen = {}, 0
    last = [time.perf_counter(), torchtpu.metrics.snapshot()]
    print(f"{'stage':22s} {'programs':>8s} {'wall s':>7s} {'JAX s':>6s}  names", flush=True)

    def stage(label: str) -> None:
        nonlocal seen
        got = names.names[seen:]
        seen = len(names.names)
        counts[label] = len(got)
        now, snap = time.perf_counter(), torchtpu.metrics.snapshot()
        jax_s = sum(snap.get(k, 0) - last[1].get(k, 0)
                    for k in ("trace_seconds", "lower_seconds", "compile_seconds"))
        wall = now - last[0]
        named = ", ".join(f"{n} x{k}" if k > 1 else n
                          for n, k in collections.Counter(got).most_common())
        print(f"{label:22s} {len(got):8d} {wall:7.2f} {jax_s:6.2f}  {named}", flush=True)
        last[:] = [time.perf_counter(), torchtpu.metrics.snapshot()]

    config = LlamaConfig(layers=args.layers) if args.real else \
        LlamaConfig(vocab=512, dim=128, heads=2, hidden=256, layers=args.layers, seq=64)
    torch.manual_seed(0)
    with torch.device("tpu"):
        model = Llama(config)
    stage("init: Llama(config)")
    step, _ = train_step(model)
    step = torch.compile(step, backend="tpu")
    stage("init: AdamW, compile")
    ids = torch.randint(config.vocab, (1 if args.real else 4, config.seq + 1),
                        generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1].contiguous().to("tpu"), ids[:, 1:].contiguous().to("tpu")
    stage("init: ids to tpu")
    torch.tpu.synchronize()
    stage("init: synchronize")
    # Eager calls outside the captured step run in Strict, as on_tpu_llama.py's whole mode runs.
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER):
        for i in range(args.steps):
            loss = step(x, y).item()
            stage(f"step {i + 1}")
            print(f"{'':22s} loss {loss:.4f}", flush=True)
    init = sum(v for k, v in counts.items() if k.startswith("init"))
    print(f"programs: init {init}, first step {counts.get('step 1', 0)} (its whole-step program "
          f"included)", flush=True)
    return counts


if __name__ == "__main__":
    main(sys.argv[1:])
