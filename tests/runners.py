"""The two ways the FSDP2 / DTensor / DCP tests run their ranks, as ``pytest.param``s.

``threads``: ranks as threads of this process over PyTorch's threaded test backend
(``torchtpu.testing.threaded``): one process, shared programs, the device layer under the
libraries. ``tpu_dist``: ranks as spawned processes over the tpu_dist backend
(``torchtpu.distributed.spawn``). Each scenario is a function ``fn(rank, world_size, ...)``
both run unchanged. The default suite runs the threads (CI's time budget: each tpu_dist run
starts and compiles in fresh processes); ``TORCHTPU_TESTS=full`` (the ``full`` marker) runs
every scenario on tpu_dist too.
"""

import functools

import pytest

from torchtpu.distributed.spawn import run
from torchtpu.testing.threaded import run_threads

# Each process compiles its programs (most come from the persistent cache after the threaded
# run of the same scenario); the 2-core CI box is slow at that.
_processes = functools.partial(run, timeout=400, pg_timeout=120)

THREADS = pytest.param(run_threads, id="threads")
PROCESSES = pytest.param(_processes, id="tpu_dist")
OPT_IN = pytest.param(_processes, id="tpu_dist", marks=pytest.mark.full)

# DeferAndFuse in every rank: FSDP2's collectives cut the recorded programs.
DEFERRED = pytest.param(
    functools.partial(_processes, env={"TORCH_TPU_DEFER_AND_FUSE": "1"}), id="tpu_dist-defer",
    marks=pytest.mark.full)

ALL = [THREADS, OPT_IN]  # threads by default, processes when asked
