"""TorchTitan 0.3 on torch 2.13: the one call it makes that this torch lacks.

TorchTitan 0.3 tracks PyTorch's development branch. After the first training step it lowers every
process group's timeout with ``torch.distributed.set_timeout`` (unconditionally, on any device),
which torch 2.13 does not have; its private ``_set_pg_timeout`` does the same for the groups
whose backend has a timeout to change (gloo, NCCL) and leaves the others alone (tpu_dist has
none: its collectives wait on the host store with the group's own timeout). Everything else
TorchTitan needs is in torchtpu itself or in TorchTitan's settings (README, TorchTitan), so this
is applied only by the launcher ``python -m torchtpu.titan``, never at import.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


def _set_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
    backend = dist.get_backend(group)
    if "gloo" in backend or "nccl" in backend:  # the others have nothing to set (module doc)
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def patch() -> None:
    """Give ``torch.distributed`` the ``set_timeout`` TorchTitan calls, where it has none."""
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = _set_timeout


def main() -> None:
    """``python -m torchtitan.train`` with :func:`patch` applied (arguments from sys.argv)."""
    patch()
    from torchtitan.train import main as train

    train()
