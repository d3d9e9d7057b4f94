"""First steps of a new process, cold persistent cache against warm, side by side in one run.

The TinyGPT training step of ``bench/compile.py`` (2 layers, width 64, sequence 32, batch 8,
AdamW with clipping; same weights and batches), three ways:
- ``whole``: ``torch.compile(step, backend="tpu")``, the whole step as one captured program
  (``compile/whole_step.py``; default AdamW);
- ``graph``: one eager warm-up step, then the step captured with ``torch.tpu.graph`` and
  replayed (``AdamW(capturable=True)``); its first step is the capture and the first replay;
- ``dynamo``: the same compile as Dynamo's graphs (``options={"whole_step": False}``), found
  in AOTAutogradCache when warm (``compile/graph_cache.py``; Dynamo still traces);
- ``defer``: the eager step in DeferAndFuse (``torch.tpu.set_eager_mode``): a few fused programs
  a step, found by their recordings' structure (``eager/fused_program.keyed``) when warm;
- ``precompile``: the model's loss compiled (Dynamo's forward and backward graphs), the
  clipping and AdamW eager, with PyTorch's precompile on (``caching_precompile``; the
  function's bytecode, guards and graphs saved by ``torch.compiler.save_cache_artifacts()``
  after the steps): warm, nothing is traced. Its "graphs" column is the compiled forward and
  the backward alone, without the eager optimizer step.

Each runs in a fresh process with an empty ``TORCHTPU_CACHE_DIR`` (cold), then in another fresh
process with the directory the first one filled (warm). A step is timed from its call to its
loss on the host, in wall seconds and in the process's CPU seconds (all threads: steadier than
wall time on a loaded machine); building the model and optimizer comes before it and is timed
apart (``torch.optim`` imports Dynamo: seconds, in eager code too).

    python bench/warm_start.py [--kinds whole graph dynamo]

Before/after a change: the same script with ``PYTHONPATH`` at each tree, alternated (each run's
children import the tree its parent was given).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

import torchtpu
from torchtpu.runtime import platform

_spec = importlib.util.spec_from_file_location(
    "bench_compile", os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile.py"))
cb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cb)

KINDS = ("whole", "graph", "dynamo", "defer", "precompile")


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(start: tuple[float, float]) -> list[float]:
    wall, cpu = _clock()
    return [wall - start[0], cpu - start[1]]


def first_steps(kind: str) -> dict:
    """Child process: the setup and the first two training steps of one kind, timed."""
    batches = [(x.to("tpu"), y.to("tpu")) for x, y in cb._batches(3)]
    start = _clock()
    model = cb._model().to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=cb.LR, betas=cb.BETAS, eps=cb.EPS,
                            weight_decay=cb.WD, capturable=kind == "graph")
    graphs: list = []
    if kind == "graph":
        run = _graphed(model, opt, batches[0])
    elif kind == "precompile":
        torch._dynamo.config.caching_precompile = True
        run = _loss_compiled(model, opt, graphs)
    elif kind == "defer":
        run = _call(cb._step, model, opt)
    else:
        run = torch.compile(cb._step, backend="tpu", options={"whole_step": kind == "whole"})
        run = _call(run, model, opt)
    setup = _since(start)
    steps = []
    with (torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE) if kind == "defer"
          else contextlib.nullcontext()):
        for x, y in batches[1:]:
            start = _clock()
            run(x, y)
            steps.append(_since(start))
    m = torchtpu.metrics.snapshot()
    if kind == "precompile":
        torch.compiler.save_cache_artifacts()
    return {"setup": setup, "steps": steps, "graphs": graphs,
            "compiles": m["executable_compiles"],
            "hits": m["persistent_cache_hits"], "by_key": m.get("programs_loaded_by_key", 0)}


def _loss(model, x, y):
    return model(x, y)[1]


def _loss_compiled(model, opt, graphs: list):
    """The step with only the loss compiled; graphs gets each call's forward and backward time."""
    loss_of = torch.compile(_loss, backend="tpu")

    def run(x, y):
        start = _clock()
        loss = loss_of(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.tpu.synchronize()
        graphs.append(_since(start))
        torch.nn.utils.clip_grad_norm_(model.parameters(), cb.MAX_NORM)
        opt.step()
        return loss.item()

    return run


def _call(compiled, model, opt):
    return lambda x, y: compiled(model, opt, x, y).item()


def _graphed(model, opt, warmup: tuple):
    """CUDA Graphs' whole-network pattern: a warm-up step (in the setup), then a capture at
    the first call and a replay at every call."""
    static_x, static_y = (t.clone() for t in warmup)
    cb._step(model, opt, static_x, static_y).item()
    state: dict = {}

    def run(x, y):
        static_x.copy_(x)
        static_y.copy_(y)
        if not state:
            g = torch.tpu.TPUGraph()
            opt.zero_grad(set_to_none=True)
            with torch.tpu.graph(g):
                _, loss = model(static_x, static_y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cb.MAX_NORM)
                opt.step()
            state.update(g=g, loss=loss)
        state["g"].replay()
        return state["loss"].item()

    return run


def _fresh_process(cache: str, kind: str) -> dict:
    env = {**os.environ, "TORCHTPU_CACHE_DIR": cache}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # set in this process by graph_cache.place
    out = subprocess.run([sys.executable, __file__, "--child", kind], env=env, text=True,
                         capture_output=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"the {kind} child failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(first_steps(args.child)))
        return
    load = os.getloadavg()[0]
    results = {}
    for kind in args.kinds:
        with tempfile.TemporaryDirectory() as cache:
            results[kind] = _fresh_process(cache, kind), _fresh_process(cache, kind)
    print(f"TinyGPT {cb.LAYERS} layers, width {cb.WIDTH}, seq {cb.BLOCK}, batch {cb.BATCH}, "
          f"AdamW + clipping; platform {platform.platform()}; load "
          f"{load:.2f} -> {os.getloadavg()[0]:.2f}; seconds wall / CPU")
    print(f"{'run':<11}{'cache':<6}{'setup':>13}{'step 1':>14}{'step 2':>13}{'compiles':>10}"
          f"{'JAX hits':>10}{'by key':>8}")
    for kind, (cold, warm) in results.items():
        for name, r in (("cold", cold), ("warm", warm)):
            print(f"{kind:<11}{name:<6}{_pair(r['setup']):>13}{_pair(r['steps'][0]):>14}"
                  f"{_pair(r['steps'][1]):>13}{r['compiles']:>10}{r['hits']:>10}"
                  f"{r['by_key']:>8}")
        ratios = [c / w for c, w in zip(cold["steps"][0], warm["steps"][0])]
        both = [sum(s[i] for s in cold["steps"]) / sum(s[i] for s in warm["steps"])
                for i in (0, 1)]
        print(f"{kind:<11}cold / warm: first step {ratios[0]:.1f}x wall, {ratios[1]:.1f}x CPU; "
              f"first two steps {both[0]:.1f}x wall, {both[1]:.1f}x CPU")
        if cold["graphs"]:
            graphs = [c / w for c, w in zip(cold["graphs"][0], warm["graphs"][0])]
            print(f"{kind:<11}graphs (compiled forward + backward) of the first step: "
                  f"{_pair(cold['graphs'][0])} cold, {_pair(warm['graphs'][0])} warm: "
                  f"{graphs[0]:.1f}x wall, {graphs[1]:.1f}x CPU")


def _pair(seconds: list) -> str:
    return f"{seconds[0]:.2f} / {seconds[1]:.2f}"


if __name__ == "__main__":
    main()
