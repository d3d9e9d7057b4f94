"""Several ranks in one process, one thread each: ``run_threads(fn, world_size)``.

Each thread joins a process group of PyTorch's threaded test backend, whose collectives are
plain tensor ops (copies, sums) run by one of the ranks, so they work on tpu tensors and every
rank shares the process's compiled programs. That makes FSDP2, DTensor, tensor parallel and
DCP testable on device "tpu" at the cost of one process, on any machine. It exercises the
device layer under those libraries (storage frees, copy-in/copy-out, DTensor's local ops),
not the ``tpu_dist`` backend: multi-process tests (``torchtpu.distributed.spawn``) do that.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torchtpu import errors


def run_threads(fn: Callable[..., Any], world_size: int = 2, *, args: tuple = (),
                timeout: float = 120.0) -> list:
    """fn(rank, world_size, *args) on world_size threads in one process group; results by rank.

    Each rank gets its own copy of args' containers (dicts, lists, tuples; the tensors and other
    leaves are shared, read them only), as a process gets its own: libraries change the
    containers they are given (``set_model_state_dict`` puts the rank's DTensors into the dict it
    loads), and the other rank would read them (DTensors on another thread's DeviceMesh).

    Raises with every failing rank's traceback; a failing rank stops the others' collectives.
    A rank still running at the deadline stops them too, and this raises ``TimeoutError``.
    """
    from torch.testing._internal.distributed import multi_threaded_pg as threaded

    from torchtpu.eager import modes

    if modes.get_eager_mode() is modes.EagerMode.DEFER_AND_FUSE:
        # One recorder per process: threads would record into each other's programs.
        raise RuntimeError(errors.message(
            "unsupported", "run_threads cannot run ranks under DeferAndFuse (its recording is "
            "per process); use torchtpu.distributed.spawn.run, one process per rank"))
    threaded._install_threaded_pg()
    # Each thread registers its own groups under the same names.
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    store = dist.HashStore()
    outcomes: dict[int, tuple] = {}
    own_args = [torch.utils._pytree.tree_map(lambda leaf: leaf, args) for _ in range(world_size)]

    def rank_main(rank: int) -> None:
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            try:
                outcomes[rank] = (True, fn(rank, world_size, *own_args[rank]))
            finally:
                dist.destroy_process_group()
        except BaseException as e:  # noqa: BLE001 (reported by the caller's thread)
            outcomes[rank] = (False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            # Wakes the ranks waiting in a collective for this one: they exit with SystemExit.
            threaded.ProcessLocalGroup.exception_handle(e)

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True)
               for r in range(world_size)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        hung = [r for r, t in enumerate(threads) if t.is_alive()]
        if hung:
            threaded.ProcessLocalGroup.exception_handle(TimeoutError())
            for t in threads:
                t.join(10)
            raise TimeoutError(f"torchtpu.distributed: ranks {hung} still running after {timeout} "
                               "s")
    finally:
        threaded.ProcessLocalGroup.reset()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        threaded._uninstall_threaded_pg()
    failed = {r: out for r, (ok, out) in sorted(outcomes.items()) if not ok}
    # Ranks stopped because another failed say only that; the first cause is what matters.
    causes = {r: out for r, out in failed.items() if not out.startswith("SystemExit")}
    failed = causes or failed
    if failed:
        raise RuntimeError("\n".join(f"rank {r} failed: {tb}" for r, tb in failed.items()))
    return [outcomes[r][1] for r in range(world_size)]
