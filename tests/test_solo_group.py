"""Process groups of one process where no internet socket opens (a sandboxed TPU host).

gloo opens a TCP device even for a group of one; ``tpu_dist`` used to hold a gloo group for its
host transport, so ``init_process_group`` itself failed there. A group of one now runs on
``SoloGroup`` (torchtpu/distributed/solo.py), and ``tpu_solo`` names it for CPU groups."""

from __future__ import annotations

import subprocess
import sys

import no_sockets  # tests/ is on the path (verl installs a package named tests)

_CHILD = r"""
import socket, sys, tempfile
import torch, torch.distributed as dist
import torchtpu
try:
    socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sys.exit("internet sockets are not refused here")
except OSError:
    pass
store = dist.FileStore(tempfile.mktemp(), 1)
dist.init_process_group("tpu_dist", store=store, rank=0, world_size=1)
x = torch.arange(6.0, device="tpu")
dist.all_reduce(x)
out = [torch.zeros(6, device="tpu")]
dist.all_gather(out, x)
big = torch.zeros(6, device="tpu")
dist.all_gather_into_tensor(big, x)
dist.broadcast(x, 0)
cpu = dist.new_group([0], backend="tpu_solo")
c = torch.arange(4)
gathered = [torch.zeros(4, dtype=torch.long)]
dist.all_gather(gathered, c, group=cpu)
dist.all_reduce(c, group=cpu)
objs = [None]
dist.all_gather_object(objs, {"a": 1}, group=cpu)
dist.barrier(group=cpu)
print("OK", x.cpu().tolist(), out[0].cpu().tolist(), big.cpu().tolist(), gathered[0].tolist(),
      c.tolist(), objs)
dist.destroy_process_group()
"""


def test_groups_of_one_need_no_internet_socket(tmp_path):
    env = no_sockets.environment(tmp_path)
    run = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    want = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert f"OK {want} {want} {want} [0, 1, 2, 3] [0, 1, 2, 3] [{{'a': 1}}]" in run.stdout
