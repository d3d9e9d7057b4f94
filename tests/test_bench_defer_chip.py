"""bench/defer_chip.py (DeferAndFuse's step on the chip, step by step) runs end to end on XLA:CPU
at tiny dims: after its warm-up a step is one program, none built or loaded (its profiled steps
included), nothing but the last read crosses to the host, and the JSON is written."""

import importlib.util
import json
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "bench", "defer_chip.py")
_spec = importlib.util.spec_from_file_location("bench_defer_chip", _PATH)
defer_chip = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(defer_chip)


@pytest.mark.full  # two compiles of the fused step (~10 s each on XLA:CPU)
def test_defer_chip_runs_small_steady_and_writes_its_json(tmp_path):
    out = defer_chip.main(["--small", "--layers", "1", "--batch", "1", "--seq", "16",
                           "--steps", "3", "--out", str(tmp_path)])
    assert "error" not in out, out.get("error")
    assert json.loads((tmp_path / "defer_chip.json").read_text()).keys() == out.keys()
    steps = out["llama"]["steps"]
    warm = [s for s in steps if s["phase"] == "warmup"]
    later = [s for s in steps if s["phase"] != "warmup"]
    # AdamW's state starts as zeros sent from the host; the first step's program donates them as
    # later steps donate its results, so it is the steady program: no later step builds one.
    assert [s["executions"] for s in warm] == [1, 1, 1]
    assert "programs_built" in warm[0] and not [s for s in warm[1:] if "programs_built" in s]
    # The free loop's first step only records (its flush is the next step's first op).
    assert [s["executions"] for s in later] == [0] + [1] * (len(later) - 1)
    assert not [s for s in later if "programs_built" in s]
    assert out["llama"]["profile_programs_loaded"] == 0
    free = [s for s in later if s["phase"] == "free" and s["step"] != "read"]
    # The recording threads' CPU, per op of the step's flush (the free loop's first step flushes
    # nothing), and whether the step before still ran when a free step's recording ended.
    assert all(s["record_cpu_ms"] > 0 for s in later if s["step"] != "read")
    assert all(s["us_per_op"] > 0 for s in later if s["step"] not in (0, "read")
               or s["phase"] == "synced")
    assert all(isinstance(s["overlapped"], bool) for s in free[1:])
    host = out["llama"]["host"]
    assert host["us_per_op"] > 0 and host["read_each_step_ms"] >= host["no_read_ms"] > 0
    assert all(s["device_to_host_bytes"] == 0 for s in free)
    assert all(s["host_to_device_bytes"] <= 64 for s in later)  # a step's new numbers only
    assert all(s["record_ms"] > 0 for s in later if s["step"] != "read")
    assert all(s["flush_ms"] >= s["launch_ms"] for s in steps)
    assert out["llama"]["profile"]["device_busy_ms"] > 0
