"""bench/defer_host.py (DeferAndFuse's host CPU per step, split, beside the whole step's) runs on
XLA:CPU at tiny dims, in a child process (its split wraps torchtpu's functions for good): steady
steps load nothing, and the split's parts are inside the host's."""

import json
import os
import subprocess
import sys

import pytest

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)


@pytest.mark.full  # compiles the fused step and the whole step (~10 s each on XLA:CPU)
def test_defer_host_splits_a_steady_step(tmp_path):
    path = tmp_path / "h.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_ROOT, os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, os.path.join(_ROOT, "bench", "defer_host.py"), "--small",
                    "--layers", "1", "--rounds", "2", "--steps", "1", "--split",
                    "--json", str(path)], check=True, env=env, timeout=600)
    out = json.loads(path.read_text())
    defer, whole = out["defer"]["median"], out["whole"]["median"]
    assert defer["loads"] == 0 and whole["loads"] == 0
    assert defer["executions"] == 1 and defer["deferred_ops"] > 100
    assert defer["host_us_per_op"] > 0 and whole["host_cpu_ms"] > 0
    # The op path and the flush's parts are within what the recording threads spent.
    assert 0 < defer["op_path.record"] < defer["op_path"] < defer["host_cpu_ms"]
    assert defer["flush.key_lookup"] > 0 and defer["flush"] <= defer["read_cpu_ms"] + 1
