"""The chip Llama row's whole step and its JAX twin, compiled for a TPU without one.

``torchtpu.testing.llama``'s training step under ``torch.compile(step, backend="tpu")`` (side
``whole``) or DeferAndFuse (``defer``: its fused programs) and ``bench/tpu_llama.py``'s twin
(splash or naive attention), each compiled for one chip of a TPU target with libtpu, at the chip
row's real shapes: deterministic figures (no load noise) to find where the whole step's program
does more than the twin's. Nothing runs: the whole step's captured programs and DeferAndFuse's
flushes are compiled for the target instead of being run on the host (``Captured.replay`` is
replaced, the fused launches are answered by an observer, for the length of the run; outputs
become zeros of their shapes), so a 12-layer, 8,192-token step costs only its captures (or
recordings) and TPU compiles.

    /work/venvs/tpu/bin/python bench/aot_llama.py [--length 1024] [--layers 12]
        [--target v5e:1x1] [--sides whole,defer,splash,naive] [--dump DIR] [--json out.json]

Per program: the cost model's seconds, flops, bytes accessed, transcendentals; HBM (arguments,
outputs, temporaries); the compile's process CPU seconds and wall seconds (CPU is the figure on
a loaded machine; libtpu's own log, ``TPU_LOG_DIR``, names a fusion it retried or found slow:
``retry compilation``, ``Slow compilation``); and from its optimized HLO (``--dump``) the
fusions, copies, transposes, convolutions (products) by operand types and f32 products at
HIGHEST precision.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import json
import os
import re
import sys
import tempfile

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax_models  # noqa: E402  (bench/ is no package)
import tpu_llama  # noqa: E402

TOKENS = 8192


def hlo_facts(text: str) -> dict:
    """Counts from an optimized HLO module's text: the entry's ops, and each product
    (convolution or dot, in any computation) by its operand types and precision."""
    entry = text[text.find("ENTRY"):] if "ENTRY" in text else text
    ops = collections.Counter(m.group(1) for m in re.finditer(r"= [^ ]+ ([a-z\-]+)\(", entry))
    types = dict(re.findall(r"(%[\w.\-]+) = \(?(\w+)\[", text))
    products: collections.Counter = collections.Counter()
    for m in re.finditer(r"= (\w+)\[[^\n]* (?:convolution|dot)\((%[\w.\-]+), (%[\w.\-]+)\)"
                         r"[^\n]*", text):
        line = m.group(0)
        highest = "highest" in line.lower()
        products[f"{types.get(m.group(2), '?')} x {types.get(m.group(3), '?')} -> "
                 f"{m.group(1)}{' HIGHEST' if highest else ''}"] += 1
    return {"entry_ops": dict(ops.most_common(25)), "fusions": ops.get("fusion", 0),
            "copies": ops.get("copy", 0) + ops.get("copy-start", 0),
            "transposes": text.count(" transpose("), "products": dict(products),
            "custom_calls": text.count("custom-call(")}


def _report_dict(r, dump: str | None) -> dict:
    from torchtpu.targets import tpu_target

    out = {"name": r.name, "compiles": r.compiles, "error": r.error,
           "seconds_ms": (r.seconds or 0) * 1e3, "seconds_twin": r.seconds_twin,
           "tflop": r.flops / 1e12, "gbytes": r.bytes_accessed / 1e9,
           "transcendentals_g": r.transcendentals / 1e9,
           "hbm_gib": {k: v / 2**30 for k, v in r.hbm.items()},
           "compile_s": r.compile_seconds, "compile_cpu_s": r.compile_cpu_seconds}
    if dump:
        files = sorted(glob.glob(os.path.join(dump, f"{tpu_target._file_name(r.name)}.*.hlo.txt")),
                       key=os.path.getmtime)
        if files:
            out["hlo_file"] = files[-1]
            with open(files[-1]) as f:
                out["hlo"] = hlo_facts(f.read())
    return out


@contextlib.contextmanager
def compiled_not_run(reports: list, target: str):
    """Every captured program compiled for the target and not run: its outputs are zeros."""
    from torchtpu.eager.capture import Captured
    from torchtpu.targets import tpu_target

    original = Captured.replay

    def replay(self, bind=None):
        args = self._io.arguments(bind)
        reports.append(tpu_target.compile_function(self._fn.jitted, *args, name=self._label,
                                                   kind="step", target_name=target))
        shapes = jax.eval_shape(self._fn.jitted, *args)
        self._io.store(args, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))

    Captured.replay = replay
    try:
        yield
    finally:
        Captured.replay = original


def whole_step(length: int, layers: int, target: str, tokens: int = TOKENS, **dims) -> list:
    """The reports of every program the whole step's first two calls build."""
    import torch

    from torchtpu.testing.llama import Llama, LlamaConfig, train_step

    c = LlamaConfig(layers=layers, seq=length, **dims)
    torch.manual_seed(0)
    with torch.device("tpu"):
        model = Llama(c)
    step, _ = train_step(model)
    step = torch.compile(step, backend="tpu")
    ids = torch.randint(c.vocab, (tokens // length, length + 1))
    x, y = ids[:, :-1].contiguous().to("tpu"), ids[:, 1:].contiguous().to("tpu")
    reports: list = []
    with compiled_not_run(reports, target):
        step(x, y)
        step(x, y)
    return reports


@contextlib.contextmanager
def fused_not_run(reports: list, target: str):
    """Every DeferAndFuse program compiled for the target (once each) and not run: its outputs
    are zeros."""
    from torchtpu.device.hooks import HOOKS
    from torchtpu.targets import tpu_target

    previous, seen = HOOKS.launch_observer, set()

    def observe(label, fn, args):
        if not str(label).startswith("defer_and_fuse"):
            return fn(*args) if previous is None else previous(label, fn, args)
        if id(fn) not in seen:  # the recorder keeps each program's jitted function
            seen.add(id(fn))
            reports.append(tpu_target.compile_function(fn, *args, name=str(label), kind="step",
                                                       target_name=target))
        return [jnp.zeros(s.shape, s.dtype) for s in jax.eval_shape(fn, *args)]

    HOOKS.launch_observer = observe
    try:
        yield
    finally:
        HOOKS.launch_observer = previous


def deferred_step(length: int, layers: int, target: str, tokens: int = TOKENS, steps: int = 3,
                  **dims) -> list:
    """The reports of every program the step's first calls under DeferAndFuse build (the
    first: AdamW creating its moments; then the steady one), each flushed at ``loss.item()``."""
    import torch

    from torchtpu.testing.llama import Llama, LlamaConfig, train_step

    c = LlamaConfig(layers=layers, seq=length, **dims)
    torch.manual_seed(0)
    with torch.device("tpu"):
        model = Llama(c)
    step, _ = train_step(model)
    ids = torch.randint(c.vocab, (tokens // length, length + 1))
    x, y = ids[:, :-1].contiguous().to("tpu"), ids[:, 1:].contiguous().to("tpu")
    reports: list = []
    with fused_not_run(reports, target), \
            torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        for _ in range(steps):
            step(x, y).item()
    return reports


def twin(length: int, layers: int, target: str, splash: bool, tokens: int = TOKENS,
         **dims):
    from torchtpu.targets import tpu_target

    c = tpu_llama.config(layers=layers, seq=length, **dims)
    attend = tpu_llama.splash_attention(512, 512, True) if splash else tpu_llama.naive_attention
    fn = jax.jit(jax_models.train_step(tpu_llama.loss_fn(c, attend), 3e-4, (0.9, 0.999), 1e-8,
                                       0.1, 1.0), donate_argnums=(0, 1, 2))
    params = jax.eval_shape(lambda: tpu_llama.init(c, jax.random.key(0)))
    batch = tokens // length
    ids = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    # As a JAX user runs it: 32-bit, default matmul precision (torchtpu sets "highest" for
    # PyTorch's float32 semantics once its device starts; Mosaic refuses the splash kernel's
    # bf16 products at that precision).
    with jax.enable_x64(False), jax.default_matmul_precision("default"):
        return tpu_target.compile_function(
            fn, params, params, params, jax.ShapeDtypeStruct((), jnp.float32), ids, ids,
            name=f"jax_twin_{'splash' if splash else 'naive'}", kind="step",
            target_name=target)


def main(argv: list | None = None) -> dict:
    p = argparse.ArgumentParser(prog="bench/aot_llama.py", description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--tokens", type=int, default=TOKENS)
    p.add_argument("--target", default="v5e:1x1")
    p.add_argument("--sides", default="whole,splash,naive")
    p.add_argument("--tiny", action="store_true", help="vocab 512, width 256, 2 heads of 128")
    p.add_argument("--vocab", type=int, default=None,
                   help="another vocab than the chip row's (smaller: a faster compile)")
    p.add_argument("--dump", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--cycles-only", action="store_true",
                   help="no cost-model time from twins of a program the model gives none "
                        "(each up to two more compiles): the dump's cycles only")
    args = p.parse_args(argv)
    if args.cycles_only:
        from torchtpu.targets import tpu_target

        tpu_target._twin_seconds = lambda parsed, devs, **_: (None, "")
    dump = args.dump or tempfile.mkdtemp(prefix="aot_llama_")
    os.environ["TORCHTPU_TPU_DUMP"] = dump
    dims = dict(vocab=512, dim=256, heads=2, hidden=512) if args.tiny else {}
    if args.vocab:
        dims["vocab"] = args.vocab
    out: dict = {"length": args.length, "layers": args.layers, "tokens": args.tokens,
                 "target": args.target, "dump": dump}
    sides = args.sides.split(",")
    for side in sides:
        if side == "whole":
            rs = whole_step(args.length, args.layers, args.target, args.tokens, **dims)
        elif side == "defer":
            rs = deferred_step(args.length, args.layers, args.target, args.tokens, **dims)
        else:
            rs = [twin(args.length, args.layers, args.target, side == "splash", args.tokens,
                       **dims)]
        out[side] = [_report_dict(r, dump) for r in rs]
        for r in out[side]:
            hlo = r.get("hlo", {})
            print(f"{side:7s} {r['name'][:40]:40s} {r['seconds_ms']:8.2f} ms "
                  f"{r['tflop']:7.3f} TFLOP {r['gbytes']:7.2f} GB "
                  f"temp {r['hbm_gib'].get('temporaries', 0):5.2f} GiB "
                  f"args {r['hbm_gib'].get('arguments', 0):5.2f} GiB "
                  f"fusions {hlo.get('fusions')} copies {hlo.get('copies')} "
                  f"products {hlo.get('products')} compile {r['compile_cpu_s']:.1f} CPU-s "
                  f"({r['compile_s']:.1f} s) {r['error'] or ''}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out


if __name__ == "__main__":
    main()
