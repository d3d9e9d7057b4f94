"""``torch_xla.distributed.fsdp``: ``checkpoint_module`` only (activation checkpointing of a
module: its forward under ``torch.utils.checkpoint``, recomputed in the backward). PyTorch/XLA's
FSDP wrappers are refused, naming ``fully_shard``."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from torchtpu.integrations.torch_xla import _missing


def checkpoint_module(module: torch.nn.Module) -> torch.nn.Module:
    """module, its forward recomputed in the backward instead of keeping its activations."""
    forward = module.forward

    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed
    return module


__getattr__ = _missing.module_getattr(__name__.replace("torchtpu.integrations.", ""))
