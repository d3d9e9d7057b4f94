"""Which rank was lost when a collective fails: the name a survivor's error gives it.

A collective whose peer died fails with the transport's words ("Connection reset by peer
[127.0.0.1]:7555", gloo's on the host transport and XLA:CPU's, the coordination service's on a
TPU), which name an address, not a rank. At the default group's creation every rank publishes
where it runs (machine and process id) in the job's store (``publish``); at a failure
``describe`` reads them back and looks at the processes of this machine: a rank whose process
has exited (or is a zombie its launcher has yet to reap) is named as lost. Ranks on other
machines cannot be looked at from here; the message says so instead of guessing. The store
itself may be gone with the process that hosted it (rank 0 under ``mp.spawn``), which the
message says too.

The XLA transport's collective programs fail later, at the next host read of a result: the
launch hook ``HOOKS.peer_lost`` (``device/launch.py``; set by ``publish``) turns such a failure
into the same error.
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
import time

import torch.distributed as dist

from torchtpu.device.hooks import HOOKS

_KEY = "tpu_dist/process/{}"
# The job's store and this rank's number in it, once the default group exists.
_job: dict = {}
# A process killed by a signal closes its sockets before it becomes a zombie: the survivor can
# see the closed connection a moment before /proc shows the process gone.
_EXIT_GRACE_S = 2.0
# Text of the runtime failures a dead peer causes (gloo's, XLA's, the coordination service's).
_PEER_FAILURE = ("by peer", "Connection closed", "Connection refused", "Socket closed",
                 "Gloo all-reduce failed", "Gloo all-gather failed", "unhealthy",
                 "heartbeat")


@functools.cache
def _machine() -> str:
    """This machine and process-id namespace: processes that share it can look at each other."""
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(open(path).read().strip() if "boot" in path else str(os.stat(path).st_ino))
        except OSError:
            parts.append("?")
    return "/".join(parts)


def publish(store: dist.Store, rank: int) -> None:
    """At the default group's creation: record where this rank runs, for ``describe``."""
    store.set(_KEY.format(rank), f"{os.getpid()} {_machine()}")
    _job.update(store=store, rank=rank)
    HOOKS.peer_lost = _runtime_failure


def _gone(pid: int) -> bool:
    """Whether process pid has exited (a zombie counts: it runs no more)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False


def _locate(ranks: list[int]) -> tuple[dict[int, int], list[int]]:
    """({rank: process id} of the ranks on this machine, the ranks elsewhere), from the store
    (which raises RuntimeError when it does not answer)."""
    store = _job["store"]
    here, elsewhere = {}, []
    previous = store.timeout
    store.set_timeout(datetime.timedelta(seconds=2))
    try:
        for r in ranks:
            pid, machine = store.get(_KEY.format(r)).decode().split(" ", 1)
            if machine == _machine():
                here[r] = int(pid)
            else:
                elsewhere.append(r)
    finally:
        store.set_timeout(previous)
    return here, elsewhere


def exited(ranks: list[int]) -> list[int]:
    """Those of ranks whose process is known to have exited (on this machine), at once."""
    if "store" not in _job:
        return []
    try:
        here, _ = _locate(ranks)
    except (RuntimeError, ValueError):
        return []
    return [r for r, pid in here.items() if _gone(pid)]


def describe(ranks: list[int] | None = None, error: BaseException | None = None) -> str:
    """What this process can tell about the other ranks (global numbers; None: the whole job):
    which have exited, or why it cannot tell. When error (the transport's) says a peer closed
    its connection, a process still exiting is waited for a moment; else (a timeout) not."""
    if "store" not in _job:
        return "which rank failed is unknown (no tpu_dist default group in this process)"
    others = [r for r in (ranks if ranks is not None else _world()) if r != _job["rank"]]
    try:
        here, elsewhere = _locate(others)
    except (RuntimeError, ValueError) as e:
        return f"which rank failed is unknown: the job's store did not answer ({e})"
    deadline = time.monotonic() + (_EXIT_GRACE_S if _closed_by_peer(error) else 0.0)
    while True:
        lost = [r for r, pid in here.items() if _gone(pid)]
        if lost or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    parts = []
    if lost:
        names = ", ".join(f"{r} (process {here[r]})" for r in lost)
        parts.append(f"rank {names} exited" if len(lost) == 1 else f"ranks {names} exited")
    elif here:
        parts.append(f"no rank on this machine exited ({sorted(here)} still run)")
    if elsewhere:
        parts.append(f"ranks {elsewhere} run on other machines and were not checked")
    return "; ".join(parts) or "this is the only rank"


def _world() -> list[int]:
    return list(range(dist.get_world_size())) if dist.is_initialized() else []


def _closed_by_peer(error: BaseException | None) -> bool:
    return error is not None and any(words in str(error) for words in _PEER_FAILURE)


def _runtime_failure(error: Exception) -> Exception | None:
    """``HOOKS.peer_lost``: for a device program's failure that a dead peer causes (an XLA
    collective's), the error naming the lost rank; None for any other failure."""
    if not _closed_by_peer(error):
        return None
    return dist.DistBackendError(
        f"torchtpu.distributed: tpu_dist: a collective program failed because a peer closed "
        f"its connection: {describe(None, error)}: {error}")
