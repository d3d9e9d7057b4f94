"""Ray Train's device choice under tpu_dist (torchtpu/integrations/ray.py), without Ray: a
stand-in ``ray.air._internal.torch_utils`` (Ray's one device query, which says CPU on a machine
without Ray "TPU" resources) imported in a tpu_dist process gets wrapped by the import hook and
answers the worker's tpu device; without a tpu_dist group Ray's answer stands."""

import os
import sys

from torchtpu.distributed.spawn import run

_STAND_IN = '''
import torch


def get_devices():
    """Ray's: CPU, since no GPU or TPU resources were scheduled."""
    return [torch.device("cpu")]
'''


def _worker(rank, world, root):
    import torch.distributed as dist

    sys.path.insert(0, root)
    from ray.air._internal import torch_utils  # the stand-in: the import hook wraps it

    before = torch_utils.get_devices()
    dist.init_process_group("cpu:gloo,tpu:tpu_dist")
    during = torch_utils.get_devices()
    # No rank tears its group down while another still connects its gloo mesh ("Connection
    # closed by peer" in connectFullMesh, one run in three under load).
    dist.barrier()
    dist.destroy_process_group()
    # A store of its own: on MASTER_PORT again, a rank could reach rank 0's first store before
    # its teardown and rendezvous on the first group's stale gloo address (connection refused).
    store = dist.FileStore(os.path.join(root, "second_group"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    gloo = torch_utils.get_devices()
    dist.barrier()
    dist.destroy_process_group()
    return [str(d) for d in before + during + gloo]


def test_ray_get_devices_gives_the_tpu_device_under_tpu_dist(tmp_path):
    package = tmp_path / "ray" / "air" / "_internal"
    package.mkdir(parents=True)
    for folder in (tmp_path / "ray", tmp_path / "ray" / "air", package):
        (folder / "__init__.py").write_text("")
    (package / "torch_utils.py").write_text(_STAND_IN)
    results = run(_worker, 2, args=(str(tmp_path),), init=False, timeout=180)
    for rank, names in enumerate(results):
        assert names == ["cpu", f"tpu:{rank}", "cpu"], (rank, names)
