"""torch.tpu.memory's history in CUDA's snapshot format, read by PyTorch's own visualizer."""

from __future__ import annotations

import gc
import pickle
import subprocess
import sys

import pytest
import torch


@pytest.fixture
def recording():
    torch.tpu.memory._record_memory_history(max_entries=1000, clear_history=True)
    yield
    torch.tpu.memory._record_memory_history(enabled=None)


def _alloc_here():
    return torch.empty(3000, 100, device="tpu")  # 1.2 MB: a "large" segment


def _live_blocks(snap, size):
    return [b for s in snap["segments"] for b in s["blocks"] if b["size"] == size]


def test_allocations_frees_and_user_stacks(recording):
    x = _alloc_here()
    y = torch.ones(7, 11, device="tpu") * 2  # an op's result is an allocation too
    snap = torch.tpu.memory._snapshot()
    (block,) = _live_blocks(snap, 3000 * 100 * 4)
    assert block["address"] == x.untyped_storage().data_ptr()
    assert block["state"] == "active_allocated"
    top = block["frames"][0]
    assert top["name"] == "_alloc_here" and top["filename"] == __file__  # the user's line
    assert _live_blocks(snap, 7 * 11 * 4)
    address = x.untyped_storage().data_ptr()
    del x
    gc.collect()
    snap = torch.tpu.memory._snapshot()
    assert not _live_blocks(snap, 3000 * 100 * 4)
    actions = [e["action"] for e in snap["device_traces"][0] if e["addr"] == address]
    assert actions == ["segment_alloc", "alloc", "free_requested", "free_completed",
                       "segment_free"]
    del y


def test_history_is_bounded_and_off_records_nothing(recording):
    for _ in range(600):
        torch.ones(4, device="tpu")
    assert len(torch.tpu.memory._snapshot()["device_traces"][0]) == 1000
    torch.tpu.memory._record_memory_history(enabled=None)
    before = torch.tpu.memory._snapshot()
    torch.ones(5, device="tpu")
    assert torch.tpu.memory._snapshot() == before


def test_resize_moves_the_allocation(recording):
    s = torch.UntypedStorage(64, device="tpu")
    s.resize_(4096)
    snap = torch.tpu.memory._snapshot()
    assert {b["size"] for b in _live_blocks(snap, 4096)} == {4096}
    assert not any(b["address"] == s.data_ptr() and b["size"] == 64
                   for seg in snap["segments"] for b in seg["blocks"])


def test_pytorch_memory_viz_reads_the_dump(recording, tmp_path):
    keep = [_alloc_here(), torch.randn(64, 64, device="tpu") @ torch.randn(64, 64, device="tpu")]
    path = tmp_path / "snap.pickle"
    torch.tpu.memory._dump_snapshot(str(path))
    with open(path, "rb") as f:
        assert pickle.load(f)["segments"]
    plots = [tmp_path / "trace.html", tmp_path / "segments.html"]
    for tool in (["trace_plot", str(path), "-o", str(plots[0])],
                 ["segment_plot", str(path), "-o", str(plots[1])], ["trace", str(path)]):
        run = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", *tool],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
    assert all(p.stat().st_size > 1000 for p in plots)
    assert "cudaMalloc(" in run.stdout and "1.1MiB" in run.stdout  # the text trace: our alloc
    del keep


def test_summary_names_the_largest_allocation_and_bad_arguments(recording):
    keep = _alloc_here()
    summary = torch.tpu.memory_summary()
    assert "largest live allocations" in summary and f"{__file__}" in summary
    assert "1,200,000 B" in summary
    with pytest.raises(ValueError, match="enabled='yes'"):
        torch.tpu.memory._record_memory_history(enabled="yes")
    with pytest.raises(ValueError, match="context='some'"):
        torch.tpu.memory._record_memory_history(context="some")
    assert torch.tpu.memory.memory_allocated() == torch.tpu.memory_allocated()
    del keep
