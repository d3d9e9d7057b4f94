"""``torch.tpu.distributed``: the reference's distributed names, from ``torchtpu.distributed``."""

from torchtpu.distributed import BACKENDS, CollectiveMismatchError

__all__ = ["BACKENDS", "CollectiveMismatchError"]
