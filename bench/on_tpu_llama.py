"""The chip suite's Llama row (issue 35): ``torchtpu.testing.llama``'s training step in every mode
torchtpu has, beside the same step written in JAX, on one chip in one process.

    TORCHTPU_PLATFORM=tpu python bench/on_tpu_llama.py [--lengths 1024,2048]
        [--modes jax,jax-splash,whole,model,strict,defer] [--config suite|issue50] [--layers 12]
        [--read-every 1] [--profile whole,jax] [--json out.json]
    python bench/on_tpu_llama.py --tiny --tokens 256 --lengths 64   # a smoke run on CPU

Configs (``--config``): ``suite``, issue 35's model (12 blocks, width 1024, 8 heads of 128, MLP
2816, vocab 32768: 221.3 M parameters); ``issue50``, issue 50's ~450 M Llama (12 blocks, width
1536, 12 heads of 128, MLP 4096 = 8/3 x width, vocab 32768, untied head: 440.4 M parameters).
``--layers`` changes either's depth; ``--tiny`` shrinks either to vocab 512, width 128, 2 heads,
MLP 256. The JAX twins run the same config.

Modes, each on a fresh model (the previous one's memory given back first):
- ``jax``: ``bench/tpu_llama.py``'s step, one ``jax.jit`` with donated parameters and moments,
  naive attention; ``jax-splash``: the same with JAX's splash kernel at the blocks
  ``bench/tpu_attention.py`` found fastest on v5e (512 x 512, fused backward);
- ``whole``: ``torch.compile(step, backend="tpu")``, the whole step as one captured program;
- ``model``: ``torch.compile(model, backend="tpu")`` with backward, clipping and AdamW eager;
- ``strict``: eager, one op at a time (the default mode);
- ``defer``: eager under DeferAndFuse (a step flushes at its ``loss.item()``; a step whose loss
  is not read, with ``--read-every`` over 1, at the next step's first op: its programs launched
  while the host records the next).

The loop is the one users write: the loss read on the host after every step (``--read-every 1``,
the default: ``loss.item()``, or ``float(loss)`` in the JAX twins), or after every Nth. Every mode
reads alike, so the ratios compare like loops. A timed round is a whole number of reads: its
steps are ``--steps`` rounded up to a multiple of N, its last step read, and a round's ms/step is
its wall over its steps (reads included). The setting is in the table's header and each JSON row
(``read_every``, ``steps_per_round``; ``read_ms``: the host's ms per step waiting in reads).

Each prints ms/step (median of the rounds that loaded no program; a mode's rounds go on past
``--budget-s`` until one loaded none), the host's time issuing a step (inside the step call: near
ms/step, the host is what a step waits for), MFU against the chip's bf16 peak with nanoGPT's flop
count (none on CPU), warm-up seconds (model made to the end of the first three steps, compiles
included; ``warmup_split`` says where its seconds went, from ``torchtpu.metrics``' timers: making
the model and inputs, then over the three steps Dynamo's tracing, AOTAutograd, torchtpu's captures,
JAX's tracing and lowering to StableHLO, XLA's compiles (and their count), the host's waits for the
steps' results, and the rest), peak device memory (``torch.tpu.max_memory_allocated``, PJRT's peak
on a TPU; JAX: the device's ``peak_bytes_in_use``, which no reset starts again: the process's peak
so far, so a twin listed after other modes reports theirs if higher; and XLA's memory analysis of
the step) beside PyTorch eager's floor for the same model and batch
(``torchtpu.testing.memory_floor``: fp32 parameters, gradients and AdamW's two moments, plus what
autograd saves in one forward, counted on CPU under ``FakeTensorMode`` at the full batch: no
scaling) and the peak over that floor, and per timed step the executable compiles, persistent-cache
hits, program executions and bytes read to the host (``torchtpu.metrics`` deltas; the JAX twins'
reads are not torchtpu's and show 0). Batch x length is 8,192 tokens at every length
(``--tokens``).
"""

