"""Compile time against depth: a Llama of 2, 8 and 32 layers, with and without scan.

The registry's Llama-3.2 row (``bench/registry.py``: hidden 64, 4 heads, 2 KV heads, vocab 256,
sequence 32, batch 4) with ``num_hidden_layers`` set to each depth. One step is the loss and its
gradients (forward + backward, no optimizer: the optimizer's per-parameter work grows with depth
in every form alike), four ways:
- ``compile``: ``torch.compile(loss, backend="tpu")`` then ``loss.backward()`` (Dynamo's
  forward and backward graphs, each one XLA program);
- ``scan``: the same after ``torchtpu.scan_layers.patch(model)``: the decoder layers are one
  ``torch._higher_order_ops.scan`` body, one XLA while loop forward and backward;
- ``jax``: the JAX port (``bench/jax_models.py``, the torch model's weights) under one
  ``jax.jit(jax.value_and_grad(loss))``, the layers unrolled;
- ``jax-scan``: the same port with the layers in one ``jax.lax.scan``.

Each (form, depth) runs in a fresh process with an empty ``TORCHTPU_CACHE_DIR`` (so JAX's
persistent cache is cold too). "compile s" is the first step, call to gradients on the host:
Dynamo's tracing, AOTAutograd, lowering and XLA's compile; its parts are Dynamo's own timers
(``torch._dynamo.utils.compilation_time_metrics``: the backend call, inside Dynamo's total, holds
AOTAutograd, the forward's lowering and its XLA compile; the backward's are in the first
``backward()`` and so in the remainder). "step ms" is the median of the later steps.
Compile seconds move with the machine's load: read the 32/2 ratio, taken within one run.

    python bench/compile_depth.py [--depths 2 8 32] [--forms compile scan jax jax-scan]
                                  [--steps 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from torchtpu.testing import hf_rows

_spec = importlib.util.spec_from_file_location(
    "bench_registry", os.path.join(os.path.dirname(os.path.abspath(__file__)), "registry.py"))
registry = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # (dataclasses)
_spec.loader.exec_module(registry)

FORMS = ("compile", "scan", "jax", "jax-scan")
# Dynamo's timers: its whole compile of a frame, and inside it the backend's (our) call.
_DYNAMO_TOTAL, _BACKEND = "_compile.compile_inner", "OutputGraph.call_user_compiler"


def _batches(n: int) -> list:
    gen = torch.Generator().manual_seed(0)
    draw = hf_rows.tokens(hf_rows.HF_VOCAB, hf_rows.HF_SEQ, hf_rows.HF_BATCH)
    return [draw(gen) for _ in range(n)]


def _torch_steps(form: str, depth: int, batches: list) -> list:
    import torchtpu

    model = hf_rows.hf("llama-3.2", num_hidden_layers=depth)().to("tpu")
    if form == "scan":
        torchtpu.scan_layers.patch(model)

    def loss(x, y):
        return F.cross_entropy(model(input_ids=x, use_cache=False).logits.flatten(0, 1),
                               y.flatten())

    compiled = torch.compile(loss, backend="tpu")
    data = [(x.to("tpu"), y.to("tpu")) for x, y in batches]
    torch.tpu.synchronize()

    def step(i: int) -> float:
        model.zero_grad(set_to_none=True)
        value = compiled(*data[i])
        value.backward()
        next(model.parameters()).grad.cpu()  # the gradients are on the host's hands
        return value.item()
    return [_timed(step, i) for i in range(len(data))]


def _jax_steps(form: str, depth: int, batches: list) -> list:
    import jax
    import jax.numpy as jnp

    params, loss = registry.jm.port(hf_rows.hf("llama-3.2", num_hidden_layers=depth)(),
                                    scan=form == "jax-scan")
    grad = jax.jit(jax.value_and_grad(loss))
    data = [(jnp.asarray(x.numpy()), jnp.asarray(y.numpy())) for x, y in batches]

    def step(i: int) -> float:
        value, g = grad(params, *data[i])
        jax.block_until_ready(g)
        return float(value)
    return [_timed(step, i) for i in range(len(data))]


def _timed(step, i: int) -> list:
    start = time.perf_counter()
    value = step(i)
    return [time.perf_counter() - start, value]


def child(form: str, depth: int, steps: int) -> dict:
    """One (form, depth) in this process: every step's seconds and loss, Dynamo's timers."""
    from torch._dynamo.utils import compilation_time_metrics

    run = _jax_steps if form.startswith("jax") else _torch_steps
    timed = run(form, depth, _batches(steps + 1))
    timers = {k: sum(compilation_time_metrics.get(k, [])) for k in (_DYNAMO_TOTAL, _BACKEND)}
    return {"seconds": [s for s, _ in timed], "losses": [v for _, v in timed], **timers}


def _fresh_process(form: str, depth: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHTPU_CACHE_DIR": cache}
        out = subprocess.run([sys.executable, __file__, "--child", form, str(depth),
                              "--steps", str(steps)], env=env, text=True,
                             capture_output=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"{form} at depth {depth} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", nargs="+", type=int, default=[2, 8, 32])
    parser.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.steps)))
        return
    before = open("/proc/loadavg").read().split()[0]
    # Depth-major: each depth's forms run close together in time, under the same load.
    results = {(f, d): _fresh_process(f, d, args.steps) for d in args.depths for f in args.forms}
    after = open("/proc/loadavg").read().split()[0]
    print(f"Llama-3.2 row (hidden 64, seq {hf_rows.HF_SEQ}, batch {hf_rows.HF_BATCH}), "
          f"loss + gradients; 1-minute load {before} -> {after}")
    print("| form | layers | compile s | Dynamo s | backend s | step ms | loss |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (form, depth), r in results.items():
        dynamo = f"{r[_DYNAMO_TOTAL]:.2f}" if not form.startswith("jax") else ""
        backend = f"{r[_BACKEND]:.2f}" if not form.startswith("jax") else ""
        print(f"| {form} | {depth} | {r['seconds'][0]:.2f} | {dynamo} | {backend} | "
              f"{statistics.median(r['seconds'][1:]) * 1e3:.2f} | {r['losses'][0]:.5f} |")
    lo, hi = min(args.depths), max(args.depths)
    for form in args.forms:
        if (form, lo) in results and (form, hi) in results:
            ratio = results[form, hi]["seconds"][0] / results[form, lo]["seconds"][0]
            print(f"{form}: compile {hi} / {lo} layers = {ratio:.2f}x")
    for depth in args.depths:
        if ("compile", depth) in results and ("scan", depth) in results:
            step = {f: statistics.median(results[f, depth]["seconds"][1:])
                    for f in ("compile", "scan")}
            print(f"{depth} layers: scan step / unscanned step = "
                  f"{step['scan'] / step['compile']:.2f}")


if __name__ == "__main__":
    main()
