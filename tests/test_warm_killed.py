"""A process killed after its first step leaves what a warm start needs (``eager/facts.py``).

The chip's first GRPO try was killed past its time limit: its programs were in the cache by key,
but its recorded calls' result shapes were written at exit only, so the retry traced every call
again. Here a DeferAndFuse training step runs in a process that is then killed with SIGKILL (no
exit hook runs); a second process runs the same step and traces nothing, with CPU's losses.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

_SCRIPT = """
import gc; gc.disable()
import json, os, sys, time
from jax import monitoring
traces = [0]
def on(event, seconds, **_):
    if event == "/jax/core/compile/jaxpr_trace_duration":
        traces[0] += 1  # a fused program, or a recorded call's lowering traced for its shapes
monitoring.register_event_duration_secs_listener(on)
import torch, torchtpu
from torchtpu.cache import compile_cache

def step(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                torch.nn.Linear(16, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.arange(32.0).reshape(4, 8).div(10).to(device)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss.item()

before = traces[0], torchtpu.metrics.snapshot().get("programs_loaded_by_key", 0)
with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
    got = step("tpu")
by_key = torchtpu.metrics.snapshot().get("programs_loaded_by_key", 0) - before[1]
result = json.dumps({"traces": traces[0] - before[0], "by_key": by_key, "loss": got,
                     "cpu": step("cpu")})
if len(sys.argv) > 1:  # the first process: its result, then killed while it waits
    compile_cache.flush()  # (the executables' writes: a process killed long after its step)
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(result)
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(300)
print(result)
"""


def _env(cache) -> dict:
    return {**os.environ, "TORCHTPU_CACHE_DIR": str(cache), "TORCHTPU_CPU_FALLBACK": "error"}


def test_a_killed_process_leaves_its_steps_shapes(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    done, log = tmp_path / "first.json", tmp_path / "first.log"
    with open(log, "w") as err:
        first = subprocess.Popen([sys.executable, "-c", _SCRIPT, str(done)], env=_env(cache),
                                 stdout=err, stderr=err)
        try:
            deadline = time.monotonic() + 300
            while not done.exists() and first.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert done.exists(), log.read_text()[-3000:]
            first.send_signal(signal.SIGKILL)  # no exit hook runs
            assert first.wait(timeout=60) == -signal.SIGKILL
        finally:
            if first.poll() is None:
                first.kill()
                first.wait(timeout=60)
    cold = json.loads(done.read_text())
    assert cold["traces"] > 0 and cold["by_key"] == 0, cold
    second = subprocess.run([sys.executable, "-c", _SCRIPT], env=_env(cache),
                            capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    warm = json.loads(second.stdout.strip().splitlines()[-1])
    assert warm["traces"] == 0 and warm["by_key"] >= 1, warm
    assert warm["loss"] == pytest.approx(warm["cpu"], rel=1e-5)
    assert cold["loss"] == pytest.approx(cold["cpu"], rel=1e-5)
