"""``init_process_group(..., device_id=torch.device("tpu:N"))``: the group bound to this process's
device, as CUDA scripts ask.

c10d asks the new group for its backend on that device right after creating it
(``pg._get_backend(device_id)``, to connect NCCL eagerly); a Python process group has no C++
backend per device, so ``TpuProcessGroup._get_backend`` answers through ``bind`` here: the
device must be this process's (``tpu:0`` or ``tpu:LOCAL_RANK``, ``runtime.platform``'s rule),
and the answer is the group's gloo backend, which carries its headers and supports no splitting
(so c10d connects nothing more). Every rank posts its verdict in the group's store and reads the
others', so a refused ``device_id`` raises on every rank, naming the rank and the index, within
the group's timeout (a rank that never asks makes the others time out, saying so).

The group does not take c10d's ``bound_device_id``: with it set, ``init_device_mesh`` would
build sub-groups by NCCL's communicator splitting, which tpu_dist does not do (it creates them
as ``new_group`` does). One process drives one device, so there is nothing else to bind.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from torchtpu import errors
from torchtpu.device import control

_KEY = "tpu_dist/device_id/"


def bind(store: dist.Store, rank: int, size: int, device: torch.device,
         timeout: datetime.timedelta) -> None:
    """Check that device is this process's and that every rank's device_id was its own; raise
    on every rank otherwise."""
    try:
        control.set_device(device)
        verdict = ""
    except RuntimeError as e:
        verdict = f"rank {rank} was given device_id={device}, which is not its device: {e}"
    store.set(f"{_KEY}{rank}", verdict)
    keys = [f"{_KEY}{r}" for r in range(size)]
    try:
        store.wait(keys, timeout)
    except RuntimeError as e:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise dist.DistBackendError(errors.message(
            "distributed", f"tpu_dist: init_process_group(device_id={device}): rank(s) "
            f"{missing} did not bind a device within {timeout.total_seconds():g} s (every rank "
            f"must pass device_id, or none): {e}")) from None
    refused = [v for v in (store.get(key).decode() for key in keys) if v]
    if refused:
        raise ValueError(errors.message("distributed", "tpu_dist: init_process_group: "
                                        + "; ".join(refused)))
