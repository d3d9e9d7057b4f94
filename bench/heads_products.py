"""An attention block's layout copies on a TPU target with its projections' products in other forms,
compile-only (bench/RESULTS.md, whole8): where the 2-D (tokens, features) product costs copies.

``bench/attention_layouts.py``'s block (q, k, v and o projections, SDPA's TPU lowering, forward and
backward) with a rotary step on q and k, its products (not the weight gradients, which keep the
table's form) as: ``plain`` (the table's 2-D product), ``lanes`` (the result as (tokens, features /
128, 128)), ``rows`` (as (tokens / length, length, features)), ``heads`` (both: the (batch, tokens,
heads, head_dim) view attention reads). Printed per form: the entry's copies of arrays and its
estimated cycles.

    /work/venvs/tpu/bin/python bench/heads_products.py [--forms plain,heads] [--batch 8]
        [--length 1024]
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attention_layouts  # noqa: E402  (bench/ is no package)

F32 = jnp.float32


def product(form: str, length: int):
    """mm in the given form; the table's own for weight gradients and shapes the form can't take."""
    from torchtpu.lowering import linalg

    def mm(x, y):
        (m, k), n = x.shape, y.shape[1]
        if linalg.weight_gradient(x, y):
            return linalg._rows_in_blocks(x, y)
        rows, lanes = form in ("rows", "heads"), form in ("lanes", "heads")
        if form == "plain" or (rows and m % length) or (lanes and n % 128):
            return linalg._half(x, y)
        xs = x.reshape(m // length, length, k) if rows else x
        ys = y.reshape(k, n // 128, 128) if lanes else y
        out = lax.dot_general(xs, ys, (((xs.ndim - 1,), (0,)), ((), ())),
                              preferred_element_type=F32)
        return out.astype(x.dtype).reshape(m, n)
    return mm


def _rotate(x):
    half = x.shape[-1] // 2
    c = jnp.cos(jnp.arange(x.shape[2] * x.shape[3], dtype=F32).reshape(x.shape[2:])).astype(x.dtype)
    return x * c + jnp.concatenate([-x[..., half:], x[..., :half]], -1) * c


def block_gradients(mm, batch: int, length: int, heads: int = 8, dim: int = 128):
    width, attend = heads * dim, attention_layouts._attention()

    def loss(ws, x):
        h = x.astype(jnp.bfloat16)
        q, k, v = (mm(h, w.astype(jnp.bfloat16).T).reshape(batch, length, heads, dim)
                   .transpose(0, 2, 1, 3) for w in ws[:3])
        y = attend(_rotate(q), _rotate(k), v).transpose(0, 2, 1, 3).reshape(batch * length, width)
        return jnp.sum(mm(y, ws[3].astype(jnp.bfloat16).T).astype(F32) ** 2)

    args = ([jax.ShapeDtypeStruct((width, width), F32)] * 4,
            jax.ShapeDtypeStruct((batch * length, width), F32))
    return jax.grad(loss), args


def main(argv: list | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench/heads_products.py", description=__doc__.splitlines()[0])
    p.add_argument("--forms", default="plain,lanes,rows,heads")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--target", default="v5e:1x1")
    args = p.parse_args(argv)
    dump = tempfile.mkdtemp(prefix="heads_products_")
    os.environ["TORCHTPU_TPU_DUMP"] = dump
    import torchtpu  # noqa: F401  (the lowering table)
    from torchtpu.targets import tpu_target

    for form in args.forms.split(","):
        fn, fn_args = block_gradients(product(form, args.length), args.batch, args.length)
        name = f"heads_products_{form}_{args.length}"
        with jax.enable_x64(False):
            r = tpu_target.compile_function(fn, *fn_args, name=name, target_name=args.target)
        if r.error:
            sys.exit(f"{name}: {r.error}")
        with open(sorted(glob.glob(os.path.join(dump, f"{name}.*.hlo.txt")))[-1]) as f:
            copies, cycles = attention_layouts.copies_and_cycles(f.read())
        print(f"{form:6s} {args.batch}x{args.length}: {len(copies)} copies, "
              f"{cycles / 1e6:.3f} M estimated cycles", flush=True)


if __name__ == "__main__":
    main()
