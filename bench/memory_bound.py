"""Memory-bound eager code, where fusion pays: Strict vs DeferAndFuse vs native CPU eager.

Hand-written (plain tensor ops, as users write them) RMSNorm, SwiGLU, softmax, a GELU MLP and an
AdamW-style elementwise update done in place, over float32 tensors of 16-64 MB. Each iteration
runs the code once and waits for its result (``torch.tpu.synchronize()``, which in DeferAndFuse
runs the recording as one program); the table gives ms per iteration and the ratios, all
measured in one process on the same inputs, and checks every result against CPU's.

    python bench/memory_bound.py [--iters 5] [--rounds 3] [--only rmsnorm,softmax] [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable

import torch

import torchtpu

ROWS, WIDTH = 4096, 2048  # 8M float32 = 32 MB per activation


def _rmsnorm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _swiglu(g, u):
    return g * torch.sigmoid(g) * u


def _softmax(x):
    e = (x - x.amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)


def _gelu(h):
    return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h * h * h)))


def _gelu_mlp(x, w1, w2):
    return _gelu(x @ w1) @ w2


def _adamw_update(p, g, m, v, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0.01, step=10):
    # What a hand-written (or foreach-less) AdamW does per parameter, in place.
    p.mul_(1 - lr * wd)
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = (v / (1 - b2 ** step)).sqrt_().add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - b1 ** step))
    return p


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    fn: Callable
    shapes: tuple  # one per input


WORKLOADS = {w.name: w for w in (
    Workload("rmsnorm", _rmsnorm, ((ROWS, WIDTH), (WIDTH,))),
    Workload("swiglu", _swiglu, ((ROWS, WIDTH), (ROWS, WIDTH))),
    Workload("softmax", _softmax, ((ROWS, WIDTH),)),
    # Narrow in and out, so that the matmuls stay small beside the 32 MB hidden activation.
    Workload("gelu_mlp", _gelu_mlp, ((ROWS, 64), (64, WIDTH), (WIDTH, 64))),
    Workload("adamw_update", _adamw_update, ((ROWS, WIDTH),) * 4),
)}


def _inputs(w: Workload) -> list:
    gen = torch.Generator().manual_seed(0)
    out = [torch.randn(s, generator=gen) for s in w.shapes]
    if w.name == "adamw_update":
        out[3] = out[3].abs()  # the second moment is non-negative
    return out


def _prepared(w: Workload, device: str, mode, compiled: bool) -> Callable[[int], tuple]:
    """A timer for w in one form: called with n, runs n iterations, returns (s/iter, result)."""
    args = [a.to(device) for a in _inputs(w)]
    fn = torch.compile(w.fn, backend="tpu") if compiled else w.fn
    sync = torch.tpu.synchronize if device == "tpu" else (lambda: None)
    context = (lambda: torch.tpu.set_eager_mode(mode)) if mode else contextlib.nullcontext

    def timed(n: int) -> tuple[float, torch.Tensor]:
        with context():
            start = time.perf_counter()
            for _ in range(n):
                out = fn(*args)
                sync()
            elapsed = time.perf_counter() - start
            return elapsed / max(n, 1), out

    timed(1)  # compiles
    return timed


FORMS = {
    "cpu eager": ("cpu", None, False),
    "Strict": ("tpu", torch.tpu.EagerMode.DEFER_NEVER, False),
    "DeferAndFuse": ("tpu", torch.tpu.EagerMode.DEFER_AND_FUSE, False),
    # The same code as one Dynamo graph through the same lowering table: what one fused
    # program of it reaches with no per-op work at all.
    "torch.compile": ("tpu", None, True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=5, help="iterations per round")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds over the forms, interleaved; each form's best round counts")
    parser.add_argument("--only", default=",".join(WORKLOADS))
    parser.add_argument("--threads", type=int, help="torch's CPU threads (torch.set_num_threads)")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise SystemExit(f"torchtpu.argument: unknown workloads {unknown}; choose from "
                         f"{list(WORKLOADS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"platform {torchtpu.runtime.platform.platform()}; best of {args.rounds} rounds of "
          f"{args.iters} iterations after one warm-up; torch CPU threads "
          f"{torch.get_num_threads()}; load {os.getloadavg()[0]:.2f}")
    print("| workload | " + " | ".join(f"{f} ms" for f in FORMS)
          + " | DeferAndFuse / Strict | DeferAndFuse / CPU | DeferAndFuse / compile "
          "| max rel. diff vs CPU |")
    print("| --- |" + " ---: |" * (len(FORMS) + 4))
    failures = []
    for name in names:
        w = WORKLOADS[name]
        timers = {}
        for f, spec in FORMS.items():
            try:
                timers[f] = _prepared(w, *spec)
            except Exception as e:  # the reference form may fail; the eager ones must not
                if f != "torch.compile":
                    raise
                lines = str(e).splitlines()
                said = [x for x in lines if "torchtpu." in x] or lines[-1:]
                failures.append(f"{name}, {f}: {said[0]}")
        best, results = dict.fromkeys(timers, float("inf")), {}
        for _ in range(args.rounds):
            for f, timed in timers.items():
                sec, results[f] = timed(args.iters)
                best[f] = min(best[f], sec)
        ref = results["cpu eager"]
        diff = max(((results[f].cpu() - ref).abs().max() / ref.abs().max()).item()
                   for f in timers)
        fused = best["DeferAndFuse"]
        ms = [f"{best[f] * 1e3:.1f}" if f in best else "fails" for f in FORMS]
        compiled = f"{best['torch.compile'] / fused:.2f}x" if "torch.compile" in best else "-"
        print(f"| {name} | " + " | ".join(ms)
              + f" | {best['Strict'] / fused:.2f}x | {best['cpu eager'] / fused:.2f}x "
              f"| {compiled} | {diff:.1e} |")
    for line in failures:
        print(line)


if __name__ == "__main__":
    main()
