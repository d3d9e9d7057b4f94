"""The TPU cost model's figures for torchtpu's programs beside the JAX ports', chip by chip.

Each registry row (``bench/registry.py``: Llama-3.2, Gemma-3, Qwen3, TinyGPT; forward and train)
runs as torchtpu runs it, compiled (``torch.compile`` of the step) or captured (``torch.tpu.graph``
of it), under ``torchtpu.aot.report``: every program the step builds is also compiled for one chip
of the target with libtpu (compile-only: nothing runs on a TPU). Beside it the row's JAX port
(``bench/jax_models.py``, the torch model's weights, the same batch, the same matmul precision:
the process's JAX settings are torchtpu's) is compiled for the same chip as one ``jax.jit``.
Per row: the cost model's seconds, flops and bytes accessed of one step (summed over the
programs it runs, as often as it runs them) and the HBM of its largest program (arguments,
outputs, temporaries and code, less what is aliased; and the compiler's own peak), each with
torchtpu / JAX. The train step is ``torchtpu.aot``'s (loss, ``backward()``,
``torch.optim.AdamW(lr=1e-3)``, ``zero_grad()``), and the JAX port's the same AdamW. These
figures are deterministic: no load noise. libtpu's cost model has no estimate for a program with
any 64-bit op, and torch's token ids are int64: such a program's seconds are those of its
64-bit-narrowed twin (``targets/tpu_narrow.py``), on both sides; a row whose seconds are still
missing compares roofline times (marked ``*``: the larger of flops at the chip's bf16 peak and
bytes at its HBM bandwidth).

``--gpt2`` adds a GPT-2 small (124M) training step, bf16 under ``torch.autocast``, and its
estimated MFU on one chip (flops / (cost-model seconds x the chip's bf16 peak));
``--gpt2-from 1,2`` scales the 12-block figures from 1- and 2-block steps, for a host too slow
to run the whole model's step on XLA:CPU; ``--gpt2-batch N`` takes N x 1024 tokens a step. Beside
it the same step written in JAX with autocast's casts (``bench/tpu_gpt2.py``: all 12 blocks, it
only compiles) at the same batch.

    python bench/tpu_cost.py [--chips v5e,v6e] [--models ...] [--kinds forward,train]
                             [--modes compile,captured]
                             [--gpt2 [--gpt2-from A,B] [--gpt2-batch N]]
                             [--json out.json]

One target per process (``targets/tpu_hook.py``), so each chip runs in a process of its own.
Needs libtpu (``pip install -e '.[tpu-aot]'``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import torch

import torchtpu.aot as aot
from torchtpu.targets import tpu_target
from torchtpu.testing import hf_rows

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile import bench_module  # noqa: E402 (bench/ is no package; its scripts run by path)

reg = bench_module("registry")
cb, jm = reg.cb, reg.jm

CHIPS = ("v5e", "v6e")
MODES = ("compile", "captured")
MODELS = ("llama-3.2", "gemma-3", "qwen3", "tinygpt")
# torchtpu.aot's train step: torch.optim.AdamW(lr=1e-3) with its defaults, no clipping.
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


class _Loss(torch.nn.Module):
    """A registry model as aot's convention wants it: ``forward(x, y)`` is the row's loss
    (under no_grad for a forward row, as the registry's forward is; under autocast when asked)."""

    def __init__(self, model, loss, train: bool, autocast=None) -> None:
        super().__init__()
        self.model, self.loss, self.train_step, self.autocast = model, loss, train, autocast

    def forward(self, x, y):
        grad = contextlib.nullcontext() if self.train_step else torch.no_grad()
        cast = (torch.autocast("tpu", dtype=self.autocast) if self.autocast is not None
                else contextlib.nullcontext())
        with grad, cast:
            return self.loss(self.model, x, y)


def _step_figures(r) -> dict:
    """Seconds, flops, bytes of one step (each program as often as it ran) and the HBM of its
    largest program, from a torchtpu.aot report."""
    by_module = {p.module: p for p in r.programs}
    ran = [(by_module[row["module"]], row["runs"]) for row in r.step.largest
           if row["module"] in by_module]
    counted = sum(n for _, n in ran)
    return {"seconds": r.step.seconds, "flops": r.step.flops,
            "bytes": sum(p.bytes_accessed * n for p, n in ran),
            "hbm": max((p.hbm_bytes for p, _ in ran), default=0),
            "peak": max((p.hbm.get("peak", 0) for p, _ in ran), default=0),
            "programs": r.step.programs_run, "complete": counted == r.step.programs_run,
            "refused": [p.name for p in r.programs if not p.compiles],
            "wide": {k: sum(p.wide_ops.get(k, 0) for p, _ in ran) for k in ("float64", "int64")}}


def torchtpu_row(name: str, kind: str, mode: str, topology: str) -> dict:
    spec = reg.MODELS[name]
    x, y = spec.batch(torch.Generator().manual_seed(1))
    r = aot.report(_Loss(spec.build(), spec.loss, kind == "train"), (x, y), topology=topology,
                   step=kind, mode=mode)
    return _step_figures(r)


def _port(name: str):
    if name == "tinygpt":
        return cb._jax_params(cb._model()), cb._jax_loss
    return jm.port(hf_rows.hf(name)())


def jax_row(name: str, kind: str, topology: str) -> dict:
    spec = reg.MODELS[name]
    x, y = (jnp.asarray(t.numpy()) for t in spec.batch(torch.Generator().manual_seed(1)))
    params, loss = _port(name)
    if kind == "forward":
        report = tpu_target.compile_function(loss, params, x, y, name=f"{name} jax forward",
                                             target_name=topology)
    else:
        step = jax.jit(jm.train_step(loss, ADAMW["lr"], ADAMW["betas"], ADAMW["eps"],
                                     ADAMW["weight_decay"]), donate_argnums=(0, 1, 2))
        zeros = jax.tree.map(jnp.zeros_like, params)
        report = tpu_target.compile_function(step, params, zeros, zeros,
                                             jnp.zeros((), jnp.float32), x, y,
                                             name=f"{name} jax train", target_name=topology)
    if not report.compiles:
        raise RuntimeError(f"torchtpu.bench: the JAX port of {name} {kind} does not compile "
                           f"for {topology}: {report.error}")
    return {"seconds": report.seconds, "flops": report.flops, "bytes": report.bytes_accessed,
            "hbm": report.hbm_bytes, "peak": report.hbm.get("peak", 0),
            "wide": {k: report.wide_ops.get(k, 0) for k in ("float64", "int64")}}


def gpt2_row(topology: str, batch: int = 1, seq: int = 1024, mode: str = "compile",
             layers: int = 12) -> dict:
    """GPT-2 small's bf16 (autocast) training step (its dims, ``layers`` blocks): the cost
    model's seconds and MFU."""
    import transformers

    torch.manual_seed(0)
    # No dropout, as MFU figures are quoted: with it, the step's random bits are threefry
    # rounds in while loops, which libtpu's cost model gives no time (and which added 2 GB of
    # bytes accessed to the 1-block step).
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_positions=seq, n_layer=layers, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    ids = torch.randint(50257, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    r = aot.report(_Loss(model, reg.hf_loss, True, torch.bfloat16),
                   (ids[:, :-1].contiguous(), ids[:, 1:].contiguous()), topology=topology,
                   step="train", mode=mode)
    params = sum(p.numel() for p in model.parameters())
    return {**_step_figures(r), "mfu": r.step.mfu, "peak_flops": r.step.peak_flops,
            "params": params, "tokens": batch * seq, "mode": mode, "layers": layers,
            "hbm_peak": r.step.hbm_peak_bytes}


def gpt2_scaled(topology: str, few: tuple, layers: int = 12, **kw) -> dict:
    """GPT-2's step at ``layers`` blocks from two shallower ones (``few``: (a, b) blocks): the
    blocks are unrolled and alike, so seconds, flops, parameters and the HBM peak grow by the
    same amount per block; each is a + (layers - a) x (per block from a to b). For a host too
    slow for the 12-block step (XLA:CPU runs it to find its programs)."""
    a, b = (gpt2_row(topology, layers=n, **kw) for n in few)
    span = few[1] - few[0]

    def at(k: str) -> float | None:
        if a[k] is None or b[k] is None:
            return None
        return a[k] + (layers - few[0]) * (b[k] - a[k]) / span

    out = {**a, "layers": layers, "scaled_from": list(few)}
    for k in ("seconds", "flops", "bytes", "params", "hbm_peak"):
        out[k] = at(k)
    out["mfu"] = (out["flops"] / (out["seconds"] * a["peak_flops"])
                  if out["seconds"] else None)
    out["rows"] = [a, b]
    return out


def _times(t: dict, j: dict, chip: str) -> tuple:
    """(torchtpu µs, JAX µs, ratio) by the cost model when it estimates both programs, else by
    the roofline (max of flops at the chip's peak and bytes at its HBM bandwidth), marked '*'.
    libtpu's cost model gives no estimate (a negative one) for a program with any 64-bit op,
    and torch's token ids are int64."""
    if t["seconds"] and j["seconds"]:
        a, b, mark = t["seconds"], j["seconds"], ""
    else:
        c = tpu_target.CHIPS[chip]
        bandwidth = c.hbm_bandwidth / c.devices_per_chip
        a, b = (max(f["flops"] / c.device_peak_flops, f["bytes"] / bandwidth) for f in (t, j))
        mark = "*"
    return f"{a * 1e6:.2f}{mark}", f"{b * 1e6:.2f}{mark}", _ratio(a, b)


def _ratio(a, b) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def _fmt(v, scale: float, digits: int = 2) -> str:
    return "-" if v is None else f"{v / scale:.{digits}f}"


def table(rows: list) -> str:
    lines = ["| chip | model | kind | form | µs torchtpu | µs JAX | ratio | GFLOP torchtpu | "
             "GFLOP JAX | MB accessed torchtpu | MB accessed JAX | ratio | HBM MB torchtpu | "
             "HBM MB JAX | ratio | peak MB torchtpu | peak MB JAX | ratio |",
             "| --- | --- | --- | --- |" + " ---: |" * 14]
    for r in rows:
        t, j = r["torchtpu"], r["jax"]
        lines.append(
            f"| {r['chip']} | {r['model']} | {r['kind']} | {r['mode']} | "
            + " | ".join(_times(t, j, r["chip"])) + f" | {_fmt(t['flops'], 1e9, 3)} | "
            f"{_fmt(j['flops'], 1e9, 3)} | {_fmt(t['bytes'], 1e6)} | {_fmt(j['bytes'], 1e6)} | "
            f"{_ratio(t['bytes'], j['bytes'])} | {_fmt(t['hbm'], 1e6)} | {_fmt(j['hbm'], 1e6)} | "
            f"{_ratio(t['hbm'], j['hbm'])} | {_fmt(t.get('peak'), 1e6)} | "
            f"{_fmt(j.get('peak'), 1e6)} | {_ratio(t.get('peak'), j.get('peak'))} |")
    return "\n".join(lines)


def gpt2_jax(topology: str, batch: int) -> dict:
    """The JAX GPT-2 step (``tpu_gpt2.py``, 12 blocks) at batch x 1024 tokens on one chip."""
    import tpu_gpt2

    r = tpu_gpt2.compile_step(topology, batch)
    if not r.compiles:
        raise RuntimeError(f"torchtpu.bench: the JAX GPT-2 step does not compile: {r.error}")
    return {"seconds": r.seconds, "flops": r.flops, "bytes": r.bytes_accessed,
            "hbm_peak": r.hbm.get("peak", 0), "twin": r.seconds_twin, "tokens": batch * 1024,
            "mfu": r.flops / (r.seconds * r.peak_flops) if r.seconds else None}


def run_chip(chip: str, models, kinds, modes, gpt2: bool, few: tuple | None = None,
             batch: int = 1) -> dict:
    topology = f"{chip}:2x2"
    rows = []
    for name in models:
        for kind in kinds:
            port = jax_row(name, kind, topology)
            for mode in modes:
                rows.append({"chip": chip, "model": name, "kind": kind, "mode": mode,
                             "torchtpu": torchtpu_row(name, kind, mode, topology), "jax": port})
    g = None
    if gpt2:
        g = gpt2_scaled(topology, few, batch=batch) if few else gpt2_row(topology, batch)
        g["jax"] = gpt2_jax(topology, batch)
    return {"rows": rows, "gpt2": g}


def main(argv: list | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chips", default=",".join(CHIPS))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--kinds", default=",".join(reg.KINDS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--gpt2", action="store_true", help="also GPT-2 small's bf16 train step")
    parser.add_argument("--gpt2-from", default=None, metavar="A,B",
                        help="GPT-2's 12-block step scaled from A- and B-block steps (for a "
                             "host too slow for the whole model)")
    parser.add_argument("--gpt2-batch", type=int, default=1, help="GPT-2's sequences a step")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    chips = reg._names(args.chips, CHIPS)
    picked = (reg._names(args.models, MODELS), reg._names(args.kinds, reg.KINDS),
              reg._names(args.modes, MODES))
    few = tuple(int(n) for n in args.gpt2_from.split(",")) if args.gpt2_from else None
    if few is not None and not (len(few) == 2 and 0 < few[0] < few[1]):
        raise SystemExit("torchtpu.argument: --gpt2-from takes two block counts A,B with "
                         f"0 < A < B, not {args.gpt2_from!r}")
    if len(chips) == 1:
        out = {chips[0]: run_chip(chips[0], *picked, args.gpt2, few, args.gpt2_batch)}
    else:  # one target per process
        out = {}
        for chip in chips:
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                subprocess.run([sys.executable, os.path.abspath(__file__), "--chips", chip,
                                "--models", args.models, "--kinds", args.kinds, "--modes",
                                args.modes, *(["--gpt2"] if args.gpt2 else []),
                                *(["--gpt2-from", args.gpt2_from] if few else []),
                                "--gpt2-batch", str(args.gpt2_batch), "--json",
                                f.name], check=True, stdout=subprocess.DEVNULL)
                out.update(json.load(open(f.name)))
    rows = [r for chip in chips for r in out[chip]["rows"]]
    print(f"jax {jax.__version__}; libtpu {tpu_target.check_libtpu()}; compile-only targets "
          f"{', '.join(f'{c}:2x2' for c in chips)} (one chip each)")
    print(table(rows))
    for chip in chips:
        g = out[chip]["gpt2"]
        if g:
            scaled = (f", scaled from {g['scaled_from'][0]} and {g['scaled_from'][1]} blocks"
                      if g.get("scaled_from") else "")
            print(f"{chip}: GPT-2 small ({g['params'] / 1e6:.0f}M, {g['layers']} blocks{scaled}) "
                  f"bf16 autocast train step ({g['mode']}, {g['tokens']} tokens): "
                  f"{_fmt(g['seconds'], 1e-3)} ms, "
                  f"{_fmt(g['flops'], 1e12, 3)} TFLOP, MFU {_fmt(g['mfu'], 0.01, 1)}% of "
                  f"{g['peak_flops'] / 1e12:.0f} TFLOP/s, HBM peak "
                  f"{_fmt(g['hbm_peak'], 2**30)} GiB")
            j = g["jax"]
            print(f"{chip}: the JAX GPT-2 step (bench/tpu_gpt2.py, 12 blocks, {j['tokens']} "
                  f"tokens): {_fmt(j['seconds'], 1e-3)} ms, {_fmt(j['flops'], 1e12, 3)} TFLOP, "
                  f"MFU {_fmt(j['mfu'], 0.01, 1)}%, HBM peak {_fmt(j['hbm_peak'], 2**30)} GiB"
                  + (f" (time from its twin: {j['twin']})" if j["twin"] else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
