"""Two-process jobs end with every process's exit code 0 (issue 37).

With JAX's multi-process runtime started (the XLA transport; before the fix also the default
transport wherever libtpu was installed, a machine without a TPU included), the rank that
exited last was aborted by JAX ("Terminating process because the JAX distributed service
detected fatal errors"): rank 0, which hosts the runtime's coordination service, stopped it on
its way out while the other rank still ran. The job here is the reported one: ``mp.spawn``
with a ``file://`` init, a DDP step and an FSDP2 step, one rank outliving the other by a few
seconds (either rank: JAX's service lives in rank 0). A script's exit code is what a launcher
sees, so the script runs in a subprocess (its own session, killed whole past the deadline).

CI's ``tpu`` stage runs this file in the venv that has libtpu too, where the default transport
must be the host one, and must not start JAX's runtime at all.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import torchtpu
from torchtpu import settings
from torchtpu.distributed import jax_runtime

_ROOT = str(Path(torchtpu.__file__).resolve().parents[1])

_SCRIPT = r"""
import sys, tempfile, time
import torch, torchtpu
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world, path, last):
    dist.init_process_group("tpu_dist", init_method=f"file://{path}", rank=rank,
                            world_size=world, timeout=__import__("datetime").timedelta(seconds=60))
    import jax
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(64, 64).to("tpu"))
    ddp(torch.randn(4, 64, device="tpu")).sum().backward()
    fsdp = fully_shard(torch.nn.Linear(64, 64).to("tpu"))
    fsdp(torch.randn(4, 64, device="tpu")).sum().backward()
    grads = [p.grad.full_tensor().sum().item() for p in fsdp.parameters()]
    print(f"rank {rank}: {type(dist.group.WORLD).__name__}, JAX runtime "
          f"{jax.distributed.is_initialized()}, {len(grads)} grads", flush=True)
    dist.destroy_process_group()
    if rank == last:
        time.sleep(4)  # the other rank exits meanwhile


if __name__ == "__main__":
    mp.spawn(worker, args=(2, tempfile.mktemp(), int(sys.argv[1])), nprocs=2)
    print("all ranks exited with 0", flush=True)
"""


def _job(tmp_path, transport: str | None, last: int) -> str:
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != settings.DIST_TRANSPORT.name}
    # This checkout's torchtpu, not whichever one the venv installed.
    env["PYTHONPATH"] = os.pathsep.join([_ROOT, *filter(None, [env.get("PYTHONPATH")])])
    if transport:
        env[settings.DIST_TRANSPORT.name] = transport
    proc = subprocess.Popen([sys.executable, str(script), str(last)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:  # past the deadline: the script and every rank it started
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = [x for x in log.splitlines() if "Warning" not in x and "[Gloo]" not in x]
    assert proc.returncode == 0, "\n".join(lines)[-4000:]
    assert "all ranks exited with 0" in log
    return log


@pytest.mark.parametrize("last", [1, pytest.param(0, marks=pytest.mark.full)])
def test_xla_transport_job_exits_cleanly_whichever_rank_exits_last(tmp_path, last):
    log = _job(tmp_path, "xla", last)
    assert log.count("XlaProcessGroup, JAX runtime True") == 2, log[-2000:]


@pytest.mark.full
def test_default_transport_job_exits_cleanly(tmp_path):
    # In CI's tpu stage libtpu is installed and no TPU is attached: the host transport, and no
    # JAX runtime (before the fix: started anyway, and rank 1 aborted at exit).
    log = _job(tmp_path, None, 1)
    assert log.count("TpuProcessGroup, JAX runtime False") == 2, log[-2000:]


def test_an_installed_tpu_plugin_without_a_tpu_expects_no_accelerator(monkeypatch):
    from jax._src import hardware_utils

    from torchtpu.runtime import environment

    for name in ("TORCHTPU_PLATFORM", "JAX_PLATFORMS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(jax_runtime, "_installed", lambda names: "libtpu" in names)
    monkeypatch.setattr(hardware_utils, "has_visible_nvidia_gpu", lambda: False)
    monkeypatch.setattr(environment, "tpu_attached", lambda: False)
    assert not jax_runtime._accelerator_expected()  # libtpu for compiling only: host
    monkeypatch.setattr(environment, "tpu_attached", lambda: True)
    assert jax_runtime._accelerator_expected()
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert not jax_runtime._accelerator_expected()
