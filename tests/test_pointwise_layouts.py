"""A pointwise op's result is laid out as CPU's TensorIterator lays it out: in its operands' dense
order (transposed, permuted, channels-last), broadcast operands not voting, expanded ones giving
row-major, ties broken as CPU breaks them; an out= argument CPU resizes takes that layout too.
User code branches on it (``.view`` of a transposed result raises on CPU). Compared with CPU
in Strict, Debug and DeferAndFuse; the result is computed in memory order by its own program,
with no copy to lay it out."""

import pytest
import torch

from torchtpu import metrics
from torchtpu.device import tensors

E = torch.tpu.EagerMode
MODES = [E.DEFER_NEVER, E.DEFER_NEVER_AND_LAUNCH_BLOCKING, E.DEFER_AND_FUSE]


def _cases(dev: str) -> dict:
    g = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype).to(dev)

    p, q, row = r(5, 4), r(4, 5), r(5)
    x4 = r(2, 3, 4, 5)
    cl = x4.to(memory_format=torch.channels_last)
    pt = p.t()
    return {
        "unary": pt.neg(),
        "unary_exp": pt.exp(),
        "gelu": torch.nn.functional.gelu(pt),
        "both_transposed": pt + pt,
        "transposed_first": pt + q,      # CPU's tie-break: the first operand's order wins
        "contiguous_first": q + pt,
        "broadcast_row": pt * row,       # a broadcast operand does not vote
        "row_broadcast": row * pt,
        "python_scalar": pt * 2.5,
        "cpu_scalar": pt * torch.tensor(2.0),
        "alpha": torch.add(pt, q, alpha=2.0),
        "promote_int": r(5, 4, dtype=torch.int32).t() + 1.5,
        "promote_half": r(5, 4, dtype=torch.float16).t() + pt,
        "compare": pt > 0,
        "where": torch.where(pt > 0, pt, q),
        "permuted": r(2, 3, 4).permute(2, 0, 1).sin(),
        "permuted_binary": r(2, 3, 4).permute(2, 0, 1) + r(4, 2, 3),
        "channels_last": cl.relu(),
        "channels_last_binary": cl + x4,
        "expanded": r(1, 5).expand(4, 5).neg(),   # not dense: row-major
        "expanded_transposed": r(1, 5).expand(4, 5) + pt,
        "strided_transposed": r(5, 8).t()[:4].neg(),
        "size_one": r(5, 1).t().neg(),
        "chain": (pt * 2).neg() + 1,
        "in_place": pt.clone().add_(1),
        "out_resized": torch.add(pt, pt, out=torch.empty(0, device=dev)),
        "out_shaped": torch.add(pt, pt, out=torch.empty(4, 5, device=dev)),
        "reduction": pt.sum(0),
        "softmax": pt.softmax(-1),
    }


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_pointwise_results_are_laid_out_as_on_cpu(mode):
    want = _cases("cpu")
    with torch.tpu.set_eager_mode(mode):
        got = _cases("tpu")
        strides = {k: v.stride() for k, v in got.items()}
        values = {k: v.cpu() for k, v in got.items()}
    wrong = {k: (want[k].stride(), strides[k]) for k in want if strides[k] != want[k].stride()}
    assert not wrong, wrong
    for k, v in values.items():
        torch.testing.assert_close(v, want[k], atol=1e-3, rtol=1e-3, msg=k)
        assert v.stride() == want[k].stride(), k  # a host copy keeps a dense layout


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_view_of_a_transposed_result_raises_as_on_cpu(mode):
    p = torch.randn(5, 4)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        p.t().neg().view(20)
    with torch.tpu.set_eager_mode(mode):
        with pytest.raises(RuntimeError, match="view size is not compatible"):
            p.to("tpu").t().neg().view(20)
        y = p.to("tpu").t().neg()
        assert not y.is_contiguous() and y.t().is_contiguous()
        assert torch.equal(y.t().view(20).cpu(), p.neg().view(20))


@pytest.mark.parametrize("mode", [E.DEFER_NEVER, E.DEFER_AND_FUSE], ids=lambda m: m.name)
def test_a_laid_out_result_costs_no_copy(mode):
    """One program computes a transposed operand's negation and its host read (the same count
    as a contiguous operand's), and its storage holds the result in memory order."""
    p = torch.randn(5, 4).to("tpu")
    with torch.tpu.set_eager_mode(mode):
        counts = []
        for x in (p.t(), p):
            for _ in range(2):  # the second call: compiled already
                torch.tpu.synchronize()
                before = metrics.snapshot().get("executions", 0)
                y = x.neg()
                host = y.cpu()
                counts.append(metrics.snapshot().get("executions", 0) - before)
            assert torch.equal(host, -x.cpu())
        assert counts[1] == counts[3] == 1, counts
        y = p.t().neg()
        y.cpu()
        assert tuple(tensors.stored_array(y.untyped_storage()).shape) == (5, 4)


def test_a_growing_loop_of_laid_out_results_matches_cpu():
    """Calls over growing sizes run padded to size buckets (``compile/eager_buckets``) unless
    their result is stored in memory order: those run exact, their values CPU's."""
    w = torch.randn(1, 4)
    for n in range(2, 10):
        a = torch.randn(4, n)
        want = (a.t() * 2.0).neg() + w
        got = (a.to("tpu").t() * 2.0).neg() + w.to("tpu")
        assert got.stride() == want.stride()
        torch.testing.assert_close(torch.cat([got, got]).cpu(), torch.cat([want, want]))


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_attention_results_are_laid_out_as_its_inputs_without_a_copy_call(mode, monkeypatch):
    """SDPA's output and gradients take their inputs' layout (the heads' transposed
    projections), values as CPU's; in Strict without calling ``contiguous`` to make it (its
    storage reads the program's result through the permutation: ``results._laid_lazily``)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 8, 2, 16, generator=g).transpose(1, 2) for _ in range(3))

    def step(device):
        leaves = [t.to(device).detach().requires_grad_() for t in (q, k, v)]
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
        (out * out).sum().backward()
        return [out, *(x.grad for x in leaves)]

    want = step("cpu")
    contiguous, calls = torch.Tensor.contiguous, []

    def spy(t, *args, **kwargs):
        calls.append(t.device.type)
        return contiguous(t, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "contiguous", spy)
    with torch.tpu.set_eager_mode(mode):
        for _ in range(2):
            got = step("tpu")
            for t, w in zip(got, want):
                assert t.stride() == w.stride()
                torch.testing.assert_close(t.cpu(), w.detach(), rtol=1e-4, atol=1e-5)
    assert mode is not E.DEFER_NEVER or "tpu" not in calls, calls
