"""A scenario multi-process tests share: ``outwait_timeout``, a rank sleeping past the group's
timeout (the ranks themselves run through ``torchtpu.distributed.spawn``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def outwait_timeout(rank: int, sleep: float, call: Callable[[], Any]) -> tuple | None:
    """A hang: rank 1 sleeps ``sleep`` seconds (past the group's timeout) while the other ranks
    run ``call()`` (a collective), which must raise ``DistBackendError``; their (message,
    seconds it took), None on rank 1 (an error if it did not raise)."""
    import torch.distributed as dist

    if rank == 1:
        time.sleep(sleep)
        return None
    start = time.monotonic()
    try:
        call()
    except dist.DistBackendError as e:
        return str(e), time.monotonic() - start
    raise AssertionError("the collective returned while rank 1 slept past the timeout")