from __future__ import annotations

import argparse
import collections
import gc
import glob
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import torch

import torchtpu
from torchtpu.testing.llama import Llama, LlamaConfig, model_flops, train_step
from torchtpu.testing.memory_floor import eager_floor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax_models  # noqa: E402  (bench/ is no package)
import tpu_llama  # noqa: E402

PEAKS = {"TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v6 lite": 918e12, "TPU v5p": 459e12,
         "TPU v4": 275e12}
TOKENS = 8192
COUNTERS = ("executable_compiles", "persistent_cache_hits", "executions", "device_to_host_bytes")
# The models (LlamaConfig's fields that differ from its defaults, issue 35's suite model).
CONFIGS = {"suite": {},
           # Issue 50's ~450 M Llama: head dim 128, SwiGLU's 8/3 x width, untied head.
           "issue50": {"dim": 1536, "heads": 12, "hidden": 4096, "layers": 12, "vocab": 32768}}
TINY = {"vocab": 512, "dim": 128, "heads": 2, "hidden": 256}
# The warm-up's phases, each a torchtpu.metrics figure (their own seconds, without overlap).
PHASES = ("dynamo", "aot", "capture", "trace", "lower", "compile")


def _counters() -> dict:
    snap = torchtpu.metrics.snapshot()
    return {k: snap.get(k, 0) for k in COUNTERS}


