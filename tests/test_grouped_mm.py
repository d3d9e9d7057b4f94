"""``torch._grouped_mm`` on tpu (the MoE experts' product of TorchTitan, ``lowering/linalg.py``)
against PyTorch's CPU kernel: the four operand layouts, empty groups, the gradients (which are
grouped products themselves), and one execution per call with no host read of the offsets.
"""

from __future__ import annotations

import pytest
import torch

from torchtpu import metrics

BF16 = torch.bfloat16


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(BF16)


def _offs(*ends):
    return torch.tensor(ends, dtype=torch.int32)


def _close(got, want):
    # Both accumulate in float32 and round once to bfloat16: a rounding apart at most.
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=1e-2, atol=1e-2)


# (a, b, offs): each layout with an empty group (two equal ends) in the grouped dimension
LAYOUTS = {
    "2d_3d": lambda: (_rand(12, 32, seed=0), _rand(3, 24, 32, seed=1).transpose(-2, -1),
                      _offs(5, 5, 12)),
    "3d_2d": lambda: (_rand(3, 10, 32, seed=2), _rand(24, 32, seed=3).t(), _offs(8, 8, 24)),
    "2d_2d": lambda: (_rand(10, 32, seed=4), _rand(32, 16, seed=5), _offs(0, 9, 32)),
    "3d_3d": lambda: (_rand(3, 10, 32, seed=6), _rand(3, 24, 32, seed=7).transpose(-2, -1),
                      None),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grouped_mm_equals_cpu(layout):
    a, b, offs = LAYOUTS[layout]()
    want = torch._grouped_mm(a, b, offs=offs)
    got = torch._grouped_mm(a.tpu(), b.tpu(), offs=None if offs is None else offs.tpu())
    assert got.shape == want.shape and got.dtype == want.dtype
    _close(got, want)
    if layout == "2d_2d":  # the empty group's product is all zeros, as on CPU
        assert not got[0].cpu().any() and not want[0].any()


def test_grouped_mm_runs_as_one_program_without_reading_the_offsets():
    # PyTorch's composite kernel copies offs to the host and runs one mm per group; token
    # counts change every step, so that would be a host read and new mm shapes each step.
    a, b, offs = (t.tpu() for t in LAYOUTS["2d_3d"]())
    torch._grouped_mm(a, b, offs=offs).cpu()  # compiled once
    before = metrics.snapshot()
    out = torch._grouped_mm(a, b, offs=_offs(1, 7, 12).tpu())
    after = metrics.snapshot()
    assert after["executions"] - before["executions"] == 1
    assert after["device_to_host_bytes"] == before["device_to_host_bytes"]
    assert after["executable_compiles"] == before["executable_compiles"]  # new counts: same program
    _close(out, torch._grouped_mm(a.cpu(), b.cpu(), offs=_offs(1, 7, 12)))


# Without size buckets: in the suite an earlier file's growing sizes padded this file's calls once,
# and PyTorch's C++ backward then refused a padded operand's strides ("strides should be multiple
# of 16 bytes"); a growing MoE loop's gradients are the open case
# (bench/results-log.md, session 38).
def test_grouped_mm_gradients_equal_cpu(buckets_off):
    # The MoE forward (2D x 3D); its backward calls 2D x 3D for the input and 2D x 2D for the
    # expert weights, with the experts' token counts as offsets.
    a, b, offs = LAYOUTS["2d_3d"]()
    grad = _rand(12, 24, seed=9)
    results = []
    for device in ("cpu", "tpu"):
        x = a.detach().to(device).requires_grad_()
        w = b.detach().to(device).requires_grad_()
        torch._grouped_mm(x, w, offs=offs.to(device)).backward(grad.to(device))
        results.append((x.grad.cpu(), w.grad.cpu()))
    (want_x, want_w), (got_x, got_w) = results
    _close(got_x, want_x)
    _close(got_w, want_w)
    assert not got_w[1].any()  # the empty group's expert gets no gradient


def test_grouped_mm_bad_offsets_dtype_raises_as_on_cpu():
    a, b, offs = LAYOUTS["2d_3d"]()
    with pytest.raises(RuntimeError, match="int32"):
        torch._grouped_mm(a.tpu(), b.tpu(), offs=offs.long().tpu())
