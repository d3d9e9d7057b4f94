"""Strict's per-op programs in a new process (runtime/warm.py ``dispatched``): loaded by
torchtpu's own key, each op traced and lowered in the first process only; jit's dispatch for
every signature; a directory others can write keeps to JAX's cache (traced first)."""

import json
import os
import subprocess
import sys

import pytest

# A small model's forward and backward, an op at two shapes and an in-place op on tpu, each
# result against CPU's; the traces JAX makes and the programs loaded by key around the work.
_SCRIPT = """
import json
from jax import monitoring
traces = [0]
def on(event, seconds, fun_name="", **_):
    if event == "/jax/core/compile/jaxpr_trace_duration" and fun_name.startswith("aten_"):
        traces[0] += 1  # an op's program (eager/program.py names it after the op)
monitoring.register_event_duration_secs_listener(on)
import torch, torchtpu
from torch import nn
from torchtpu.eager import executor
# A program that reads a lazy pointwise op (executor.Strict.lazy_ops) has no stable key yet
# (its read names the op's lowering and spec objects): traced in every process. Off here.
executor.Strict.lazy_ops = False

def work(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    model = model.to(device)
    x = torch.linspace(-2, 2, 8 * 16).reshape(8, 16).to(device)
    loss = model(x).square().mean()
    loss.backward()
    y = torch.linspace(0, 1, 5).to(device)
    other = (y * 3).exp().add_(x[0, :5]) * (x[:2, :5] * 3)  # mul at a second shape
    listed = torch._foreach_add([y, other], [0.5, 2.0])  # a program taking a list of numbers
    return [loss.item(), model[0].weight.grad.sum().item(), other.sum().item(),
            sum(t.sum().item() for t in listed)]

cpu = work("cpu")
before, loaded = traces[0], torchtpu.metrics.snapshot().get("programs_loaded_by_key", 0)
tpu = work("tpu")
print(json.dumps({"cpu": cpu, "tpu": tpu, "traces": traces[0] - before,
                  "by_key": torchtpu.metrics.snapshot().get("programs_loaded_by_key", 0)
                  - loaded}))
"""


def _run(cache) -> tuple[dict, str]:
    env = {**os.environ, "TORCHTPU_CACHE_DIR": str(cache), "TORCHTPU_CPU_FALLBACK": "error"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_second_process_traces_no_op_program(tmp_path):
    cache = tmp_path / "cache"
    cold, _ = _run(cache)
    warm_run, _ = _run(cache)
    assert cold["traces"] > 0 and cold["by_key"] == 0
    assert warm_run["traces"] == 0 and warm_run["by_key"] > 0
    for run in (cold, warm_run):
        assert run["tpu"] == pytest.approx(run["cpu"], rel=1e-5, abs=1e-6)


def test_directory_others_can_write_traces_every_op(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    cold, err = _run(shared)
    warm_run, _ = _run(shared)
    assert "warm starts are off" in err
    assert warm_run["by_key"] == 0 and warm_run["traces"] == cold["traces"] > 0
