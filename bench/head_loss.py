"""The Llama row's head and loss on a TPU target, compile-only: the lowering table's form against
the JAX twin's.

The whole step's head and cross-entropy, forward and backward, as its recording holds them under
autocast to bfloat16 (``torchtpu.testing.llama``: ``F.cross_entropy(head(norm(x)).float(), t)``):
``aten.mm`` of bf16 operands, ``_log_softmax`` of the float32 logits, ``nll_loss_forward``, then
``nll_loss_backward``, ``_log_softmax_backward_data``, the cast back to bf16 and the two products
(input and weight gradients), each from the lowering table's own entry; beside it the JAX twin's
form (``bench/tpu_llama.py``: ``log_softmax`` and ``take_along_axis`` differentiated by JAX).
Compiled for one chip of a TPU target with libtpu at the real widths (8,192 tokens x 1,024 x a
32,768 vocabulary: nothing runs, so no memory is needed for values). Printed per side: the
optimized program's estimated cycles (the TPU compiler's own per-instruction estimates, summed),
the cost model's seconds and bytes, and the largest instructions.

    /work/venvs/tpu/bin/python bench/head_loss.py [--tokens 8192] [--dim 1024] [--vocab 32768]
        [--target v5e:1x1] [--json out.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile

import jax
import jax.numpy as jnp
import torch

aten = torch.ops.aten
BF16, F32 = jnp.bfloat16, jnp.float32


def table_form():
    """(loss, d(weight), d(input)) of the head and loss from the lowering table's entries."""
    from torchtpu.lowering.registry import lookup

    def fn(op):
        return lookup(op).fn

    mm, log_softmax = fn(aten.mm.default), fn(aten._log_softmax.default)
    nll, nll_back = fn(aten.nll_loss_forward.default), fn(aten.nll_loss_backward.default)
    log_softmax_back = fn(aten._log_softmax_backward_data.default)

    def step(w, h, t):
        hb, wb = h.astype(BF16), w.astype(BF16)
        logits = mm(hb, wb.T).astype(F32)
        logp = log_softmax(logits, 1, False)
        loss, total = nll(logp, t, None, 1, -100)
        g = nll_back(jnp.ones((), F32), logp, t, None, 1, -100, total)
        dlogits = log_softmax_back(g, logp, 1, F32).astype(BF16)
        dw = mm(dlogits.T, hb).astype(F32)
        dh = mm(dlogits, wb).astype(F32)
        return loss, dw, dh

    return step


def twin_form():
    """The same three results from the JAX twin's form, differentiated by JAX."""

    def loss_fn(w, h, t):
        logits = jnp.dot(h.astype(BF16), w.astype(BF16).T,
                         preferred_element_type=F32).astype(BF16).astype(F32)
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.take_along_axis(logp, t[:, None], -1).mean()

    def step(w, h, t):
        loss, (dw, dh) = jax.value_and_grad(loss_fn, argnums=(0, 1))(w, h, t)
        return loss, dw, dh

    return step


def instructions(hlo: str) -> list:
    """(estimated cycles, name, op, shape) of the entry's instructions, largest first
    (multi-output fusions, whose shape is a tuple, included)."""
    entry = hlo[hlo.find("ENTRY"):]
    rows = []
    for line in entry.splitlines():
        cycles = re.search(r'"estimated_cycles":"(\d+)"', line)
        head = re.match(r"\s*(?:ROOT )?(%[\w.\-]+) = (\(.*?\)|\S+) ([a-z\-]+)\(", line)
        if cycles and head:
            rows.append((int(cycles.group(1)), head.group(1), head.group(3), head.group(2)[:70]))
    return sorted(rows, reverse=True)


def report(r, name: str, dump: str, top: int) -> dict:
    """A compiled program's figures (its dump's estimated cycles, the cost model's seconds and
    bytes, HBM temporaries, its largest instructions), printed and returned."""
    if r.error:
        sys.exit(f"{name}: {r.error}")
    with open(sorted(glob.glob(os.path.join(dump, f"{name}.*.hlo.txt")))[-1]) as f:
        rows = instructions(f.read())
    total = sum(c for c, *_ in rows)
    out = {"mcycles": total / 1e6, "seconds_ms": (r.seconds or 0) * 1e3,
           "gbytes": r.bytes_accessed / 1e9, "temporaries_gib": r.hbm.get("temporaries", 0) / 2**30,
           "top": [{"mcycles": c / 1e6, "name": n, "op": o, "shape": s}
                   for c, n, o, s in rows[:top]]}
    print(f"{name}: {total / 1e6:.3f} M estimated cycles, cost model {out['seconds_ms']:.3f} ms, "
          f"{out['gbytes']:.2f} GB, temporaries {out['temporaries_gib']:.2f} GiB", flush=True)
    for c, n, o, s in rows[:top]:
        print(f"  {c / 1e6:8.3f} M  {o:8s} {n[:32]:32s} {s}")
    return out


def main(argv: list | None = None) -> dict:
    p = argparse.ArgumentParser(prog="bench/head_loss.py", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--target", default="v5e:1x1")
    p.add_argument("--sides", default="table,twin")
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dump = tempfile.mkdtemp(prefix="head_loss_")
    os.environ["TORCHTPU_TPU_DUMP"] = dump
    import torchtpu  # noqa: F401  (the lowering table)
    from torchtpu.targets import tpu_target

    shapes = (jax.ShapeDtypeStruct((args.vocab, args.dim), F32),
              jax.ShapeDtypeStruct((args.tokens, args.dim), F32),
              jax.ShapeDtypeStruct((args.tokens,), jnp.int32))
    out: dict = {}
    for side in args.sides.split(","):
        step = table_form() if side == "table" else twin_form()
        name = f"head_loss_{side}"
        with jax.enable_x64(False):
            r = tpu_target.compile_function(step, *shapes, name=name, target_name=args.target)
        out[side] = report(r, name, dump, args.top)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
