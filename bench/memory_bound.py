"""Memory-bound eager code, where fusion pays: Strict vs DeferAndFuse vs native CPU eager.

Hand-written (plain tensor ops, as users write them) RMSNorm, SwiGLU, softmax, a GELU MLP and an
AdamW-style elementwise update done in place, over float32 tensors of 16-64 MB. Each iteration
runs the code once and waits for its result (``torch.tpu.synchronize()``, which in DeferAndFuse
runs the recording as one program); the table gives ms per iteration and the ratios, all
measured in one process on the same inputs, and checks every result against CPU's.

    python bench/memory_bound.py [--iters 10] [--only rmsnorm,softmax]
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
    Workload("gelu_mlp", _gelu_mlp, ((1024, 512), (512, 4096), (4096, 512))),
    Workload("adamw_update", _adamw_update, ((ROWS, WIDTH),) * 4),
)}


def _inputs(w: Workload) -> list:
    gen = torch.Generator().manual_seed(0)
    out = [torch.randn(s, generator=gen) for s in w.shapes]
    if w.name == "adamw_update":
        out[3] = out[3].abs()  # the second moment is non-negative
    return out


def _run(w: Workload, device: str, mode, iters: int) -> tuple[float, torch.Tensor]:
    """(seconds per iteration, last result on CPU)."""
    base = _inputs(w)
    args = [a.to(device) for a in base]
    context = torch.tpu.set_eager_mode(mode) if mode is not None else contextlib.nullcontext()
    sync = torch.tpu.synchronize if device == "tpu" else (lambda: None)
    with context:
        out = w.fn(*args)  # warm-up: compiles
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            out = w.fn(*args)
            sync()
        elapsed = time.perf_counter() - start
        result = out.cpu()
    return elapsed / iters, result


FORMS = {
    "cpu eager": ("cpu", None),
    "tpu Strict": ("tpu", torch.tpu.EagerMode.DEFER_NEVER),
    "tpu DeferAndFuse": ("tpu", torch.tpu.EagerMode.DEFER_AND_FUSE),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--only", default=",".join(WORKLOADS))
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise SystemExit(f"torchtpu.argument: unknown workloads {unknown}; choose from "
                         f"{list(WORKLOADS)}")
    print(f"platform {torchtpu.runtime.platform.platform()}; {args.iters} iterations after one "
          f"warm-up; load {os.getloadavg()[0]:.2f}")
    print("| workload | MB per tensor | cpu eager ms | Strict ms | DeferAndFuse ms "
          "| DeferAndFuse / Strict | DeferAndFuse / CPU | max abs diff vs CPU |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in names:
        w = WORKLOADS[name]
        res = {form: _run(w, dev, mode, args.iters) for form, (dev, mode) in FORMS.items()}
        cpu, strict, fused = (res[f][0] for f in FORMS)
        ref = res["cpu eager"][1]
        diff = max((res[f][1] - ref).abs().max().item() for f in FORMS)
        mb = max(math.prod(s) for s in w.shapes) * 4 / 2**20
        print(f"| {name} | {mb:.0f} | {cpu * 1e3:.1f} | {strict * 1e3:.1f} | {fused * 1e3:.1f} "
              f"| {strict / fused:.2f}x | {cpu / fused:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