class _Warmup:
    """Where a warm-up's seconds go: ``made()`` once the model and inputs exist, ``read(x)``
    for each first step's host read (the wait for its result), ``split()`` at the end."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.at = torchtpu.metrics.snapshot()
        self.wait = 0.0

    def made(self) -> None:
        self.t_made, self.at_made = time.perf_counter(), torchtpu.metrics.snapshot()

    def read(self, read, x) -> float:
        t = time.perf_counter()
        value = read(x)
        self.wait += time.perf_counter() - t
        return value

    def split(self) -> tuple[float, dict]:
        """(warm-up seconds, its split)."""
        end, now = torchtpu.metrics.snapshot(), time.perf_counter()

        def delta(a: dict, b: dict, k: str) -> float:
            return b.get(k, 0) - a.get(k, 0)

        out = {"init_s": self.t_made - self.t0,
               "init_compiles": delta(self.at, self.at_made, "executable_compiles")}
        for p in PHASES:
            out[f"{p}_s"] = delta(self.at_made, end, f"{p}_seconds")
        out["compiles"] = delta(self.at_made, end, "executable_compiles")
        # (part of compile_s: serializing cache entries on the compiling thread; the writer
        # thread's compressing, reading back and writing them overlaps the rest: not in the sum)
        out["cache_write_s"] = delta(self.at_made, end, "cache_write_seconds")
        out["cache_writer_s"] = delta(self.at_made, end, "cache_writer_seconds")
        out["wait_s"] = self.wait
        out["other_s"] = now - self.t_made - self.wait - sum(out[f"{p}_s"] for p in PHASES)
        return now - self.t0, out


def _timed_rounds(run_step, read, steps: int, rounds: int, budget_s: float,
                  read_every: int = 1) -> dict:
    """The timed rounds: each runs ``steps`` rounded up to a multiple of ``read_every`` steps,
    ``read``-ing every ``read_every``-th step's result on the host (its last step's among them,
    so the round's wall holds all its device work). A dict of: ``rounds_ms``, each round's wall
    over its steps; ``issue_ms``, the host's ms per step inside ``run_step`` (near the round's
    figure, the host is what the step waits for); ``read_ms``, its ms per step inside ``read``;
    ``per_step``, the counters per step over all rounds; ``rounds_loads``, the programs each
    round loaded; ``steps_per_round``, ``reads``. Stops early past budget_s, keeping at least one
    round that loaded no program (a compile inside the only timed round made session 19's
    DeferAndFuse row 9 s a step: 5 steps and one ~45 s compile)."""
    steps = -(-max(steps, 1) // read_every) * read_every
    times, issue, waits, loads, before = [], [], [], [], _counters()
    t_all = time.perf_counter()
    done = reads = 0
    for _ in range(rounds):
        t = time.perf_counter()
        host = wait = 0.0
        at = _counters()
        for i in range(1, steps + 1):
            t_step = time.perf_counter()
            out = run_step()
            host += time.perf_counter() - t_step
            if i % read_every == 0:
                t_read = time.perf_counter()
                read(out)
                wait += time.perf_counter() - t_read
                reads += 1
        times.append((time.perf_counter() - t) / steps * 1e3)
        issue.append(host / steps * 1e3)
        waits.append(wait / steps * 1e3)
        end = _counters()
        loads.append(sum(end[k] - at[k] for k in ("executable_compiles", "persistent_cache_hits")))
        done += steps
        if time.perf_counter() - t_all > budget_s and 0 in loads:
            break
    after = _counters()
    return {"rounds_ms": times, "issue_ms": issue, "read_ms": waits,
            "per_step": {k: (after[k] - before[k]) / done for k in COUNTERS},
            "rounds_loads": loads, "steps_per_round": steps, "reads": reads}


def _jax_row(c, batch: int, steps: int, rounds: int, budget_s: float, splash: bool,
             profile: bool, read_every: int = 1) -> dict:
    warmup = _Warmup()
    attend = tpu_llama.splash_attention(512, 512, True) if splash else tpu_llama.naive_attention
    fn = jax.jit(jax_models.train_step(tpu_llama.loss_fn(c, attend), 3e-4, (0.9, 0.999), 1e-8,
                                       0.1, 1.0), donate_argnums=(0, 1, 2))
    params = tpu_llama.init(c, jax.random.key(0))
    state = [params, jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params),
             jnp.zeros((), jnp.float32)]
    ids = jax.random.randint(jax.random.key(1), (batch, c.seq + 1), 0, c.vocab)
    x, y = ids[:, :-1], ids[:, 1:]
    jax.block_until_ready((state, x, y))
    warmup.made()
    compiled = fn.lower(*state, x, y).compile()
    mem = compiled.memory_analysis()

    def run_step():
        *state[:4], loss = compiled(*state, x, y)
        return loss

    first = [warmup.read(float, run_step()) for _ in range(3)]
    warm, split = warmup.split()
    timed = _timed_rounds(run_step, float, steps, rounds, budget_s, read_every)
    top = _profile(run_step, float) if profile else None
    stats = jax.devices()[0].memory_stats() or {}
    row = {"warmup_s": warm, "warmup_split": split, **timed, "first_losses": first,
           "peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
           "xla_argument_gib": mem.argument_size_in_bytes / 2**30,
           "xla_temp_gib": mem.temp_size_in_bytes / 2**30, "top_ops": top}
    return row


# The profile's longest ops kept: 30 named only ~1/3 of the whole step's 104 ms at 2048 on the
# chip (bench/RESULTS.md, whole12); the rest of its gap to the twin is in smaller ops.
TOP_OPS = 100


def _profile(run_step, read) -> list:
    """The device's ops of one step, summed by HLO op (name, category): the TOP_OPS longest."""
    directory = tempfile.mkdtemp(prefix="on_tpu_llama_")
    try:
        jax.profiler.start_trace(directory)
        try:
            read(run_step())
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(f"{directory}/plugins/profile/*/*.xplane.pb")
        data = jax.profiler.ProfileData.from_file(files[0])
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    by = collections.defaultdict(lambda: [0, 0.0, ""])
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            if line.name != "XLA Ops":
                continue
            for e in line.events:
                stats = dict(e.stats)
                what = stats.get("hlo_category") or stats.get("category") or ""
                entry = by[(e.name, str(what))]
                entry[0] += 1
                entry[1] += e.end_ns - e.start_ns
                entry[2] = entry[2] or str(stats.get("long_name", ""))[:200]
    top = sorted(by.items(), key=lambda kv: -kv[1][1])[:TOP_OPS]
    return [{"op": name, "category": cat, "runs": n, "ms": ns / 1e6, "hlo": text}
            for (name, cat), (n, ns, text) in top]


