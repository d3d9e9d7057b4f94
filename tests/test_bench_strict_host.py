"""bench/strict_host.py (Strict's host work in one Llama step) runs on XLA:CPU at one layer: its
counts and times are there and add up, and a step's losses come back to compare trees with."""

import importlib.util
import os

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "bench", "strict_host.py")
_spec = importlib.util.spec_from_file_location("bench_strict_host", _PATH)
strict_host = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(strict_host)


def test_strict_host_counts_and_times_both_threads():
    out = strict_host.measure(layers=1, steps=2, warm=1, top=5)
    assert out["launches"] > 20 and sum(out["launches_by_program"].values()) <= out["launches"]
    # Backward's Python calls are counted on autograd's thread, not the calling one's.
    assert out["backward_calls"] > 1_000 and out["main_calls"] > 1_000
    assert not any("run_backward" in line for line in out["backward_top"])
    assert 0 < out["backward_cpu_ms"] and 0 < out["main_cpu_ms"] <= out["process_cpu_ms"]
    assert len(out["losses"]) == 1 + 1 + 2 + 2 and len(set(out["losses"])) > 1
    assert len(out["gc_collections"]) == 3 and out["gc_ms"] >= 0 and out["frozen_objects"] >= 0
