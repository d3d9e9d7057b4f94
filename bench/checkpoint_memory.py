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

from torchtpu.testing.checkpoint_memory import FORMS, PATHS, cpu_gradients, measure
from torchtpu.testing.hf_rows import HF_BATCH, HF_SEQ


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS))
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    args = parser.parse_args()
    grads = cpu_gradients(args.layers)
    print(f"Llama-3.2 row, {args.layers} layers, seq {HF_SEQ}, batch "
          f"{HF_BATCH}: one training step (loss + gradients)")
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
