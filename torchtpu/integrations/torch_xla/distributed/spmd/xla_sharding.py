"""``torch_xla.distributed.spmd.xla_sharding``: the names of ``xs`` (their home in PyTorch/XLA),
and ``apply_xla_patch_to_nn_linear``."""

import torch

from torchtpu.integrations.torch_xla import _missing
from torchtpu.integrations.torch_xla.distributed.spmd import (  # noqa: F401
    Mesh,
    ShardingSpec,
    XLAShardedTensor,
    apply_backward_optimization_barrier,
    clear_sharding,
    get_1d_mesh,
    get_global_mesh,
    mark_sharding,
    mark_sharding_with_gradients,
    placements,
    set_global_mesh,
    wrap_if_sharded,
)


def apply_xla_patch_to_nn_linear(module: torch.nn.Module, xs_mark_sharding=None) -> torch.nn.Module:
    """PyTorch/XLA swaps each ``nn.Linear``'s matmul for an einsum so that the compiler keeps
    the batch and sequence dims' sharding (a flattening reshape loses it); the values are the
    same. Sharding here is per process or DTensor's, so the module is returned as it is."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"torchtpu.argument: expected an nn.Module, got {type(module).__name__}")
    return module


__getattr__ = _missing.module_getattr(__name__.replace("torchtpu.integrations.", ""))
