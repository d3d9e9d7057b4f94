"""``torch_xla.distributed.spmd.xla_sharding``: the names of ``xs`` (their home in PyTorch/XLA)."""

from torchtpu.integrations.torch_xla import _missing
from torchtpu.integrations.torch_xla.distributed.spmd import (  # noqa: F401
    Mesh,
    ShardingSpec,
    XLAShardedTensor,
    clear_sharding,
    get_1d_mesh,
    get_global_mesh,
    mark_sharding,
    mark_sharding_with_gradients,
    placements,
    set_global_mesh,
    wrap_if_sharded,
)

__getattr__ = _missing.module_getattr(__name__.replace("torchtpu.integrations.", ""))
