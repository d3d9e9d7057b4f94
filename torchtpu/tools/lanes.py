"""What a TPU's 128-lane tiles make of a model's attention: head dims that are no multiple of 128.

A TPU lays an array's last dim across 128 lanes; attention's matmuls contract over (and emit) the
head dim, so a head dim of 64 fills half of each tile (padded to 128) and the MXU does twice the
work per useful flop. ``head_dims(model)`` reads them from the model's modules and configs
(``head_dim``, else hidden size / heads); ``advice(model)`` is one sentence per head dim that pads.
Used by ``python -m torchtpu.aot`` and ``python -m torchtpu.diagnose``; XLA:CPU shows none of it.
"""

from __future__ import annotations

import torch

LANES = 128


def head_dims(model: torch.nn.Module) -> set:
    """The attention head dims of model's modules (and their configs)."""
    dims = set()
    for module in model.modules():
        config = getattr(module, "config", None)
        for holder in (module, config):
            head = getattr(holder, "head_dim", None)
            if head is None:
                hidden = getattr(holder, "hidden_size", None) or getattr(holder, "embed_dim", None)
                heads = getattr(holder, "num_attention_heads", None) or getattr(
                    holder, "num_heads", None)
                if isinstance(hidden, int) and isinstance(heads, int) and heads:
                    head = hidden // heads
            if isinstance(head, int) and head > 0:
                dims.add(head)
    return dims


def advice(model: torch.nn.Module) -> list:
    """One sentence per head dim of model that pads on a TPU (none when all are multiples)."""
    return [f"attention head dim {size} pads to {-(-size // LANES) * LANES} lanes on TPU (a tile "
            f"is {LANES} wide; {size / (-(-size // LANES) * LANES):.0%} of each used): head dims "
            "of 128-256 use the MXU fully"
            for size in sorted(head_dims(model)) if size % LANES]
