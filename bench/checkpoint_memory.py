"""Activation checkpointing's saving on a Llama step: XLA's temporaries with and without it.

The registry's Llama-3.2 row (``bench/registry.py``) at 8 layers, one training step (loss and
gradients) captured with ``torch.tpu.graph``, so forward and backward are one XLA program whose
temporaries hold what the backward keeps. Checkpointing is Hugging Face's switch,
``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)``, which wraps each
decoder layer in ``torch.utils.checkpoint.checkpoint``: ``reentrant``, ``non_reentrant``, and
``selective`` (non-reentrant, saving the matmuls' outputs through
``create_selective_checkpoint_contexts``). Per form: the program's temporary bytes (XLA's memory
analysis, ``torchtpu.testing.program_memory``; independent of load) and the largest gradient
difference from CPU eager without checkpointing.

    python bench/checkpoint_memory.py [--layers 8] [--forms none reentrant ...]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils import checkpoint as ckpt

from torchtpu.testing.program_memory import temp_bytes

_spec = importlib.util.spec_from_file_location(
    "bench_registry", os.path.join(os.path.dirname(os.path.abspath(__file__)), "registry.py"))
registry = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # (dataclasses)
_spec.loader.exec_module(registry)

FORMS = ("none", "reentrant", "non_reentrant", "selective")


def _enable(model, form: str):
    if form != "none":
        kwargs = {"use_reentrant": form == "reentrant"}
        if form == "selective":
            kwargs["context_fn"] = functools.partial(
                ckpt.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model.train()


def _loss(model, x, y):
    # With no cache and no mask, transformers reads a device value on the host to look for
    # packed sequences, which a capture cannot do: an all-ones mask skips that search.
    return F.cross_entropy(model(input_ids=x, attention_mask=torch.ones_like(x),
                                 use_cache=False).logits.flatten(0, 1), y.flatten())


def measure(form: str, layers: int, cpu_grads: list) -> tuple[int, float]:
    """(temporary bytes of the captured step, largest gradient difference from CPU)."""
    x, y = registry.tokens(registry.HF_VOCAB, registry.HF_SEQ, registry.HF_BATCH)(
        torch.Generator().manual_seed(0))
    model = _enable(registry.hf("llama-3.2", num_hidden_layers=layers)().to("tpu"), form)
    xd, yd = x.to("tpu"), y.to("tpu")
    graph = torch.tpu.TPUGraph()
    with torch.tpu.graph(graph):
        _loss(model, xd, yd).backward()
    graph.replay()
    diff = max((p.grad.cpu() - g).abs().max().item()
               for p, g in zip(model.parameters(), cpu_grads, strict=True))
    return temp_bytes(graph.captured.hlo()), diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS))
    args = parser.parse_args()
    x, y = registry.tokens(registry.HF_VOCAB, registry.HF_SEQ, registry.HF_BATCH)(
        torch.Generator().manual_seed(0))
    model = registry.hf("llama-3.2", num_hidden_layers=args.layers)().train()  # seeded
    _loss(model, x, y).backward()
    grads = [p.grad for p in model.parameters()]
    plain = None
    print(f"Llama-3.2 row, {args.layers} layers, seq {registry.HF_SEQ}, batch "
          f"{registry.HF_BATCH}: one captured step (loss + gradients)")
    print("| form | temporaries MB | vs none | max grad diff from CPU |")
    print("| --- | ---: | ---: | ---: |")
    for form in args.forms:
        temp, diff = measure(form, args.layers, grads)
        plain = temp if form == "none" else plain
        share = f"{temp / plain - 1:+.0%}" if plain else ""
        print(f"| {form} | {temp / 1e6:.2f} | {share} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
