"""``torch.tpu.distributed``: the reference's distributed names, from ``torchtpu.distributed``."""

from torchtpu.distributed import BACKENDS, CollectiveMismatchError, Transport
from torchtpu.distributed.topology import topology_aware_mesh

__all__ = ["BACKENDS", "CollectiveMismatchError", "Transport", "topology_aware_mesh"]
