"""Activation checkpointing's saving on a Llama step: XLA's memory figures with and without it.

The registry's Llama-3.2 row (``bench/registry.py``) at 8 layers, one training step (loss and
gradients). Checkpointing is Hugging Face's switch,
``model.activation_checkpointing_enable(...)`` (``gradient_checkpointing_enable`` where that is
missing: its deprecated alias in Transformers 5.24), which wraps each
decoder layer in ``torch.utils.checkpoint.checkpoint``: ``reentrant``, ``non_reentrant``, and
``selective`` (non-reentrant, saving the matmuls' outputs through
``create_selective_checkpoint_contexts``). Three ways of compiling the step:

- ``captured``: ``torch.tpu.graph`` around the step, forward and backward one XLA program;
  the figure is its temporary bytes, where the activations the backward keeps live;
- ``whole_step``: ``torch.compile(step, backend="tpu")`` of a step calling ``backward()``, the
  default (one captured program per call; the figure as for ``captured``);
- ``dynamo``: ``torch.compile`` of the loss alone (Dynamo's graphs, AOTAutograd's forward and
  backward programs); the figure is what the forward hands the backward (its outputs, the loss
  apart: the saved activations) plus the backward's temporaries.

Per form and path: that figure (XLA's memory analysis, ``torchtpu.testing.program_memory``;
independent of load) and the largest gradient difference from CPU eager without checkpointing.
The causal mask is passed as a 4-D tensor: with checkpointing transformers turns its KV cache
off, and without a cache its 2-D mask code reads device values on the host (the packed-sequence
search, ``fast_all``), which a capture refuses.

    python bench/checkpoint_memory.py [--layers 8] [--forms none reentrant ...] [--paths ...]
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

from torchtpu.testing.program_memory import memory_stats

_spec = importlib.util.spec_from_file_location(
    "bench_registry", os.path.join(os.path.dirname(os.path.abspath(__file__)), "registry.py"))
registry = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # (dataclasses)
_spec.loader.exec_module(registry)

FORMS = ("none", "reentrant", "non_reentrant", "selective")
PATHS = ("captured", "whole_step", "dynamo")


def enable(model, form: str):
    """model in training mode, checkpointed in form (Hugging Face's switch)."""
    if form != "none":
        kwargs = {"use_reentrant": form == "reentrant"}
        if form == "selective":
            kwargs["context_fn"] = functools.partial(
                ckpt.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
        switch = getattr(model, "activation_checkpointing_enable", None)
        if switch is None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        else:
            switch(activation_checkpointing_kwargs=kwargs)
    return model.train()


def causal_mask(x: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) boolean causal mask, True where a query sees a key."""
    b, s = x.shape
    keep = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
    return keep.expand(b, 1, s, s)


def loss_of(model, x, y, mask):
    return F.cross_entropy(model(input_ids=x, attention_mask=mask, use_cache=False)
                           .logits.flatten(0, 1), y.flatten())


def _captured(model, x, y, mask) -> int:
    graph = torch.tpu.TPUGraph()
    with torch.tpu.graph(graph):
        loss_of(model, x, y, mask).backward()
    graph.replay()
    return memory_stats(graph.captured.hlo()).temp_size_in_bytes


def _whole_step(model, x, y, mask) -> int:
    def step(x, y, mask):
        for p in model.parameters():
            p.grad = None
        loss = loss_of(model, x, y, mask)
        loss.backward()
        return loss

    compiled = torch.compile(step, backend="tpu")
    compiled(x, y, mask)  # the first call runs once and is not kept
    compiled(x, y, mask)
    (kept,) = compiled._steps.values()
    return memory_stats(kept.captured.hlo()).temp_size_in_bytes


def _dynamo(model, x, y, mask) -> int:
    programs: list = []
    compiled = torch.compile(functools.partial(loss_of, model), backend="tpu",
                             options={"debug_callback": lambda gm, text: programs.append(text)})
    compiled(x, y, mask).backward()
    if len(programs) != 2:
        raise RuntimeError(f"expected one forward and one backward program, got {len(programs)}")
    fw, bw = (memory_stats(text) for text in programs)
    loss_bytes = 4
    return fw.output_size_in_bytes - loss_bytes + bw.temp_size_in_bytes


MEASURES = {"captured": _captured, "whole_step": _whole_step, "dynamo": _dynamo}


def batch():
    return registry.tokens(registry.HF_VOCAB, registry.HF_SEQ, registry.HF_BATCH)(
        torch.Generator().manual_seed(0))


def measure(path: str, form: str, layers: int, cpu_grads: list) -> tuple[int, float]:
    """(the path's memory figure in bytes, largest gradient difference from CPU)."""
    torch._dynamo.reset()
    x, y = batch()
    model = enable(registry.hf("llama-3.2", num_hidden_layers=layers)().to("tpu"), form)
    xd, yd = x.to("tpu"), y.to("tpu")
    figure = MEASURES[path](model, xd, yd, causal_mask(xd))
    diff = max((p.grad.cpu() - g).abs().max().item()
               for p, g in zip(model.parameters(), cpu_grads, strict=True))
    return figure, diff


def cpu_gradients(layers: int) -> list:
    """The unchecked CPU step's gradients."""
    x, y = batch()
    model = registry.hf("llama-3.2", num_hidden_layers=layers)().train()  # seeded
    loss_of(model, x, y, causal_mask(x)).backward()
    return [p.grad for p in model.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS))
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    args = parser.parse_args()
    grads = cpu_gradients(args.layers)
    print(f"Llama-3.2 row, {args.layers} layers, seq {registry.HF_SEQ}, batch "
          f"{registry.HF_BATCH}: one training step (loss + gradients)")
    print("| path | form | MB | vs none | max grad diff from CPU |")
    print("| --- | --- | ---: | ---: | ---: |")
    for path in args.paths:
        plain = None
        for form in args.forms:
            figure, diff = measure(path, form, args.layers, grads)
            plain = figure if form == "none" else plain
            share = f"{figure / plain - 1:+.0%}" if plain else ""
            print(f"| {path} | {form} | {figure / 1e6:.2f} | {share} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
