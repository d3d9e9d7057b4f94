"""``torch_xla.experimental.distributed_checkpoint`` (``xc``): ``SPMDSavePlanner`` and
``SPMDLoadPlanner`` are ``torch.distributed.checkpoint``'s default planners. PyTorch/XLA's plan
the shards of one process's SPMD tensors; with one process per device, each rank's tensors (or
DTensors) are what DCP's own planners save and load."""

from __future__ import annotations

from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

from torchtpu.integrations.torch_xla import _missing

SPMDSavePlanner = DefaultSavePlanner
SPMDLoadPlanner = DefaultLoadPlanner

__getattr__ = _missing.module_getattr(__name__.replace("torchtpu.integrations.", ""))
