"""Start-up: the backend creator that ``init_process_group`` and ``new_group`` call.

Under torchrun each process knows its host-local index from ``LOCAL_RANK``. Under
``torch.multiprocessing.spawn`` with an explicit ``init_method`` it does not, so the default
group's creation finds it through the store (ranks that share a host name share a host) and
records it in ``runtime.platform``; from then on ``tpu:{local rank}`` names this process's device
too and ``device_count()`` counts the host's processes. The default group's creation also starts
JAX's multi-process runtime where the XLA transport may be used, before anything starts JAX's
backend, and each group's creation picks its transport (``jax_runtime``).

torchrun keeps one store for all the attempts of a job it restarts (``--max-restarts``), with
every key the attempts before it wrote: a restarted rank would read a dead rank's gloo address
and fail to connect, or connect to a stale one. So every group's keys live under the attempt's
number (``TORCHELASTIC_RESTART_COUNT``).

On a TPU host run by several processes, the default group's creation gives each its own chips
(``runtime/chips.py``) before JAX's runtime starts: from the processes' host slots, and, for
several hosts, every host's address and place in the slice, exchanged through the store (a
host's place: GKE's ``TPU_WORKER_ID``, else torchrun's ``GROUP_RANK``, Ray Train's
``NODE_RANK``, else the order of the hosts' first ranks).
"""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

from torchtpu.distributed import jax_runtime, peers
from torchtpu.runtime import chips, platform


def _host_slot(store: dist.Store, rank: int, size: int) -> tuple[int, int]:
    """(host-local index, processes on this host), from every rank's host name in the store."""
    store.set(f"tpu_dist/host/{rank}", socket.gethostname())
    names = [store.get(f"tpu_dist/host/{r}").decode() for r in range(size)]
    mine = names[rank]
    local = [r for r, name in enumerate(names) if name == mine]
    return local.index(rank), len(local)


def _host_key() -> str:
    """What names this process's host in the slice (see the module doc)."""
    # (compile-only libtpu's TPU_WORKER_ID=0 exists only while it starts: libtpu.py)
    for name in ("TPU_WORKER_ID", "GROUP_RANK", "NODE_RANK"):
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return str(int(value))
    return f"host:{socket.gethostname()}"


def _address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.gethostname()


def _bind_chips(store: dist.Store, rank: int, size: int, slot: tuple[int, int]) -> None:
    """Give this process its chips on a multi-chip TPU host (``runtime/chips.py``)."""
    host_chips = chips.wanted(slot[1])
    if host_chips is None:
        return
    store.set(f"tpu_dist/chip_host/{rank}", f"{_host_key()}|{_address()}")
    posts = [store.get(f"tpu_dist/chip_host/{r}").decode().split("|", 1) for r in range(size)]
    first: dict[str, tuple[int, str]] = {}
    for r, (key, address) in enumerate(posts):
        first.setdefault(key, (r, address))
    # Numbered hosts in their order, named ones in the order of their first ranks.
    keys = sorted(first, key=lambda k: (0, int(k)) if k.isdigit() else (1, first[k][0]))
    addresses = [first[k][1] for k in keys] if len(keys) > 1 else ["localhost"]
    chips.bind(slot[0], slot[1], keys.index(posts[rank][0]), addresses, host_chips)


def _this_attempt(store: dist.Store) -> dist.Store:
    """store, its keys this torchrun attempt's own (see the module doc)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return store if attempt is None else dist.PrefixStore(f"tpu_dist_attempt_{attempt}/", store)


def _check_device() -> None:
    from torchtpu.device import control

    if not control.is_available():
        raise RuntimeError(
            "torchtpu.distributed: tpu_dist needs the tpu device, but torchtpu found none (JAX "
            "saw no usable "
            "device); check TORCHTPU_PLATFORM, or use backend='gloo' for CPU tensors"
        )


def create(options, backend_options=None) -> dist.ProcessGroup:
    """``dist.Backend.register_backend``'s creator (extended API); ``backend_options`` (the
    ``pg_options`` of init_process_group/new_group) may be a ``jax_runtime.Transport``."""
    from torchtpu.distributed.group import TpuProcessGroup

    store, rank, size = _this_attempt(options.store), options.group_rank, options.group_size
    default = not dist.is_initialized()  # the default group: every process of the job
    if default:
        if "LOCAL_RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
            slot = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
        else:
            slot = _host_slot(store, rank, size)
        # Before anything starts JAX's backend (the device check does).
        _bind_chips(store, rank, size, slot)
        jax_runtime.start(store, rank, size, options.timeout, slot[0], backend_options)
        peers.publish(store, rank)
    _check_device()
    if default:
        platform.set_process_slot(*slot)
        platform.check_process_count(slot[1])  # before any training step, on every rank
    group = TpuProcessGroup
    if jax_runtime.choose(size, backend_options) == "xla":
        from torchtpu.distributed import xla

        group = xla.XlaProcessGroup
    return group(store, rank, size, options.timeout, list(options.global_ranks_in_group or []))