def _torch_row(mode: str, c: LlamaConfig, batch: int, steps: int, rounds: int,
               budget_s: float, profile: bool, read_every: int = 1) -> dict:
    torch.tpu.reset_peak_memory_stats()
    warmup = _Warmup()
    torch.manual_seed(0)
    with torch.device("tpu"):
        model = Llama(c)
    if mode == "model":
        model = torch.compile(model, backend="tpu")
    step, opt = train_step(model)
    if mode == "whole":
        step = torch.compile(step, backend="tpu")
    ids = torch.randint(c.vocab, (batch, c.seq + 1), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1].contiguous().to("tpu"), ids[:, 1:].contiguous().to("tpu")
    torch.tpu.synchronize()
    warmup.made()
    eager = torch.tpu.EagerMode.DEFER_AND_FUSE if mode == "defer" else \
        torch.tpu.EagerMode.DEFER_NEVER
    with torch.tpu.set_eager_mode(eager):
        first = [warmup.read(lambda t: t.item(), step(x, y)) for _ in range(3)]
        warm, split = warmup.split()
        timed = _timed_rounds(lambda: step(x, y), lambda t: t.item(), steps, rounds, budget_s,
                              read_every)
        top = _profile(lambda: step(x, y), lambda t: t.item()) if profile else None
    row = {"warmup_s": warm, "warmup_split": split, **timed, "first_losses": first,
           "peak_gib": torch.tpu.max_memory_allocated() / 2**30,
           "top_ops": top, **_captured_memory(step)}
    return row


def _captured_memory(step) -> dict:
    """XLA's memory analysis of a whole step's captured program, as the JAX rows report theirs
    (empty where the program was not compiled through torchtpu's warm path); reaches into
    ``WholeStep``, as a bench may."""
    for s in getattr(step, "_steps", {}).values():
        compiled = getattr(s.captured._fn, "_call", None)
        if hasattr(compiled, "memory_analysis"):
            mem = compiled.memory_analysis()
            return {"xla_argument_gib": mem.argument_size_in_bytes / 2**30,
                    "xla_temp_gib": mem.temp_size_in_bytes / 2**30}
    return {}


_FLOORS: dict = {}


def floor(c: LlamaConfig, batch: int):
    """PyTorch eager's floor for ``c`` at ``batch`` x ``c.seq`` tokens, bf16 autocast and AdamW
    (``torchtpu.testing.memory_floor``: fake tensors at the full batch), once per shape."""
    key = (c, batch)
    if key not in _FLOORS:
        def inputs():
            ids = torch.randint(c.vocab, (batch, c.seq))
            return ids, torch.randint(c.vocab, (batch, c.seq))
        _FLOORS[key] = eager_floor(lambda: Llama(c), inputs)
    return _FLOORS[key]


