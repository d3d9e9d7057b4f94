"""One captured Llama block (or its attention alone) compiled for a TPU target, compile-only.

``torchtpu.testing.llama``'s ``Block`` (or ``Attention``) forward and backward under bfloat16
autocast, captured with ``torch.tpu.graph`` as the whole step captures it (``eager/capture.py``:
its read forms applied), at the chip row's shapes, the input requiring its gradient (so q, k
and v's input gradients are in the program, as in the whole step), compiled for one chip of a
TPU target with libtpu. Printed: the optimized program's array copies by type and its
estimated cycles summed over the entry: a block's layout copies in seconds rather than the
whole step's minutes (``bench/aot_llama.py``).

    /work/venvs/tpu/bin/python bench/block_capture.py [--part block|attention] [--batch 8]
        [--length 1024] [--target v5e:1x1] [--dump DIR] [--forms read]
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attention_layouts  # noqa: E402  (bench/ is no package)


def captured(part: str, batch: int, length: int, forms: set):
    """The captured program of one block's forward and backward, and the forms it took (those
    of ``forms`` only: read)."""
    import torch

    from torchtpu import metrics
    from torchtpu.lowering import registry

    if "read" not in forms:
        registry.READ_FORMS.clear()
    from torchtpu.testing.llama import Attention, Block, LlamaConfig

    c = LlamaConfig(seq=length)
    torch.manual_seed(0)
    module = (Block if part == "block" else Attention)(c).to("tpu")
    x = torch.randn(batch, length, c.dim, device="tpu", requires_grad=True)
    angle = torch.randn(length, c.head_dim, device="tpu")
    cos, sin = angle.cos(), angle.sin()
    g = torch.tpu.TPUGraph()
    before = metrics.snapshot()
    with torch.tpu.graph(g), torch.autocast("tpu", dtype=torch.bfloat16):
        module(x, cos, sin).float().square().sum().backward()
    after = metrics.snapshot()
    forms = {k: after.get(k, 0) - before.get(k, 0) for k in ("read_forms",)}
    return g.captured, forms


def twin(batch: int, length: int):
    """The JAX twin's attention block (``bench/tpu_llama.py``, splash attention), its gradients
    by JAX's autodiff: the function and its arguments."""
    import jax
    import jax.numpy as jnp
    import tpu_llama

    c = tpu_llama.config(seq=length)
    attend = tpu_llama.splash_attention(512, 512, True)
    f32, bf16 = jnp.float32, jnp.bfloat16

    def loss(ws, x, cos, sin):
        b, t, heads, d = batch, length, c.heads, c.head_dim
        q, k, v = (tpu_llama._linear(x, w).reshape(b, t, heads, d).transpose(0, 2, 1, 3)
                   for w in ws[:3])
        cos, sin = cos.astype(bf16), sin.astype(bf16)
        y = attend(tpu_llama._rotate(q, cos, sin), tpu_llama._rotate(k, cos, sin), v)
        out = tpu_llama._linear(y.transpose(0, 2, 1, 3).reshape(b, t, c.dim), ws[3])
        return jnp.sum(out.astype(f32) ** 2)

    args = ([jax.ShapeDtypeStruct((c.dim, c.dim), f32)] * 4,
            jax.ShapeDtypeStruct((batch, length, c.dim), f32),
            jax.ShapeDtypeStruct((length, c.head_dim), f32),
            jax.ShapeDtypeStruct((length, c.head_dim), f32))
    return jax.jit(jax.grad(loss, argnums=(0, 1))), args


def main(argv: list | None = None) -> dict:
    p = argparse.ArgumentParser(prog="bench/block_capture.py", description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("block", "attention", "twin"), default="block")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--target", default="v5e:1x1")
    p.add_argument("--dump", default=None)
    p.add_argument("--forms", default="read", help="the recorded forms kept on ('' for none)")
    args = p.parse_args(argv)
    dump = args.dump or tempfile.mkdtemp(prefix="block_capture_")
    os.environ["TORCHTPU_TPU_DUMP"] = dump
    from torchtpu.targets import tpu_target

    tpu_target._twin_seconds = lambda parsed, devs, **_: (None, "")  # the dump's cycles only
    name = f"block_capture_{args.part}_{args.batch}x{args.length}"
    if args.part == "twin":
        import jax

        fn, fn_args, forms = *twin(args.batch, args.length), None
        with jax.enable_x64(False), jax.default_matmul_precision("default"):
            r = tpu_target.compile_function(fn, *fn_args, name=name, target_name=args.target)
    else:
        program, forms = captured(args.part, args.batch, args.length,
                                  set(args.forms.split(",")))
        r = tpu_target.compile_function(program._fn.jitted, *program._io.arguments(),
                                        name=name, kind="step", target_name=args.target)
    if r.error:
        sys.exit(f"{name}: {r.error}")
    with open(sorted(glob.glob(os.path.join(dump, f"{name}.*.hlo.txt")))[-1]) as f:
        copies, cycles = attention_layouts.copies_and_cycles(f.read())
    kinds = collections.Counter(copies)
    print(f"{name}: forms {forms}, {len(copies)} copies, {cycles / 1e6:.3f} M estimated "
          f"cycles", flush=True)
    for kind, n in kinds.most_common():
        print(f"  {n} x {kind}")
    return {"forms": forms, "copies": dict(kinds), "mcycles": cycles / 1e6, "dump": dump}


if __name__ == "__main__":
    main()
