"""The whole step's program with pieces of the lowering table swapped, as StableHLO, and what the
TPU compiler makes of each: the tool of bench/RESULTS.md's whole6 (the column-major residual
stream and the relayout copies of the 1-block capture, against the JAX twin).

``capture`` (any venv): ``torch.compile(step, backend="tpu")`` of ``torchtpu.testing.llama``'s
step at 1 block, 8 x 1024 tokens, its program written as StableHLO text (lowered here, on the host's
platform: ``lax.platform_dependent`` forms take their default branch) instead of run; variants:
``mlp`` (no attention sublayer), ``noopt`` (forward and backward only), ``flat`` (the model held
2-D, tokens x features, from the embedding on), ``clip_take`` (the embedding's gather clipped
instead of NaN-filled), ``split_mm`` (half products over more than 1024 rows contracted as
(rows / 1024, 1024)).

``compile`` (/work/venvs/tpu, libtpu): each file compiled for v5e:1x1; per file the estimated
cycles summed over the optimized entry, the [tokens, 1024]-like arrays by layout (column-major:
any non-row-major layout), the entry's copies.

``breakdown`` (any venv): an optimized HLO's (e.g. ``bench/aot_llama.py --dump DIR``'s) estimated
cycles by the step's part (head, loss, attention, MLP, norms, optimizer: ``_part``, told by the
shapes each instruction touches at the chip row's dims) and its largest instructions.

    python bench/layout_bisect.py capture --variants mlp,noopt --vocab 8192 --out /tmp/a.mlir
    /work/venvs/tpu/bin/python bench/layout_bisect.py compile /tmp/a.mlir [more.mlir]
    python bench/layout_bisect.py breakdown DIR/captured_graph_*.hlo.txt
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import tempfile


def _patch(op, fn) -> None:
    from torchtpu.lowering import registry

    registry.TABLE[op] = dataclasses.replace(registry.TABLE[op], fn=fn)


def _split_mm(x, y):
    import jax.numpy as jnp
    from jax import lax

    (m, k), n, rows = x.shape, y.shape[-1], 1024
    if x.ndim == y.ndim == 2 and x.dtype == jnp.bfloat16 and k > rows and k % rows == 0:
        out = lax.dot_general(x.reshape(m, k // rows, rows), y.reshape(k // rows, rows, n),
                              (((1, 2), (0, 1)), ((), ())), preferred_element_type=jnp.float32)
        return out.astype(x.dtype)
    return jnp.matmul(x, y, preferred_element_type=jnp.float32).astype(x.dtype)


def capture(variants: set, vocab: int, out: str) -> None:
    import jax
    import jax.numpy as jnp
    import torch
    import torch.nn.functional as F

    from torchtpu.eager.capture import Captured
    from torchtpu.testing import llama

    aten = torch.ops.aten
    if "clip_take" in variants:
        _patch(aten.embedding.default, lambda w, i, *_: jnp.take(w, i, axis=0, mode="clip"))
    if "split_mm" in variants:
        _patch(aten.mm.default, _split_mm)
    if "mlp" in variants:
        def block(self, x, cos, sin):
            h = self.mlp_norm(x)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))
        llama.Block.forward = block
    if "flat" in variants:
        def model(self, ids, targets):
            x = self.embed(ids.reshape(-1))
            for blk in self.blocks:
                x = blk(x, None, None)
            return F.cross_entropy(self.head(self.norm(x)).float(), targets.reshape(-1))
        llama.Llama.forward = model
    c = llama.LlamaConfig(layers=1, seq=1024, vocab=vocab)
    torch.manual_seed(0)
    with torch.device("tpu"):
        net = llama.Llama(c)
    step, opt = llama.train_step(net)
    if "noopt" in variants:
        def step(ids, targets):
            with torch.autocast("tpu", dtype=torch.bfloat16):
                loss = net(ids, targets)
            loss.backward()
            return loss
    step = torch.compile(step, backend="tpu")
    ids = torch.randint(vocab, (8, 1025))
    x, y = ids[:, :-1].contiguous().to("tpu"), ids[:, 1:].contiguous().to("tpu")

    def replay(self, bind=None):  # written, not run: its outputs are zeros
        args = self._io.arguments(bind)
        with open(out, "w") as f:
            f.write(self._fn.jitted.lower(*args).as_text())
        shapes = jax.eval_shape(self._fn.jitted, *args)
        self._io.store(args, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))

    Captured.replay = replay
    step(x, y)
    step(x, y)  # the steady program (AdamW's moments made by the first)
    print("wrote", out)


def facts(hlo: str) -> dict:
    """Estimated cycles, [n, 1024]-like arrays by layout, and copies of the optimized entry."""
    entry = hlo[hlo.find("ENTRY"):]
    layouts = collections.Counter(
        (m.group(1), m.group(2), m.group(3))
        for m in re.finditer(r"= (f32|bf16)\[(\d+,1024|\d+,1024,\d+)\]\{([\d,]+)", entry))
    return {"mcycles": sum(int(x) for x in re.findall(r'"estimated_cycles":"(\d+)"', entry)) / 1e6,
            "column_major": sum(n for (_, _, lay), n in layouts.items()
                                if lay not in ("1,0", "2,1,0")),
            "copies": len(re.findall(r"= \S+ copy\(", entry)), "layouts": dict(layouts)}


# The chip row's dims: what tells an instruction's part of the step by the shapes it touches.
_WEIGHTS = {(1024,), (1024, 1024), (2816, 1024), (1024, 2816), (32768, 1024)}


def _part(product: bool, custom: bool, shapes: list) -> str:
    """The step's part an entry instruction belongs to, from the array shapes it writes and
    reads: products by their widths, the rest by what they touch."""
    dims = {d for s in shapes for d in s}
    weights_only = all(s in _WEIGHTS or len(s) <= 1 and 8192 not in s for s in shapes)
    if custom or any(len(s) >= 4 and 128 in s for s in shapes):
        return "attention"
    if product:
        return "head" if 32768 in dims else "mlp" if 2816 in dims else "attention"
    if weights_only:
        return "optimizer" if 32768 not in dims else "optimizer (embed, head)"
    if 32768 in dims or (8192,) in shapes:
        return "loss"
    return "mlp" if 2816 in dims else "norms, residual"


def breakdown(hlo: str) -> dict:
    """Estimated M cycles of the optimized entry by the step's part (``_part``), and the 30
    largest instructions with theirs."""
    entry = hlo[hlo.find("ENTRY"):]
    shape_re = r"[a-z]+\d*\[([\d,]*)\]"
    shape_of, bodies, name = {}, {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?(%[\w.\-]+) \(", line)
        if head:
            name = head.group(1)
        elif name and "convolution(" in line or "dot(" in line:
            bodies[name] = True
        m = re.match(r"\s*(?:ROOT )?(%[\w.\-]+) = (\([^=]*?\)|\S+) ", line)
        if m:
            shape_of[m.group(1)] = [tuple(int(d) for d in s.split(",") if d)
                                    for s in re.findall(shape_re, m.group(2))]
    parts: collections.Counter = collections.Counter()
    top = []
    for line in entry.splitlines():
        cycles = re.search(r'"estimated_cycles":"(\d+)"', line)
        m = re.match(r"\s*(?:ROOT )?(%[\w.\-]+) = (?:\([^=]*?\)|\S+) ([a-z\-]+)\(([^)]*)\)", line)
        if not (cycles and m):
            continue
        called = re.search(r"calls=(%[\w.\-]+)", line)
        shapes = list(shape_of.get(m.group(1), []))
        for arg in m.group(3).split(","):
            shapes += shape_of.get(arg.strip(), [])
        product = m.group(2) in ("convolution", "dot") or bool(called and called.group(1) in bodies)
        part = _part(product, m.group(2) == "custom-call", shapes)
        parts[part] += int(cycles.group(1))
        aten = re.search(r"jit\((aten_\w+?)(?:_default|_Tensor|_Scalar)?\)", line)
        top.append((int(cycles.group(1)), part, m.group(1), aten.group(1) if aten else "",
                    shapes[0] if shapes else ()))
    return {"total": sum(parts.values()) / 1e6,
            "parts": {k: round(v / 1e6, 3) for k, v in parts.most_common()},
            "top": [(round(c / 1e6, 3), *rest) for c, *rest in sorted(top, reverse=True)[:30]]}


def compile_files(paths: list) -> None:
    dump = os.environ.setdefault("TORCHTPU_TPU_DUMP", tempfile.mkdtemp(prefix="layout_bisect_"))
    from torchtpu.targets import tpu_target

    for path in paths:
        name = os.path.basename(path).rsplit(".", 1)[0]
        with open(path) as f:
            report = tpu_target.compile_module(f.read(), name=name, kind="step",
                                               target_name="v5e:1x1")
        prefix = tpu_target._file_name(name) + "."
        hlo = max((os.path.join(dump, p) for p in os.listdir(dump) if p.startswith(prefix)),
                  key=os.path.getmtime)
        with open(hlo) as f:
            found = facts(f.read())
        print(f"{name}: {found['mcycles']:.3f} M cycles, cost model "
              f"{(report.seconds or 0) * 1e3:.2f} ms, column-major {found['column_major']}, "
              f"copies {found['copies']}  {hlo}\n    {found['layouts']}", flush=True)


def main(argv: list | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench/layout_bisect.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("capture")
    c.add_argument("--variants", default="")
    c.add_argument("--vocab", type=int, default=8192)
    c.add_argument("--out", required=True)
    for name in ("compile", "breakdown"):
        sub.add_parser(name).add_argument("files", nargs="+")
    args = p.parse_args(argv)
    if args.what == "capture":
        capture(set(filter(None, args.variants.split(","))), args.vocab, args.out)
    elif args.what == "compile":
        compile_files(args.files)
    else:
        for path in args.files:
            with open(path) as f:
                found = breakdown(f.read())
            print(f"{path}: {found['total']:.2f} M cycles {found['parts']}")
            for row in found["top"]:
                print("   ", *row)


if __name__ == "__main__":
    main()
