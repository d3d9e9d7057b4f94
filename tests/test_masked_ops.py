"""masked_scatter and masked_select against PyTorch on CPU: the mask broadcast with the target,
results whose shape depends on values written through out=, and CPU's refusals."""

import pytest
import torch

from torchtpu.testing.compare import check_against_cpu


def test_masked_scatter_counts_the_mask_broadcast_with_self():
    # A (5, 1, 5) mask over an empty (5, 0, 5) target has no true position: an empty source fits.
    check_against_cpu(lambda d, m, s: d.clone().masked_scatter_(m, s), torch.empty(5, 0, 5),
                      torch.ones(5, 1, 5, dtype=torch.bool), torch.empty(0))
    # A (4,) mask with 2 ones over (3, 4) needs 6 source elements: 4 are too few, as on CPU.
    mask, source = torch.tensor([True, False, True, False]), torch.arange(4.0)
    check_against_cpu(lambda d, m, s: d.masked_scatter(m, s), torch.zeros(3, 4), mask,
                      torch.arange(6.0))
    for device in ("cpu", "tpu"):
        with pytest.raises(RuntimeError, match="source"):
            torch.zeros(3, 4, device=device).masked_scatter(mask.to(device), source.to(device))


def test_masked_select_out_takes_the_computed_shape():
    values, mask = torch.rand(10, 10), torch.zeros(10, 10, dtype=torch.bool)
    mask[:, ::2] = True

    def selects(v, m):
        # out= of a result whose shape depends on values: resized from empty, and written
        # through a strided view that already has the size.
        out, strided = torch.empty(0, device=v.device), torch.zeros(100, device=v.device)
        torch.masked_select(v, m, out=out)
        torch.masked_select(v.t(), m, out=strided[::2])
        return out, strided

    check_against_cpu(selects, values, mask)


def test_masked_select_refuses_a_non_bool_mask():
    for device in ("cpu", "tpu"):
        with pytest.raises(RuntimeError, match="expected BoolTensor for mask"):
            torch.rand(3, device=device).masked_select(torch.ones(3, dtype=torch.uint8,
                                                                  device=device))


def _programs() -> int:
    import torchtpu

    snap = torchtpu.metrics.snapshot()
    return sum(snap.get(n, 0) for n in ("executable_compiles", "persistent_cache_hits",
                                        "programs_loaded_by_key"))


def test_a_mask_index_at_a_new_shape_is_two_programs():
    # x[mask], nonzero and masked_select count the mask in one program, then take the result in
    # one whose size is that count (JAX's nonzero without a size: a program per step, ~12).
    # (whole tensors: a view the call reads is read by programs of its own first)
    x, rows, cells = torch.randn(7, 13, 3), torch.rand(7, 13) > 0.4, torch.rand(7, 13, 1) > 0.4
    for f, mask in ((lambda x, m: x[m], rows), (lambda x, m: torch.nonzero(m), cells),
                    (lambda x, m: torch.masked_select(x, m), cells)):
        xt, mt = x.to("tpu"), mask.to("tpu")
        before = _programs()
        got = f(xt, mt)
        assert _programs() - before <= 2, (f, _programs() - before)
        assert torch.equal(got.cpu(), f(x, mask))
