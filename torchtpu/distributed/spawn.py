"""Ranks as spawned processes on this machine: ``run(fn, world_size)``.

Each rank is a fresh spawned process on a free local port with torchrun's environment
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), unless ``torchrun_env=False``.
``run`` returns every rank's result, and raises with every failing rank's traceback; past the
deadline, or as soon as one rank fails, it kills every process it started. A rank that exits
with a non-zero code after reporting (a crash at exit) fails the run too. The tests, the
benchmarks and ``python -m torchtpu.aot --world N`` run their ranks with it.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

_EXIT_S = 60.0  # seconds a rank that reported may take to exit (30 killed one at load 6)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, backend, init, torchrun_env, pg_timeout, env, args,
            results) -> None:
    os.environ.update(env)
    if torchrun_env:
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )
    try:
        import torch.distributed as dist

        import torchtpu  # noqa: F401

        if init:
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout),
            )
        out = fn(rank, world_size, *args)
        if init and dist.is_initialized():
            dist.destroy_process_group()
        # Plain pickle: the queue's own would share tensors through file descriptors that
        # die with this process.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException as e:  # noqa: BLE001 (reported to the parent, which raises)
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run(fn: Callable[..., Any], world_size: int = 2, *, args: tuple = (),
        backend: str | None = "tpu_dist", init: bool = True, torchrun_env: bool = True,
        timeout: float = 120.0, pg_timeout: float = 20.0, env: dict | None = None,
        expect_failure: bool = False) -> list:
    """fn(rank, world_size, *args) in world_size processes; their results, by rank.

    With ``expect_failure`` the ranks' outcomes are returned instead of raised: each is
    ``(ok, result_or_traceback)``, or None for a rank that never reported (it died).
    """
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker, daemon=True,
            args=(fn, rank, world_size, port, backend, init, torchrun_env, pg_timeout,
                  dict(env or {}), args, results),
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, value = results.get(timeout=0.2)
                outcomes[rank] = (ok, pickle.loads(value) if ok and expect_failure else value)
                if not ok and not expect_failure:
                    break
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(_EXIT_S, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    if expect_failure:
        return [outcomes.get(r) for r in range(world_size)]
    failed = {r: v for r, (ok, v) in outcomes.items() if not ok}
    missing = [r for r in range(world_size) if r not in outcomes]
    if failed or missing:
        detail = "\n".join(f"--- rank {r} ---\n{v}" for r, v in sorted(failed.items()))
        raise AssertionError(
            f"{len(failed)} rank(s) failed, {len(missing)} never reported {missing} "
            f"(timeout {timeout:g} s):\n{detail}"
        )
    # A rank that reported and then crashed on its way out (JAX's runtime aborting it at exit,
    # issue 37) fails the run as a script's launcher would.
    exits = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
    if exits:
        raise AssertionError(f"every rank reported, but then exited with {exits} (rank: exit "
                             f"code, negative: killed by that signal; {_EXIT_S:g} s allowed)")
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]
