"""The Llama row's loss alone, captured and compiled for a TPU target: ours against the JAX twin's.

``F.cross_entropy(logits.float(), targets)`` forward and backward from bfloat16 logits (the
whole step's loss: ``torchtpu.testing.llama``), captured with ``torch.tpu.graph`` as the whole
step captures it (``eager/capture.py``: its read and producer forms applied; ``--forms ''``
without the producer forms), beside the JAX twin's loss (``bench/tpu_llama.py``: float32
``jax.nn.log_softmax`` and ``take_along_axis``, differentiated by JAX), at the chip row's shapes
(8,192 tokens x a 32,768 vocabulary), compiled for one chip with libtpu (nothing runs). Printed
per side: the optimized entry's estimated cycles, the cost model's bytes accessed and HBM
temporaries, and its largest instructions.

    /work/venvs/tpu/bin/python bench/loss_capture.py [--tokens 8192] [--vocab 32768]
        [--sides ours,twin] [--forms producer] [--target v5e:1x1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import head_loss  # noqa: E402  (bench/ is no package)


def ours(tokens: int, vocab: int, forms: set):
    """The captured program of the loss's forward and backward and its arguments."""
    import torch
    import torch.nn.functional as F

    from torchtpu.lowering import registry

    if "producer" not in forms:
        registry.PRODUCER_FORMS.clear()
    logits = torch.zeros(tokens, vocab, dtype=torch.bfloat16, device="tpu", requires_grad=True)
    targets = torch.zeros(tokens, dtype=torch.long, device="tpu")
    out = torch.zeros((), device="tpu")  # the loss kept: a capture returns what it stores
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        loss = F.cross_entropy(logits.float(), targets)
        loss.backward()
        out.copy_(loss.detach())
    return g.captured._fn.jitted, g.captured._io.arguments()


def twin(tokens: int, vocab: int):
    """The JAX twin's loss (its form in ``bench/tpu_llama.py``), its value and the logits'
    gradient by JAX's autodiff."""
    import jax
    import jax.numpy as jnp

    def loss(logits, t):
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        return -jnp.take_along_axis(logp, t[:, None], -1).mean()

    return jax.jit(jax.value_and_grad(loss)), (
        jax.ShapeDtypeStruct((tokens, vocab), jnp.bfloat16),
        jax.ShapeDtypeStruct((tokens,), jnp.int32))


def main(argv: list | None = None) -> dict:
    p = argparse.ArgumentParser(prog="bench/loss_capture.py", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--sides", default="ours,twin")
    p.add_argument("--forms", default="producer", help="'' for none")
    p.add_argument("--target", default="v5e:1x1")
    p.add_argument("--top", type=int, default=6)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dump = tempfile.mkdtemp(prefix="loss_capture_")
    os.environ["TORCHTPU_TPU_DUMP"] = dump
    import jax

    from torchtpu.targets import tpu_target

    tpu_target._twin_seconds = lambda parsed, devs, **_: (None, "")  # the dump's cycles only
    out: dict = {}
    for side in args.sides.split(","):
        name = f"loss_{side}_{args.tokens}x{args.vocab}"
        if side == "twin":
            fn, fn_args = twin(args.tokens, args.vocab)
            with jax.enable_x64(False):
                r = tpu_target.compile_function(fn, *fn_args, name=name,
                                                target_name=args.target)
        else:
            fn, fn_args = ours(args.tokens, args.vocab, set(args.forms.split(",")))
            r = tpu_target.compile_function(fn, *fn_args, name=name, kind="step",
                                            target_name=args.target)
        out[side] = head_loss.report(r, name, dump, args.top)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
