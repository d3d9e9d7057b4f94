"""bench/conformance.py's bookkeeping: by-design failures are reported apart, not counted."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import conformance  # noqa: E402


def _results(**tpu_outcomes):
    results = {}
    for test, (outcome, cause) in tpu_outcomes.items():
        results[f"f.py::TCPU::{test}_cpu_float32"] = {"outcome": "passed", "cause": ""}
        results[f"f.py::TPRIVATEUSE1::{test}_tpu_float32"] = {"outcome": outcome, "cause": cause}
    return results


def test_by_design_failures_are_reported_apart_and_not_counted():
    s = conformance.summarize(_results(
        test_a=("passed", ""),
        test_b=("failed", "AssertionError: wrong values"),
        test_tensor_storage_type=("failed", "AssertionError: Object comparison failed"),
        test_c=("failed", "NotImplementedError: torchtpu.unsupported: sparse tensors "
                          "(torch.sparse_coo) are not supported on tpu, whose tensors are strided"),
    ))
    assert (s["tpu_passed"], s["counted"], s["tpu_expected"]) == (1, 2, 2)
    assert list(s["groups"]) == ["failed: AssertionError: wrong values"]
    assert len(s["expected_reasons"]) == 2
    assert "expected    1" in conformance.format_summary("f.py", s)


def test_expected_by_name_matches_that_test_and_its_dtypes_only():
    assert conformance.expected_reason("test_tensor_storage_type_bfloat16", "x") is not None
    assert conformance.expected_reason("test_tensor_storage_types", "x") is None
    assert conformance.expected_reason("test_storage_float32", "AssertionError") is None
