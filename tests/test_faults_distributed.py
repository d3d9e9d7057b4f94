"""Ranks that die: the survivors get a Python error within the group's timeout and go on.

A 2-process tpu_dist job on the XLA transport (JAX's multi-process runtime on XLA:CPU): rank 1
SIGKILLs itself inside an all_reduce, after the header exchange agreed on it and before its XLA
collective program runs, so rank 0's program meets a dead peer. Rank 0 must raise (not hang,
not be aborted by JAX's coordination service), then run what a process does on its way out
(JAX's runtime shutdown, which waits at a barrier for every task) and more device work.
"""

import os
import signal
import time

import torch
import torch.distributed as dist

from torchtpu.testing.distributed import run

_PG_TIMEOUT = 30  # seconds; also bounds JAX's runtime start and shutdown waits (jax_runtime)


def _rank_dies_inside_all_reduce(rank, world):
    import jax

    from torchtpu.distributed import xla

    warm = torch.ones(4, device="tpu")
    dist.all_reduce(warm)  # the program compiled, XLA's peer connections made
    assert warm.cpu().tolist() == [2.0] * 4
    value = torch.full((4,), 2.0, device="tpu")
    value.cpu()
    if rank == 1:
        def die(self, *args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)

        xla.XlaProcessGroup._run = die  # past the header exchange, before the program
    start = time.monotonic()
    try:
        dist.all_reduce(value)
        value.cpu()
    except Exception as e:  # noqa: BLE001 (whatever the runtime raises, it must be Python's)
        error = (type(e).__name__, str(e), time.monotonic() - start)
    else:
        raise AssertionError("the all_reduce returned with its peer dead")
    jax.distributed.shutdown()  # what exit runs: aborted the process before recoverability
    after = (torch.arange(3.0, device="tpu") * 2).cpu().tolist()
    return error, after


def test_rank_killed_inside_xla_all_reduce_leaves_a_python_error():
    outcomes = run(_rank_dies_inside_all_reduce, 2, pg_timeout=_PG_TIMEOUT, timeout=300,
                   env={"TORCHTPU_DIST_TRANSPORT": "xla"}, expect_failure=True)
    assert outcomes[1] is None  # it died
    assert outcomes[0] is not None, "rank 0 died too (JAX's runtime aborted it)"
    ok, value = outcomes[0]
    assert ok, value
    (kind, text, seconds), after = value
    assert "by peer" in text, (kind, text)  # the connection to the dead rank
    assert seconds < _PG_TIMEOUT, (seconds, text)
    assert after == [0.0, 2.0, 4.0]
