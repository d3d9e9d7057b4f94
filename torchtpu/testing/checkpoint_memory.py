"""Activation checkpointing's saving on a Llama step, measured by XLA's memory analysis.

The benchmark registry's Llama-3.2 row (``testing/hf_rows.py``) for one training step (loss and
gradients), checkpointed by Hugging Face's switch in a form of ``FORMS`` and compiled along a
path of ``PATHS``; :func:`measure` gives the path's memory figure (the bytes the backward keeps)
and the largest gradient difference from CPU's unchecked step. ``bench/checkpoint_memory.py``
prints the table; ``tests/test_checkpoint.py`` holds its figures down. The causal mask is passed
as a 4-D tensor: with checkpointing transformers turns its KV cache off, and without a cache its
2-D mask code reads device values on the host (the packed-sequence search), which a capture
refuses.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils import checkpoint as ckpt

from torchtpu.testing.hf_rows import HF_BATCH, HF_SEQ, HF_VOCAB, hf, tokens
from torchtpu.testing.program_memory import memory_stats

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
        raise RuntimeError("torchtpu.compile: expected one forward and one backward program, "
                           f"got {len(programs)}")
    fw, bw = (memory_stats(text) for text in programs)
    loss_bytes = 4
    return fw.output_size_in_bytes - loss_bytes + bw.temp_size_in_bytes


MEASURES = {"captured": _captured, "whole_step": _whole_step, "dynamo": _dynamo}


def batch():
    return tokens(HF_VOCAB, HF_SEQ, HF_BATCH)(
        torch.Generator().manual_seed(0))


def measure(path: str, form: str, layers: int, cpu_grads: list) -> tuple[int, float]:
    """(the path's memory figure in bytes, largest gradient difference from CPU)."""
    if path not in MEASURES or form not in FORMS:
        raise ValueError(f"torchtpu.argument: path {path!r} or form {form!r} unknown: paths "
                         f"{PATHS}, forms {FORMS}")
    torch._dynamo.reset()
    x, y = batch()
    model = enable(hf("llama-3.2", num_hidden_layers=layers)().to("tpu"), form)
    xd, yd = x.to("tpu"), y.to("tpu")
    figure = MEASURES[path](model, xd, yd, causal_mask(xd))
    diff = max((p.grad.cpu() - g).abs().max().item()
               for p, g in zip(model.parameters(), cpu_grads, strict=True))
    return figure, diff


def cpu_gradients(layers: int) -> list:
    """The unchecked CPU step's gradients."""
    x, y = batch()
    model = hf("llama-3.2", num_hidden_layers=layers)().train()  # seeded
    loss_of(model, x, y, causal_mask(x)).backward()
    return [p.grad for p in model.parameters()]
