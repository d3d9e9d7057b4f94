"""Checks of data the device runs (``device/asserts.py``): where index or mask values cannot be
read at the call without stalling the device (pending in DeferAndFuse; on a TPU or GPU), the
error CPU raises comes at the next host read, with the same exception type, the op and the
calling line; values in range never raise and cost no host read."""

import pytest
import torch
import torch.nn.functional as F

import torchtpu
from torchtpu.device import asserts

W = torch.randn(10, 4)


@pytest.fixture
def on_device(monkeypatch):
    """Strict as on a TPU: every check of data runs on the device."""
    monkeypatch.setattr(asserts, "_host_reads_stall", lambda: True)


BAD = {
    "embedding": lambda w, i: F.embedding(i, w),
    "index_select": lambda w, i: w.index_select(0, i),
    "gather": lambda w, i: w.gather(0, i[:, None].expand(-1, 4)),
    "index": lambda w, i: w[i],
    "index_put": lambda w, i: w.index_put((i,), torch.ones(4, device=w.device)),
}


def _cpu_error(fn) -> type:
    with pytest.raises(Exception) as info:
        fn(W, torch.tensor([1, 12]))
    return info.type


@pytest.mark.parametrize("name", sorted(BAD))
def test_out_of_bounds_raises_at_the_next_host_read(on_device, name):
    fn = BAD[name]
    w, i = W.to("tpu"), torch.tensor([1, 12], device="tpu")
    out = fn(w, i)  # the call returns: the check runs on the device
    with pytest.raises(_cpu_error(fn)) as info:
        out.cpu()
    assert str(info.value).startswith("torchtpu.check: aten.")
    assert "index 12 is out of bounds for dimension 0 with size 10" in str(info.value)
    assert any("test_device_asserts.py" in note for note in info.value.__notes__)
    # The process goes on, with nothing left pending.
    assert torch.equal(fn(w, i.clamp(max=9)).cpu(), fn(W, torch.tensor([1, 9])))


def test_deferred_indices_are_checked_inside_the_fused_program():
    w = W.to("tpu")
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        before = torchtpu.metrics.snapshot().get("executions", 0)
        i = torch.tensor([1, 2, 3], device="tpu") * 4  # pending: 12 is out of range
        out = F.embedding(i, w) * 2
        with pytest.raises(IndexError, match="index 12 is out of bounds"):
            out.sum().item()
        assert torchtpu.metrics.snapshot()["executions"] - before == 1  # one fused program
        good = F.embedding(torch.tensor([1, 2, 3], device="tpu") * 3, w)
        assert torch.equal(good.cpu(), F.embedding(torch.tensor([3, 6, 9]), W))


def test_masked_scatter_and_multinomial_check_their_values_on_the_device(on_device):
    mask = torch.tensor([True, True, False, True], device="tpu")
    x = torch.zeros(4, device="tpu").masked_scatter(mask, torch.ones(2, device="tpu"))
    with pytest.raises(RuntimeError, match=r"as many elements as ones in mask \(3\), got 2"):
        x.cpu()
    torch.multinomial(torch.tensor([[0.5, -1.0]], device="tpu"), 1)
    with pytest.raises(RuntimeError, match="probability tensor contains"):
        torch.tpu.synchronize()


def test_values_in_range_cost_no_host_read_and_stay_bounded(on_device):
    w, i = W.to("tpu"), torch.tensor([0, 9], device="tpu")
    before = torchtpu.metrics.snapshot().get("device_to_host_bytes", 0)
    outs = [F.embedding(i, w) for _ in range(3 * asserts.MAX_PENDING)]
    assert len(asserts._pending) <= asserts.MAX_PENDING
    assert torchtpu.metrics.snapshot().get("device_to_host_bytes", 0) == before
    assert torch.equal(outs[-1].cpu(), F.embedding(torch.tensor([0, 9]), W))
    assert not asserts._pending


def test_compiled_graphs_check_indices_inside_their_program():
    w = W.to("tpu")
    f = torch.compile(lambda i, w: F.embedding(i * 4, w).sum(0), backend="tpu")
    good = f(torch.tensor([0, 1, 2], device="tpu"), w)
    assert torch.equal(good.cpu(), F.embedding(torch.tensor([0, 4, 8]), W).sum(0))
    out = f(torch.tensor([0, 1, 3], device="tpu"), w)  # 12: out of range
    with pytest.raises(IndexError, match="aten.embedding.default: index 12 is out of bounds"):
        out.cpu()


def test_many_pending_checks_do_not_run_the_recording_early():
    w = W.to("tpu")
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        before = torchtpu.metrics.snapshot().get("executions", 0)
        i = torch.tensor([1, 2], device="tpu") * 4  # pending
        outs = [F.embedding(i, w) for _ in range(2 * asserts.MAX_PENDING)]
        assert torchtpu.metrics.snapshot().get("executions", 0) == before  # nothing ran yet
        assert torch.equal(outs[-1].cpu(), F.embedding(torch.tensor([4, 8]), W))
    assert not asserts._pending
