"""More processes on a host than it has devices fails at start-up, naming both counts.

A host with K devices is simulated with XLA:CPU's ``--xla_force_host_platform_device_count=K``
(one process then sees K devices, as on a TPU or GPU host). One subprocess plays torchrun's
process LOCAL_RANK of LOCAL_WORLD_SIZE: with 3 processes on 2 devices the first device use and
``init_process_group("tpu_dist")`` both refuse; with 2 on 2 the group starts and process 1
computes on device 1. Ray Train's launch of the same is in tests/test_ray.py.
"""

import json
import os
import subprocess
import sys

_SCRIPT = r"""
import json, os, torch, torch.distributed as dist
from torchtpu.runtime import platform

def attempt(fn):
    try:
        fn()
        return None
    except RuntimeError as e:
        return str(e)

out = {"tensor": attempt(lambda: torch.ones(2, device="tpu")),
       "init": attempt(lambda: dist.init_process_group("tpu_dist", store=dist.HashStore(),
                                                       rank=0, world_size=1))}
os.environ.update(LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
dist.init_process_group("tpu_dist", store=dist.HashStore(), rank=0, world_size=1)
x = torch.arange(3.0, device="tpu") * 2
out["sum"] = x.sum().item()
out["device"] = platform.local_device().id
dist.destroy_process_group()
print("RESULT", json.dumps(out))
"""


def test_more_processes_than_devices_refused_before_training():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               TORCHTPU_PLATFORM="cpu", LOCAL_RANK="2", LOCAL_WORLD_SIZE="3",
               PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                          text=True, timeout=180)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT "):])
    for path in ("tensor", "init"):
        message = out[path]
        assert message is not None, path
        assert message.startswith("torchtpu.device: 3 processes were started on this host, "
                                  "but it has 2 cpu devices"), message
        assert "torchrun --nproc-per-node 2" in message and "num_workers" in message, message
    assert out["sum"] == 6.0 and out["device"] == 1  # 2 processes on 2 devices: allowed
