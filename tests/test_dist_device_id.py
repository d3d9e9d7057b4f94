"""``init_process_group(backend, device_id=...)`` on tpu (torchtpu/distributed/device_binding.py):
binds each process's own device, as CUDA scripts ask; another process's device is refused on
every rank, naming the rank. Two processes on localhost, started and stopped by the test."""

import torch

from torchtpu.distributed.spawn import run
from torchtpu.runtime import platform


def _as_torchrun_starts():
    # torchrun sets LOCAL_RANK / LOCAL_WORLD_SIZE before the process starts, so torchtpu reads
    # them at import; the test's spawned processes import torch before their environment is set.
    import os

    platform.set_process_slot(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))


def _bound(rank, world):
    import torch.distributed as dist

    _as_torchrun_starts()
    # Rank 0 names its device as torch.device("tpu:0"), rank 1 by index (tpu:1, CUDA's form).
    dist.init_process_group("tpu_dist", device_id=torch.device("tpu:0") if rank == 0 else rank)
    t = torch.full((3,), float(rank + 1), device="tpu")
    dist.all_reduce(t)
    dist.barrier()
    return t.cpu()


def test_device_id_binds_each_process_to_its_device():
    for out in run(_bound, 2, init=False, timeout=180):
        torch.testing.assert_close(out, torch.full((3,), 3.0))


def _refused(rank, world):
    import torch.distributed as dist

    _as_torchrun_starts()
    try:  # tpu:1 is rank 1's device: rank 0 is given another process's
        dist.init_process_group("tpu_dist", device_id=torch.device("tpu:1"))
    except ValueError as e:
        return str(e)
    return None


def test_device_id_of_another_process_raises_on_every_rank():
    for message in run(_refused, 2, init=False, timeout=180):
        assert message is not None
        assert "torchtpu.distributed: tpu_dist: init_process_group: rank 0 was given " \
               "device_id=tpu:1, which is not its device" in message
        assert "belongs to another process" in message


def _one(rank, world):
    import torch.distributed as dist

    dist.init_process_group("tpu_dist", device_id=torch.device("tpu:0"))
    t = torch.ones(2, device="tpu")
    dist.all_reduce(t)
    return dist.get_backend(), t.cpu()


def test_device_id_in_one_process():
    ((backend, value),) = run(_one, 1, init=False, timeout=120)
    assert backend == "tpu_dist"
    torch.testing.assert_close(value, torch.ones(2))



_MAKE_ON_TPU1 = """
import torch, torchtpu
try:
    torch.full((3,), 7.0, device="tpu:1")
    print("made")
except RuntimeError as e:
    print(e)
"""


def test_another_process_index_is_refused_after_it_kept_a_result_for_it(tmp_path):
    """Which index names this process's device is the process's own, where meta results are kept
    for every process in the cache directory: rank 1's factory call on tpu:1 must not let rank 0
    make a tensor there (it did, with no error, from the result rank 1 kept)."""
    import os
    import subprocess
    import sys

    def as_rank(rank):
        env = {**os.environ, "TORCHTPU_CACHE_DIR": str(tmp_path), "TORCHTPU_NOTICES": "0",
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"}
        return subprocess.run([sys.executable, "-c", _MAKE_ON_TPU1], env=env, timeout=120,
                              capture_output=True, text=True, check=True).stdout

    assert as_rank(1).strip() == "made"
    assert "tpu:1 belongs to another process" in as_rank(0)