def row(mode: str, length: int, dims: dict, steps: int, rounds: int, budget_s: float,
        tokens: int = TOKENS, profile: bool = False, read_every: int = 1) -> dict:
    c = LlamaConfig(**dims, seq=length)
    batch = tokens // length
    if mode.startswith("jax"):
        # As a JAX user runs it: without the 64-bit types torchtpu turns on for PyTorch's int64
        # and float64 (int64 token ids cost the twin 106 -> 125 ms a step on v5e), and at JAX's
        # default matmul precision, not the "highest" torchtpu sets once its device starts
        # (under which Mosaic refuses the splash kernel's bf16 products: the "Please report a
        # bug" of jax-splash after a torch mode in one process).
        with jax.enable_x64(False), jax.default_matmul_precision("default"):
            out = _jax_row(tpu_llama.config(**dims, seq=length), batch, steps, rounds, budget_s,
                           splash=mode == "jax-splash", profile=profile, read_every=read_every)
    else:
        out = _torch_row(mode, c, batch, steps, rounds, budget_s, profile, read_every)
    gc.collect()  # the mode's model, optimizer state and programs, before the next mode's
    torch.tpu.synchronize()
    torch.tpu.empty_cache()
    with torch.device("meta"):
        n = sum(p.numel() for p in Llama(c).parameters())
    # The rounds that loaded no program (all of them if none did): a compile is warm-up, and
    # shows in the counters per step.
    steady = [t for t, n in zip(out["rounds_ms"], out["rounds_loads"]) if n == 0]
    ms = statistics.median(steady or out["rounds_ms"])
    peak = PEAKS.get(jax.devices()[0].device_kind)
    flops = model_flops(c, n, tokens)
    under = floor(c, batch)
    out.update(mode=mode, length=length, batch=batch, dims=dims, read_every=read_every,
               parameters=n, ms_per_step=ms, model_tflop=flops / 1e12,
               mfu=flops / (ms / 1e3 * peak) if peak else None,
               floor_gib=under.gib(), peak_over_floor=out["peak_gib"] * 2**30 / under.total)
    return out


def header(results: list[dict]) -> str:
    """What the table's rows share: the model, the reads, the eager floor per shape."""
    lines = []
    for r in results:
        if "floor_gib" not in r:
            continue
        d = {**LlamaConfig().__dict__, **r["dims"]}
        line = (f"config {r.get('config', '?')}: {d['layers']} blocks, width {d['dim']}, "
                f"{d['heads']} heads of {d['dim'] // d['heads']}, MLP {d['hidden']}, vocab "
                f"{d['vocab']}: {r['parameters'] / 1e6:.1f} M parameters; the loss read on the "
                f"host every {r['read_every']} step(s), {r['steps_per_round']} steps a round")
        f = r["floor_gib"]
        line += (f"\n  eager floor at {r['batch']}x{r['length']} (fake tensors, full batch): "
                 f"{f['total']:.2f} GiB = parameters {f['parameters']:.2f} + gradients "
                 f"{f['gradients']:.2f} + AdamW moments {f['moments']:.2f} + saved for backward "
                 f"{f['saved']:.2f}")
        if line not in lines:
            lines.append(line)
    return "\n".join(lines)


