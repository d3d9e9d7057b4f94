"""Each kind of per-layer weight of a served model in one ``[layers, ...]`` storage.

A captured step's program takes every storage it reads as an argument, and its launch pays per
argument twice: JAX's C++ call (~1.6 µs an argument on the v5e's host) and the replay's identity
check of each storage (``eager/replay_io.py``). Qwen2.5-0.5B's 24 layers hold 168 weights, so a
decode step took 197 arguments, ~0.45 ms of a 2.15-ms batch-1 step on the chip
(bench/RESULTS.md, serving9). After vLLM loads the model, :func:`stack_layer_weights` copies
each kind of layer weight (``model.layers.*.mlp.down_proj.weight`` across the layers) into one
storage and makes each layer's parameter a view ``stacked[i]`` of it, the same Parameter object
with its attributes (vLLM's weight loaders among them): a step then reads ~30 storages. Each
layer's weight is read inside the program as a slice of the stacked array in its own layout,
which XLA takes inside the product's fusion (no weight-sized copy; serving10's compile-only check
for v5e). A weight written later (TRL's or verl's push through ``load_weights``) is written
through the view, into the stacked storage.

``vectors_only`` stacks the 1-D kinds alone (norms, biases: Qwen2.5-0.5B's 72 of 168): on the
v5e XLA prefetches each separate layer's weight matrix into VMEM and reads a stacked one from
HBM (batch 64's device step +0.44 ms, session 27), while a vector is read whole by small ops
either way, so stacking the vectors cuts arguments at no device cost.
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch

from torchtpu.device.tensors import covers_storage

# the layer index in a parameter's name: "model.layers.7.mlp.down_proj.weight"
_LAYER = re.compile(r"\.(\d+)\.")


def _kinds(model: torch.nn.Module) -> dict[str, list[tuple[int, torch.nn.Parameter]]]:
    """Parameters by name with their first layer index left out, each with that index."""
    kinds: dict = defaultdict(list)
    for name, p in model.named_parameters():
        m = _LAYER.search(name)
        if m is not None:
            key = f"{name[:m.start()]}.*.{name[m.end():]}"
            kinds[key].append((int(m.group(1)), p))
    return kinds


def _stackable(group: list[tuple[int, torch.nn.Parameter]]) -> bool:
    """Layers 0..n-1 (n > 1), each a whole tpu storage of its own, of one shape and dtype."""
    first = group[0][1]
    return (len(group) > 1 and [i for i, _ in group] == list(range(len(group)))
            and all(p.device.type == "tpu" and p.shape == first.shape
                    and p.dtype == first.dtype and covers_storage(p) for _, p in group)
            and len({p.untyped_storage().data_ptr() for _, p in group}) == len(group))


def stack_layer_weights(model: torch.nn.Module, vectors_only: bool = False) -> int:
    """Stack each kind of per-layer weight of model (with ``vectors_only``, each 1-D kind) into
    one storage (module doc); the number of storages the layers' weights took before less those
    they take now."""
    removed = 0
    for group in _kinds(model).values():
        group.sort(key=lambda ip: ip[0])
        if not _stackable(group) or (vectors_only and group[0][1].dim() != 1):
            continue
        # one kind at a time: the device holds one kind's layers twice at most
        stacked = torch.stack([p.detach() for _, p in group])
        for i, p in group:
            p.data = stacked[i]
        removed += len(group) - 1
    return removed
