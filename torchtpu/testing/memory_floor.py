"""PyTorch eager's memory floor for one training step, counted on the host without running it.

``eager_floor(build, inputs)`` adds up what a PyTorch eager step with AdamW holds: the
parameters, their gradients and AdamW's two moments (``exp_avg``, ``exp_avg_sq``: each the
parameters' dtype and size), plus the bytes autograd saves for backward in one forward
(``torch.autograd.graph.saved_tensors_hooks``, each storage once: a view saved twice, or a value
two ops save, is one storage; the parameters' own storages are counted as parameters, not again
as saved). It is a floor in the sense of what eager's way of training asks for, the four summed
as if held together; a real eager step frees gradients at ``zero_grad(set_to_none=True)`` and
saved values as backward reads them, so its peak can sit below the sum by up to the gradients,
and above it by the transients (the logits' gradient, the allocator's rounding).

The forward runs under ``FakeTensorMode`` on CPU: every tensor is metadata only, so a 450 M
parameter model at 8 x 1024 tokens is counted at full batch in a few seconds, with no scaling
and no memory. CPU autocast (``torch.autocast("cpu", dtype)``) casts as CUDA's and the tpu
device's do for these ops, and CPU's scaled-dot-product attention picks its flash kernel as CUDA
does (saving the output and log-sum-exp, not the probabilities). ``fake=False`` runs the same
count on real CPU tensors (for small models: the tests check the two agree).

``bench/on_tpu_llama.py`` prints each mode's peak device memory against this floor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

GIB = 2**30


@dataclass(frozen=True)
class Floor:
    """Bytes of each part of the floor; ``total`` their sum."""

    parameters: int
    gradients: int
    moments: int
    saved: int
    parameter_count: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.moments + self.saved

    def gib(self) -> dict:
        """Each part, and the total, in GiB (for a report)."""
        return {"parameters": self.parameters / GIB, "gradients": self.gradients / GIB,
                "moments": self.moments / GIB, "saved": self.saved / GIB,
                "total": self.total / GIB}


def eager_floor(build: Callable[[], nn.Module], inputs: Callable[[], tuple],
                dtype: torch.dtype | None = torch.bfloat16, moments: int = 2,
                fake: bool = True) -> Floor:
    """The eager floor of ``build()(*inputs())``'s training step: ``build`` makes the model
    (its parameters in the dtype they train in), ``inputs`` the forward's arguments, both
    called on CPU under ``FakeTensorMode`` (``fake``) or for real; the forward runs under
    ``torch.autocast("cpu", dtype)`` (none when ``dtype`` is ``None``). ``moments``: the
    optimizer's per-parameter states (AdamW: 2; SGD with momentum: 1)."""
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode
        mode = FakeTensorMode()
    else:
        mode = contextlib.nullcontext()
    with mode, torch.device("cpu"):
        model = build()
        args = inputs()
        params = [p for p in model.parameters() if p.requires_grad]
        held = {p.untyped_storage()._cdata for p in model.parameters()}
        # Each saved storage by its C++ identity, the storage kept so that none is freed and its
        # identity taken by another while the forward runs.
        saved: dict[int, torch.UntypedStorage] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage._cdata not in held:
                saved.setdefault(storage._cdata, storage)
            return t

        cast = torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
            model(*args)
        size = sum(p.numel() * p.element_size() for p in params)
        return Floor(parameters=sum(p.numel() * p.element_size() for p in model.parameters()),
                     gradients=size, moments=moments * size,
                     saved=sum(s.nbytes() for s in saved.values()),
                     parameter_count=sum(p.numel() for p in model.parameters()))