def table(results: list[dict]) -> str:
    """Markdown rows: mode, length, ms/step, MFU, against the faster JAX twin, warm-up, peak
    GiB, compiles/step."""
    jax_ms = {}  # the faster JAX twin's, per length
    for r in results:
        if r.get("mode", "").startswith("jax") and "ms_per_step" in r:
            jax_ms[r["length"]] = min(jax_ms.get(r["length"], 1e30), r["ms_per_step"])
    lines = ["| mode | tokens | ms/step | host issue ms | host read ms | MFU | vs JAX | "
             "warm-up s | peak GiB | eager floor GiB | peak / floor | "
             "compiles, cache hits, executions, bytes read per step |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        if "ms_per_step" not in r:
            lines.append(f"| {r['mode']} | {r['length']} | error: "
                         f"{r.get('error', '?').splitlines()[-1][:120]} |")
            continue
        ref = jax_ms.get(r["length"])
        ps = r["per_step"]
        lines.append(
            f"| {r['mode']} | {r['batch']}x{r['length']} | {r['ms_per_step']:.1f} | "
            f"{statistics.median(r['issue_ms']):.1f} | {statistics.median(r['read_ms']):.1f} | "
            f"{(r['mfu'] or 0) * 100:.1f}% | "
            f"{ref / r['ms_per_step'] if ref else 0:.3f}x | "
            f"{r['warmup_s']:.0f} | {r['peak_gib']:.2f} | {r['floor_gib']['total']:.2f} | "
            f"{r['peak_over_floor']:.2f} | "
            f"{ps['executable_compiles']:.2f}, {ps['persistent_cache_hits']:.2f}, "
            f"{ps['executions']:.1f}, {ps['device_to_host_bytes']:.1f} |")
    lines += ["", "| mode | tokens | warm-up s | model+inputs s (compiles) | Dynamo | AOT | "
              "captures | JAX trace | lowering | XLA compile s (count; of which cache writes) | "
              "waits for results | "
              "other |", "|---|---|" + "---:|" * 10]
    for r in results:
        w = r.get("warmup_split")
        if w is None:
            continue
        lines.append(
            f"| {r['mode']} | {r['batch']}x{r['length']} | {r['warmup_s']:.1f} | "
            f"{w['init_s']:.1f} ({w['init_compiles']}) | "
            + " | ".join(f"{w[p + '_s']:.1f}" for p in PHASES[:-1])
            + f" | {w['compile_s']:.1f} ({w['compiles']}; {w['cache_write_s']:.1f}) | "
            f"{w['wait_s']:.1f} | "
            f"{w['other_s']:.1f} |")
    return "\n".join(lines)


def main(argv: list | None = None) -> list:
    p = argparse.ArgumentParser(prog="bench/on_tpu_llama.py",
                                description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1024,2048")
    p.add_argument("--modes", default="jax,jax-splash,whole,model,strict,defer")
    p.add_argument("--config", default="suite", choices=sorted(CONFIGS),
                   help="suite: issue 35's 221 M model; issue50: the 440 M Llama (width 1536)")
    p.add_argument("--layers", type=int, default=None, help="blocks (default: the config's 12)")
    p.add_argument("--tokens", type=int, default=TOKENS, help="batch x length")
    p.add_argument("--tiny", action="store_true",
                   help="vocab 512, width 128, 2 heads, MLP 256: a smoke run on CPU")
    p.add_argument("--read-every", type=int, default=1,
                   help="read the loss on the host every N steps (1: every step, as training "
                   "loops do); a timed round is --steps rounded up to a multiple of N")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=60.0,
                   help="stop a mode's timed rounds past this many seconds (one round at least)")
    p.add_argument("--profile", default="",
                   help="modes whose one step is profiled: its TOP_OPS (100) longest device ops")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.read_every < 1:
        p.error("--read-every: 1 or more")
    print(f"jax {jax.__version__}, torch {torch.__version__}, {jax.devices()}", flush=True)
    results = []
    for length in (int(x) for x in args.lengths.split(",")):
        for mode in args.modes.split(","):
            t = time.perf_counter()
            try:
                dims = {**CONFIGS[args.config], **(TINY if args.tiny else {})}
                if args.layers is not None:
                    dims["layers"] = args.layers
                r = row(mode, length, dims, args.steps, args.rounds, args.budget_s, args.tokens,
                        profile=mode in args.profile.split(","), read_every=args.read_every)
            except Exception as e:  # one mode failing (out of memory, say) leaves the others
                r = {"mode": mode, "length": length, "read_every": args.read_every,
                     "error": f"{type(e).__name__}: {e}"}
            # (after the except block: its exception's frames, which hold the failed mode's
            # model and arrays, are gone only once it ends)
            gc.collect()
            r["config"] = args.config
            r["wall_s"] = time.perf_counter() - t
            results.append(r)
            print(json.dumps(r, default=str), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1, default=str)
    print(header(results), flush=True)
    print(table(results), flush=True)
    for r in results:
        for op in r.get("top_ops") or []:
            print(f"{r['mode']} {r['length']}: {op['ms']:8.2f} ms {op['runs']:4d}x {op['op']} "
                  f"[{op['category']}] {op['hlo'][:110]}")
    return results


if __name__ == "__main__":
    main()
