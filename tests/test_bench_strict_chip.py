"""bench/strict_chip.py (the chip's Strict breakdown) runs end to end on XLA:CPU at tiny dims:
each section reports without an error, the step's figures add up, and the JSON is written."""

import importlib.util
import json
import os

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "bench", "strict_chip.py")
_spec = importlib.util.spec_from_file_location("bench_strict_chip", _PATH)
strict_chip = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(strict_chip)


def test_strict_chip_runs_small_and_writes_its_json(tmp_path):
    out = strict_chip.main(["--small", "--layers", "1", "--batch", "2", "--steps", "1",
                            "--out", str(tmp_path)])
    assert json.loads((tmp_path / "strict_chip.json").read_text()).keys() == out.keys()
    for name in ("per_op", "llama", "llama_each"):
        assert "error" not in out[name], out[name].get("error")
    # Lazy casts and pointwise calls off: more launches, the same losses to an ulp or so
    each = out["llama_each"]
    assert each["launches"] > out["llama"]["census"]["launches"] + 20
    assert abs(each["first_losses"][0] - out["llama"]["first_losses"][0]) < 1e-5
    assert out["per_op"]["add"]["strict_us"] > 0 and out["per_op"]["add"]["jnp_us"] > 0
    assert out["per_op"]["add"]["strict_cpu_us"] > 0 and out["per_op"]["add"]["jnp_cpu_us"] > 0
    step = out["llama"]
    # The same step each time, to within a program (the census's step may be another's).
    assert step["census"]["launches"] > 40  # (one layer: 50 since strict11)
    assert abs(step["launches"] - step["census"]["launches"]) <= 2
    assert abs(step["device_programs"] - step["launches"]) <= 2
    assert 0 < step["device_busy_ms"] <= step["device_span_ms"] <= step["profiled_wall_ms"]
    assert step["census"]["host_waits"] == 0 and step["census"]["scalar_transfers"] == 0
    assert step["census"]["byte_inputs"] == {} and step["peak_gib"] > 0
    assert any("run_backward" in line for line in step["host_profile"])
