"""An attention block's layout copies on a TPU target, compile-only: the lowering table's products.

One Llama attention block's forward and backward (q, k, v projections, the (b, t, h, d) ->
(b, h, t, d) transposes, SDPA's fused op and its backward as ``lowering/attention.py`` lowers them
for a TPU (the splash kernel), the o-projection) built from the lowering table's own entries for
``aten.mm`` and SDPA, compiled for one chip of a TPU target with libtpu. Printed: the optimized
program's copies (layout changes between its fusions), its estimated cycles (the TPU compiler's
own per-instruction estimates, summed) and the cost model's seconds and bytes. ``--products
bf16`` builds the products as they were lowered before (a bf16 result asked of the dot), which
the TPU compiler lays out column-major and copies twice more per projection (bench/RESULTS.md,
whole3).

    /work/venvs/tpu/bin/python bench/attention_layouts.py [--heads 2] [--target v5e:1x1]
        [--products table|bf16] [--json out.json]
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


def _table_products():
    from torchtpu.lowering.registry import lookup

    return lookup(aten.mm.default).fn


def _bf16_products(x, y):
    return jnp.matmul(x, y)


def _attention():
    """SDPA's forward and backward lowerings as one differentiable function of (q, k, v)."""
    from torchtpu.lowering.registry import lookup

    forward = lookup(aten._scaled_dot_product_fused_attention_overrideable.default).fn
    backward = lookup(aten._scaled_dot_product_fused_attention_overrideable_backward.default).fn
    key = jnp.zeros((2,), jnp.uint32)

    @jax.custom_vjp
    def attend(q, k, v):
        return forward(key, q, k, v, None, 0.0, True)[0]

    def fwd(q, k, v):
        out, lse = forward(key, q, k, v, None, 0.0, True)[:2]
        return out, (q, k, v, out, lse)

    def bwd(res, g):
        q, k, v, out, lse = res
        zero = jnp.zeros((), jnp.int64)
        return backward(g, q, k, v, None, (True, True, True, False), out, lse, None, None,
                        q.shape[2], k.shape[2], 0.0, True, zero, zero)[:3]

    attend.defvjp(fwd, bwd)
    return attend


def block_gradients(mm, batch: int, length: int, heads: int, dim: int = 128):
    """d(loss)/d(weights) of one attention block whose products are ``mm``."""
    width = heads * dim
    attend = _attention()

    def loss(ws, x):
        h = x.astype(jnp.bfloat16)
        q, k, v = (mm(h, w.astype(jnp.bfloat16).T).reshape(batch, length, heads, dim)
                   .transpose(0, 2, 1, 3) for w in ws[:3])
        y = attend(q, k, v).transpose(0, 2, 1, 3).reshape(batch * length, width)
        return jnp.sum(mm(y, ws[3].astype(jnp.bfloat16).T).astype(jnp.float32) ** 2)

    args = ([jax.ShapeDtypeStruct((width, width), jnp.float32)] * 4,
            jax.ShapeDtypeStruct((batch * length, width), jnp.float32))
    return jax.grad(loss), args


def copies_and_cycles(hlo: str) -> tuple[list, int]:
    """The entry's copies of arrays (not scalars) and the sum of its estimated cycles."""
    entry = hlo[hlo.find("ENTRY"):]
    copies = [c for c in re.findall(r"= (\S+) copy\(", entry) if "[]" not in c]
    return copies, sum(int(x) for x in re.findall(r'"estimated_cycles":"(\d+)"', entry))


def main(argv: list | None = None) -> dict:
    p = argparse.ArgumentParser(prog="bench/attention_layouts.py",
                                description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--target", default="v5e:1x1")
    p.add_argument("--products", choices=("table", "bf16"), default="table")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dump = tempfile.mkdtemp(prefix="attention_layouts_")
    os.environ["TORCHTPU_TPU_DUMP"] = dump
    import torchtpu  # noqa: F401  (the lowering table)
    from torchtpu.targets import tpu_target

    mm = _table_products() if args.products == "table" else _bf16_products
    fn, fn_args = block_gradients(mm, args.batch, args.length, args.heads)
    name = f"attention_block_{args.products}"
    with jax.enable_x64(False):
        r = tpu_target.compile_function(fn, *fn_args, name=name, target_name=args.target)
    if r.error:
        sys.exit(f"{name}: {r.error}")
    with open(sorted(glob.glob(os.path.join(dump, f"{name}.*.hlo.txt")))[-1]) as f:
        copies, cycles = copies_and_cycles(f.read())
    out = {"products": args.products, "copies": len(copies), "copy_shapes": copies,
           "mcycles": cycles / 1e6, "seconds_us": r.seconds * 1e6,
           "mbytes": r.bytes_accessed / 1e6}
    print(f"{name}: {len(copies)} copies, {cycles / 1e6:.3f} M estimated cycles, cost model "
          f"{r.seconds * 1e6:.1f} us, {r.bytes_accessed / 1e6:.1f} MB", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
